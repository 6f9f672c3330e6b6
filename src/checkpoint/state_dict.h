// A wrapped model's state dict as this rank holds it (paper §3.2): every tensor a checkpoint
// names — parameters by their first name, buffers, and the optimizer's per-parameter tensors as
// "state.<name>.<key>" — with the whole tensor's shape and the contiguous range of its flattened
// elements this rank holds. The FlatParameter layout decides the ranges: a parameter's part of a
// rank's shard is one contiguous range of its flattened elements (flat_param.h's ShardSlice), and
// an optimizer state tensor has its parameter's local shape, so it is placed the same way.
//
// Also here: the manifest's description of the model (names, shapes, dtypes, tied aliases, units)
// and a range's decomposition into boxes, the form torch.distributed.checkpoint places pieces in.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>

#include "checkpoint/optimizer_state.h"
#include "wrap/sharded_root.h"

namespace fsdp {

// One named tensor's part on this rank.
struct StatePiece {
  std::string key;             // "blocks.0.fc.weight", "state.blocks.0.fc.weight.exp_avg"
  std::string folder;          // "model" or "optim": which folder of a checkpoint holds it
  std::string param;           // optimizer state: the parameter's name ("" for model pieces)
  std::string state_key;       // optimizer state: "exp_avg", ... ("" for model pieces)
  std::vector<int64_t> shape;  // the whole tensor's
  c10::ScalarType dtype = c10::kFloat;
  int64_t flat_begin = 0;      // first element held, in the flattened whole tensor
  at::Tensor local;            // 1-D, contiguous: the elements [flat_begin, flat_begin + numel)
  int unit = -1;               // the unit whose shard holds it (-1: outside the units)
  int64_t shard_offset = 0;    // where `local` starts in its unit's flat shard
  // Outside the units (unit -1), a tensor is whole on every rank (a buffer, a replicated ignored
  // parameter: rank 0 writes it), or this rank's own rows of a row-sharded ignored parameter
  // (ignored_state.h: every rank writes its rows, whatever its replica).
  bool own_rows = false;
};

// The optimizer's part of a rank's state: per parameter (first name), whether it has state and
// its step count, plus the group hyper-parameters.
struct OptimizerMeta {
  std::string type;                  // "AdamW"
  nlohmann::json groups;             // [{"options": {...}, "params": [names]}]
  nlohmann::json steps;              // {name: step} for parameters with state
};

struct RankState {
  std::vector<StatePiece> pieces;    // model pieces first (unit order, then ignored parameters),
                                     // then buffers, then optimizer
  std::optional<OptimizerMeta> optimizer;
  std::vector<at::Tensor> unit_shards;  // each unit's flat shard, padding included (LOCAL saves)
};

// This rank's pieces: views of its shards, of the ignored parameters it holds and of the
// optimizer's tensors, no copies. Buffers and replicated ignored parameters are listed on every
// rank (each holds them whole). `optimizer` may be null.
RankState collect_rank_state(detail::ShardedRoot& root, torch::optim::Optimizer* optimizer);

// The model's description for a manifest: {"params": {name: {shape, dtype, unit, aliases}} (an
// ignored parameter: unit -1, its whole shape, and "ignored": "row_sharded" or "replicated"),
// "buffers": {name: {shape, dtype}}, "units": [{name, params, numel, padded_numel, shard_numel}]}.
nlohmann::json describe_model_state(detail::ShardedRoot& root);

// The boxes (per-dimension offsets and sizes) that elements [begin, end) of a row-major tensor of
// `shape` cover, in order; each box is itself a contiguous range of the flattened tensor. A 2-D
// range is at most three boxes: a partial first row, whole rows, a partial last row.
struct Box {
  std::vector<int64_t> offsets, sizes;
  int64_t flat_begin = 0, flat_end = 0;
};
std::vector<Box> boxes_of_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

// This rank's elements of parameter `i` of `unit`: a view of the unit's flat shard.
at::Tensor shard_slice(const Unit& unit, size_t i);

// The elements of parameter (unit, index) from a unit's unsharded flat tensor, in its shape.
at::Tensor view_of_param(const at::Tensor& unsharded_flat, const FlatParamEntry& entry);

// Collective over `root`'s shard group: for each unit, the whole flat tensor of one "stream" (the
// parameters, or one optimizer state key), in the unit's master dtype, assembled from every rank's
// pieces and handed to `consume` with the unit. Holds one unit at a time. `local_of(unit, i)`
// returns this rank's elements of the unit's parameter i (undefined: zeros).
//   TO_ALL:   an all-gather; every rank receives every unit (full_state_dict on all ranks).
//   TO_RANK0: for writing: rank 0 receives each shard straight into its slice of the unit's buffer
//             (point-to-point, no staging copy), so it holds one unit beyond its shards; the other
//             ranks of its shard group send a copy of their shard (a 1/F unit) and never receive;
//             other replicas do nothing. `consume` runs on rank 0 only.
enum class GatherTo { TO_ALL, TO_RANK0 };
void gather_units(detail::ShardedRoot& root, const std::function<at::Tensor(const Unit&, size_t)>& local_of,
                  const std::function<void(const Unit&, const at::Tensor&)>& consume, GatherTo to);

// Every rank's string, in rank order (Gloo, CPU): how errors and small agreements travel. Each
// rank receives W times the longest string: for short ones only.
std::vector<std::string> all_gather_strings(const GroupPtr& group, const std::string& mine);
// Every rank's string on rank 0, in rank order (the others get an empty list): how the parts of a
// manifest travel. Rank 0 receives each string at its own length (point-to-point), so the bytes
// moved are the sum of the parts, not W times the longest on every rank.
std::vector<std::string> gather_strings_to_rank0(const GroupPtr& group, const std::string& mine);

}  // namespace fsdp
