// The per-rank memory plan of a sharded model, computed from its shapes alone: works on a model
// built with fsdp::meta_init, so a model that fits nowhere (the paper's 175B GPT) can be planned
// on any machine. What each rank holds (§3.2, §4.4):
//   sharded parameters  ceil(ψ_i / F) per unit, in the parameters' dtype (the fp32 master)
//   sharded gradients   the same count, in that dtype (param_dtype with keep_low_precision_grads)
//   Adam state          2 × the sharded parameters (exp_avg, exp_avg_sq), fp32
//   unsharded units     the peak of gathered parameters in param_dtype: with reshard after forward,
//                       the root unit + the unit computing + the prefetched ones (largest first)
//                       + with hpZ every unit's secondary shard; without it, every unit
//   unsharded gradients one unit's gradients in param_dtype while its reduction is being prepared,
//                       plus its reduce buffer in reduce_dtype and, with F > 1, the buffers of the
//                       reduce-scatters still in flight (at most 2 more: backward waits beyond)
//   activations         the caller's estimate, Options::memory_budget.activation_bytes (fsdp cannot
//                       know them without running the model: batch, sequence length, checkpointing)
#pragma once

#include <algorithm>

#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "fsdp/mesh.h"
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
  // Gathered while the head's backward runs, at the start of backward: the root and, with
  // BACKWARD_PRE, the units prefetched from it (the other units were freed after forward).
  int64_t head_unsharded_params = 0;
  // Gloo (CPU) runs an all-gather into a flat staging copy of its whole output and copies it out
  // at the end: the units backward prefetches hold that second copy while their all-gather runs
  // (counted while the units' backwards run: measured there, not at the head's moment). With
  // quantized all-gathers, the records they gather into (F per unit; on the CPU with their staging
  // copy) instead.
  int64_t gather_staging = 0;
  // hpZ (Options::reshard_after_forward_to = N): every non-root unit's 1/N, in the compute dtype,
  // held from its forward to its backward; included in peak_unsharded_params and
  // head_unsharded_params (all of them are held when backward starts).
  int64_t secondary_shards = 0;
  int64_t peak_unsharded_grads = 0;
  int64_t activations = 0;  // the caller's estimate (Options::memory_budget.activation_bytes)
  // An asynchronous checkpoint's host copy (shards, the ignored parameters this rank holds, and
  // their Adam state) while it is written, through the next step
  // (Options::memory_budget.async_checkpoint).
  int64_t checkpoint_copy = 0;
  // Parameters fsdp leaves alone (Options::ignored_modules), as this rank holds them: their
  // values, autograd's gradients of them and Adam's two fp32 moments.
  int64_t ignored_state = 0;
  int64_t head_activations = 0;  // of `activations`, the head's (freed first in backward)
  // What backward's peak is made of (backward_peak()): the units backward walks through, the
  // largest unit's unsharded gradients in the compute dtype and its reduce buffer (a reduce-scatter
  // in flight holds it: in place on the CPU, where Gloo would reduce a copy), the root's gradients
  // (they stay until the end of backward), and how many reductions may be in flight besides the
  // newest (0 without reduce-scatters, F = 1).
  int backward_units = 1;
  int64_t unit_grads = 0, reduce_buffer = 0, root_grads = 0;
  int reductions_in_flight = 0;
  int64_t replica_buffer = 0;  // hybrid: what the replica all-reduce of a reduction in flight holds

  // What backward holds besides the state, at its peak. First the head's backward: every
  // activation, the root's gradients and head_unsharded_params. Then, as backward walks the units
  // in reverse (peak_unsharded_params gathered), each frees its share of the other activations
  // (taken as equal) and hands its gradients to a reduction. While unit j runs, the activations of
  // units not yet done, the root's gradients, unit j's gradients and the reduce-scatters still in
  // flight are alive; when it is done, its activations are gone and its reduce buffer is there.
  // The sharded gradients of the units done are alive too (those of unit j: its reduce buffer with
  // F = 1, a slice of it otherwise). The largest such sum.
  int64_t backward_peak() const;
  // The peak per rank: the state and backward's peak, for the usual loop, whose zero_grad (to
  // None, libtorch's default) frees the sharded gradients before forward: backward builds them
  // unit by unit (backward_peak counts those of the units done), and they are all held from its
  // end through the optimizer step.
  int64_t total() const {
    return sharded_params + adam_state + checkpoint_copy + ignored_state + std::max(backward_peak(), sharded_grads);
  }
  // A loop that keeps its gradients across backwards (accumulation without zero_grad in between,
  // or zero_grad that zeroes instead of freeing) holds every sharded gradient through backward.
  int64_t total_with_gradients_held() const {
    return sharded_params + sharded_grads + adam_state + checkpoint_copy + ignored_state + backward_peak();
  }
};

// `local_world_size` is the ranks per node (F for the hybrid strategies without a shard size).
MemoryPlan plan_memory(torch::nn::Module& model, int world_size, const Options& options, int local_world_size = 8);

// The budget `options` give one rank of `world_size` (`local_world_size` per node) on `device`,
// in bytes: Options::memory_budget resolved (kAuto read from this machine); 0 when off. Local to
// this rank: the constructor agrees on the smallest over all ranks before comparing.
int64_t memory_budget_bytes(const Options& options, c10::Device device, int local_world_size);

// Plans `model` (built, deferred or meta) for `mesh` and refuses it with explain_over_budget's text
// (std::invalid_argument) when it exceeds the budget: collectively, every rank comparing with the
// smallest budget any rank has, so all refuse or none does. FullyShardedDataParallel calls it
// before materializing anything; call it yourself on a meta_init model to refuse before building.
// `device`: where the shards will live. A positive budget on CUDA is also enforced (the caching
// allocator's per-process fraction).
void check_memory_budget(torch::nn::Module& model, Mesh& mesh, const Options& options, c10::Device device);

// Why the plan does not fit `budget` and what would (other strategies, F, mixed precision, a
// smaller batch, more ranks), computed from `model`'s shapes: the text of the refusal.
std::string explain_over_budget(torch::nn::Module& model, const MemoryPlan& plan, const Options& options,
                                int local_world_size, int64_t budget);

// "1.23 GiB", "45.6 MiB", "7.8 KiB".
std::string format_bytes(int64_t bytes);

// A readable table of one or more plans side by side (e.g. fp32 and bf16).
std::string format_plans(const std::vector<MemoryPlan>& plans);

}  // namespace fsdp
