// Writing one rank's part of a checkpoint (docs/checkpoints.md): the safetensors files under a
// checkpoint's temporary folder and the manifest entries that describe them. The commit (manifest,
// rename, keep-last) is checkpoint.cpp's.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "fsdp/checkpoint.h"
#include "checkpoint/state_dict.h"

namespace fsdp {

// What one rank wrote: {"pieces": {key: [{file, key, flat: [b, e], at}]}, "files": {file: {bytes,
// crc32c}}}, file names relative to the checkpoint folder. A piece holds elements [b, e) of the
// flattened tensor `key`, stored from element `at` of the file's tensor named by the piece's key.
using WrittenPart = nlohmann::json;

// A rank's file of a SHARDED or LOCAL save: FOLDER/rank-RRRRR-of-WWWWW[.part-K].safetensors.
std::string rank_file(const std::string& folder, int rank, int world, int part);

// SHARDED: this rank's pieces as boxes in the whole tensors (more files when a range needs more
// than one box), written only by the ranks of the first replica (`writes` false: nothing).
// LOCAL: this rank's raw flat shards and optimizer slices, one file per folder. Buffers are
// written by rank 0 only.
WrittenPart write_rank_files(const std::string& folder, const RankState& state, StateDictKind kind, int rank,
                             int world_size, bool writes);

// FULL: collective over the shard groups; rank 0 writes model/model.safetensors and, with an
// optimizer, optim/optim.safetensors, one unit at a time. Other ranks return an empty part.
WrittenPart write_full_files(const std::string& folder, detail::ShardedRoot& root, const RankState& state);

// The model file of export_full: one safetensors file at `path` (rank 0), parameters and buffers
// whole, aliases in its metadata. Collective.
void write_full_model_file(const std::string& path, detail::ShardedRoot& root, const RankState& state);

// Test hook for crash safety (tests/test_checkpoint.cpp): with FSDP_TEST_KILL_RANK_IN_SAVE=r:n in
// the environment, rank r kills itself (SIGKILL) in its n-th save (default 1), after the first
// tensor of its first file: a deterministic point, not a timing.
void maybe_killed_for_test(int rank);

}  // namespace fsdp
