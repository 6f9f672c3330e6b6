// Reading a checkpoint, or a plain state dict file, into a wrapped model (docs/checkpoints.md).
// Everything is read and checked into staging tensors first ("stage"); only when every rank has
// staged all of it does anything change ("apply", checkpoint_load.cpp decides). Each rank reads only
// the elements it holds under the model's current layout, from whichever saved pieces contain
// them: this is what lets a checkpoint saved at one world size and strategy load at another.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "checkpoint/manifest.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/state_dict.h"

namespace fsdp {

// Where saved elements of one tensor live: elements [begin, end) of the flattened tensor, stored
// from element `at` of tensor `key` in `file` (or of `memory`, for state dicts read into memory).
struct SavedPiece {
  std::string file, key;
  int64_t begin = 0, end = 0, at = 0;
  at::Tensor memory;
  // FULL and SHARDED checkpoints store each piece as a whole tensor of its file, a box of the
  // tensor of this shape (SHARDED: at the file's DCP_SHARDING_INFO offsets): the reader checks the
  // file says the same as the manifest. Not for LOCAL pieces (ranges of raw flat shards).
  bool boxed = false;
  std::vector<int64_t> whole_shape;
};

// The tensors a checkpoint or file holds: shapes and dtypes by name, their pieces, and the names a
// tied weight is also known by.
struct SavedTensors {
  std::string origin;  // the checkpoint folder or file, for messages
  std::string folder;  // what pieces' file names are relative to
  std::map<std::string, std::vector<int64_t>> shapes;
  std::map<std::string, c10::ScalarType> dtypes;
  std::map<std::string, std::vector<SavedPiece>> pieces;
  std::map<std::string, std::string> alias_of;  // other name -> saved name
  std::map<std::string, int64_t> file_bytes;    // a checkpoint's files' sizes, as its manifest lists them
};

// The manifest's tensors (model, buffers and optimizer state).
SavedTensors saved_from_manifest(const std::string& folder, const nlohmann::json& manifest);
// A plain safetensors file (one tensor per name, or torch.distributed.checkpoint pieces).
SavedTensors saved_from_safetensors(const std::string& path);
// A dict of tensors in memory (a torch.save file's).
SavedTensors saved_from_memory(const std::string& origin, const std::map<std::string, at::Tensor>& tensors);

// What a load will change, staged.
struct StagedLoad {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // destination <- staged (shards, buffers)
  std::vector<std::pair<at::Tensor, ParamOptimState>> optimizer_states;  // parameter -> its new state
  std::vector<nlohmann::json> group_options;  // per optimizer group, in order
  std::set<std::string> files_read;             // the pieces' files this rank opened (as the manifest names them)
};

// Reads the model's parameters and buffers this rank holds. Throws (naming the name, the file and
// the problem) for a name the model lacks or the checkpoint lacks, a shape that differs, a piece
// missing or unreadable.
void stage_model(detail::ShardedRoot& root, const SavedTensors& saved, StagedLoad& out);
// Reads the optimizer's state for this rank's elements and its groups' hyper-parameters.
void stage_optimizer(detail::ShardedRoot& root, torch::optim::Optimizer& optimizer, const SavedTensors& saved,
                     const nlohmann::json& manifest_optimizer, StagedLoad& out);
// Checks the files the manifest lists: each rank compares the size of every file it read
// (`files_read`) with the manifest's, and computes the checksum of every file whose index is this
// rank modulo W. Every file is checked by one rank at least; no rank looks at all W ranks' files.
void verify_files(const std::string& folder, const nlohmann::json& manifest, int rank, int world_size,
                  const std::set<std::string>& files_read);

void apply(StagedLoad& staged, torch::optim::Optimizer* optimizer);

}  // namespace fsdp
