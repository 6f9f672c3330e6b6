// The per-rank memory plan of a sharded model, computed from its shapes alone: works on a model
// built with fsdp::meta_init, so a model that fits nowhere (the paper's 175B GPT) can be planned
// on any machine. What each rank holds (§3.2, §4.4):
//   sharded parameters  ceil(ψ_i / F) per unit, in the parameters' dtype (the fp32 master)
//   sharded gradients   the same count, in that dtype (param_dtype with keep_low_precision_grads)
//   Adam state          2 × the sharded parameters (exp_avg, exp_avg_sq), fp32
//   unsharded units     the peak of gathered parameters in param_dtype: with reshard after forward,
//                       the root unit + the unit computing + the prefetched ones (largest first);
//                       without it, every unit
//   unsharded gradients one unit's gradients in param_dtype while its reduction is being prepared,
//                       plus that unit's reduce buffer in reduce_dtype
// Activations are not in it: they depend on the batch, the sequence length and checkpointing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "fsdp/options.h"
#include "fsdp/unit_info.h"

namespace fsdp {

struct MemoryPlan {
  int world_size = 1, shard_size = 1;
  std::string strategy;
  std::string param_dtype, reduce_dtype, master_dtype;
  std::vector<UnitInfo> units;
  int64_t total_numel = 0;        // distinct parameter elements
  int64_t largest_unit_numel = 0;
  // Per rank, bytes.
  int64_t sharded_params = 0;
  int64_t sharded_grads = 0;
  int64_t adam_state = 0;
  int64_t peak_unsharded_params = 0;
  int64_t peak_unsharded_grads = 0;
  int64_t total() const { return sharded_params + sharded_grads + adam_state + peak_unsharded_params + peak_unsharded_grads; }
};

// `local_world_size` is the ranks per node (F for the hybrid strategies without a shard size).
MemoryPlan plan_memory(torch::nn::Module& model, int world_size, const Options& options, int local_world_size = 8);

// A readable table of one or more plans side by side (e.g. fp32 and bf16).
std::string format_plans(const std::vector<MemoryPlan>& plans);

}  // namespace fsdp
