// The parameters fsdp ignores (Options::ignored_modules / ignored_parameters) as checkpoints hold
// them (docs/checkpoints.md, "Ignored parameters"). Two kinds:
//   ROW-SHARDED  declared in Options::row_sharded_parameters: one table, each rank holding its own
//                rows, which are one contiguous range of the table's flattened elements, placed
//                like a unit's shard (state_dict.h): saved whole under the parameter's name and
//                the table's shape, each rank writing its rows (SHARDED, LOCAL) or rank 0
//                gathering them (FULL, export_full, full_state_dict); a load reads each rank's
//                rows from the saved whole, at any world size.
//   REPLICATED   every other one: every rank holds the same whole tensor; saved once, rank 0's
//                copy, after checking that the ranks' copies are equal; every rank loads it whole.
// Their optimizer state is placed like them, under the same keys as the units' parameters'.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "checkpoint/state_dict.h"
#include "wrap/row_sharded.h"
#include "wrap/sharded_root.h"

namespace fsdp {

struct IgnoredParam {
  std::string name;            // its first name in the model's named_parameters()
  at::Tensor param;            // what this rank holds: its rows, or the whole tensor
  std::vector<int64_t> shape;  // the whole tensor's
  int64_t flat_begin = 0;      // this rank's first element of the whole tensor, flattened
  const detail::RowShardedTable* table = nullptr;  // its declaration; null: replicated
};

// The model's ignored parameters, each once, in named_parameters() order.
std::vector<IgnoredParam> ignored_params(detail::ShardedRoot& root);

// Every parameter a checkpoint names, by TensorImpl: the units' (by their first name) and the
// ignored ones. Optimizer groups are described and matched by these names.
std::map<const c10::TensorImpl*, std::string> saved_parameter_names(detail::ShardedRoot& root);

// Collective over the job. Throws std::invalid_argument on every rank, naming the parameter and
// the ranks, when a replicated ignored parameter is not bitwise the same on every rank: a
// checkpoint holds rank 0's copy only, and would silently lose the others (a table left out of
// Options::row_sharded_parameters; a parameter each rank stepped with its own gradients).
// `what` names the operation for the message.
void check_replicated_agree(detail::ShardedRoot& root, const std::string& what);

// Collective over the job: the whole tensor of `p` from every rank's `local` (this rank's part of
// one stream of it: the parameter or one optimizer state tensor, in the parameter's shape;
// undefined: zeros), on the CPU. Replicated: this rank's own, no communication. Row-sharded:
// TO_RANK0 has rank 0 receive each rank's rows point-to-point into the table (it holds one table
// at a time) and returns an undefined tensor on the other ranks; TO_ALL gives every rank the
// table (an all-gather of equal, padded parts).
at::Tensor whole_ignored(detail::ShardedRoot& root, const IgnoredParam& p, const at::Tensor& local, GatherTo to);

// full_state_dict's part (collective): each ignored parameter whole, on its device, a copy,
// appended to `out` when `keep` (the ranks that keep a full state dict).
void append_whole_ignored(detail::ShardedRoot& root, std::vector<std::pair<std::string, at::Tensor>>& out, bool keep,
                          GatherTo to);

}  // namespace fsdp
