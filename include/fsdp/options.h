// What a user chooses when sharding a model: the strategy (paper §3.2: the sharding factor F and
// whether to reshard after forward) and how the model is cut into FSDP units.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

namespace fsdp {

class TensorParallel;  // fsdp/tensor_parallel.h

enum class ShardingStrategy {
  FULL_SHARD,          // F = W, reshard after forward (ZeRO-3)
  SHARD_GRAD_OP,       // F = W, keep unsharded from forward until after backward (ZeRO-2)
  NO_SHARD,            // F = 1: replication with all-reduce, like DDP
  HYBRID_SHARD,        // 1 <= F <= W: shard within groups of F ranks, replicate across them
  HYBRID_SHARD_ZERO2,  // hybrid sharding that keeps parameters unsharded until after backward
};

// "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2".
ShardingStrategy parse_strategy(const std::string& name);
std::string to_string(ShardingStrategy strategy);

// When backward gathers the next unit's parameters (paper §3.3.2). The order is the reverse of
// this iteration's post-forward order, recorded afresh every iteration.
enum class BackwardPrefetch {
  NONE,           // gather a unit only when backward reaches it: all-gathers are fully exposed
  BACKWARD_PRE,   // when a unit's backward starts, issue the next unit's all-gather (overlaps the
                  // current unit's gradient computation; one more unit's memory)
  BACKWARD_POST,  // when a unit's backward ends, issue the next unit's all-gather, ahead of the
                  // current unit's reduce-scatter
};

// "none", "backward_pre", "backward_post".
BackwardPrefetch parse_backward_prefetch(const std::string& name);
std::string to_string(BackwardPrefetch mode);

// How fsdp knows that a unit is about to compute (C++ modules have no forward hooks; docs/design.md).
enum class UnitDetection {
  // The units' parameters (and every view of them) carry a dispatch key of fsdp's: only operators
  // that touch a parameter enter fsdp, the rest run at libtorch's own speed. The default.
  DISPATCH_KEY,
  // A RecordFunction callback inspects every operator's inputs while a root is in forward or
  // backward (about 1 us an operator). For code that reaches a parameter's storage through a
  // tensor not made from the parameter by a view op (a TensorImpl built on its Storage, set_()
  // onto it), which carries no key.
  RECORD_FUNCTION,
};

// "dispatch_key", "record_function".
UnitDetection parse_unit_detection(const std::string& name);
std::string to_string(UnitDetection mode);

// How a CPU (Gloo) shard group reduce-scatters gradients. NCCL always uses its own (a ring).
enum class GlooReduceScatter {
  RING,        // fsdp's ring over Gloo's send/recv: (F-1)/F of a unit's gradients per rank (default)
  ALL_REDUCE,  // Gloo's reduce-scatter, an all-reduce of the whole input: twice those bytes
};

// "ring", "all_reduce".
GlooReduceScatter parse_gloo_reduce_scatter(const std::string& name);
std::string to_string(GlooReduceScatter mode);

// Quantized all-gather of parameters (ZeRO++'s qwZ; quantized_all_gather.h): each rank quantizes
// its shard in blocks with one fp32 scale each, the all-gather moves those bytes, and every rank
// dequantizes into the compute dtype. The master weights, the optimizer and the gradients' reduction
// are untouched; what a unit computes with is its parameters to within the quantization's error.
enum class AllGatherQuantization {
  NONE,
  INT8,      // symmetric, scale = max|x| / 127 per block: error <= max|x| / 254 of the block
  FP8_E4M3,  // scale = max|x| / 448 per block, then e4m3 (3 mantissa bits: relative error <= 1/16)
};

// "none", "int8", "fp8".
AllGatherQuantization parse_all_gather_quantization(const std::string& name);
std::string to_string(AllGatherQuantization mode);

// Native mixed precision (paper §4.4). The sharded parameters stay in their own (fp32) dtype and
// are what the optimizer steps; each unit is cast once to param_dtype before its all-gather, so
// the all-gather and the computation run in param_dtype; gradients are reduced in reduce_dtype and
// cast back into the fp32 sharded gradients.
struct MixedPrecision {
  c10::ScalarType param_dtype = c10::kBFloat16;   // all-gather and compute
  c10::ScalarType reduce_dtype = c10::kBFloat16;  // reduce-scatter and all-reduce of gradients
  c10::ScalarType buffer_dtype = c10::kBFloat16;  // floating-point buffers, cast once at construction
  // Hand the optimizer gradients in param_dtype instead of the parameters' dtype (saves memory;
  // the optimizer then mixes dtypes).
  bool keep_low_precision_grads = false;
};

// "fp32", "bf16", "fp16" -> the dtype (throws std::invalid_argument with the valid names).
c10::ScalarType parse_dtype(const std::string& name);
std::string dtype_name(c10::ScalarType dtype);

// Decides whether a module becomes its own FSDP unit. Called bottom-up (children before parents)
// with the module's fully qualified name and the number of parameter elements in its subtree
// that no deeper unit has claimed yet.
using WrapPolicy = std::function<bool(const std::string& fqn, const torch::nn::Module& module,
                                      int64_t unclaimed_numel)>;

// Every module whose type is one of Ts becomes a unit (e.g. the transformer block type).
template <typename... Ts>
WrapPolicy module_type_policy() {
  return [](const std::string&, const torch::nn::Module& m, int64_t) {
    return ((dynamic_cast<const Ts*>(&m) != nullptr) || ...);
  };
}

// A module becomes a unit once its subtree holds at least `min_numel` unclaimed elements
// (like PyTorch's size_based_auto_wrap_policy). A ModuleList or ModuleDict never does (its
// children may; what they leave goes to the module above). Unlike PyTorch, the children of a
// MultiheadAttention are not kept with it: its out_proj may become a unit of its own, which the
// attention's functional forward gathers like any other (fsdp sees a unit run by its parameters).
WrapPolicy size_based_policy(int64_t min_numel);

// What one rank may hold, checked against the memory plan (fsdp/plan.h) when a model is wrapped,
// before anything is materialized or gathered: a configuration that cannot fit is refused on
// every rank alike, with the plan and what would make it fit, instead of ending in the kernel's
// OOM killer (CPU) or an allocator error (CUDA) minutes later.
struct MemoryBudget {
  // Bytes per rank. kAuto: on CPU the machine's available memory (MemAvailable, the smallest any
  // rank sees) divided by the ranks on this node, or less where a memory cgroup's limit (a
  // container's, shared by the local ranks in it, or one per rank) or a data limit (RLIMIT_DATA)
  // leaves less; on CUDA the device's total memory. kOff: no
  // check. A positive value on CUDA is also enforced, through the caching allocator's per-process
  // memory fraction.
  static constexpr int64_t kAuto = -1, kOff = 0;
  int64_t max_bytes_per_rank = kAuto;
  // Activation memory per rank, which fsdp cannot know without running the model (it depends on
  // the batch, the sequence length and checkpointing): the caller's estimate, added to the plan.
  int64_t activation_bytes = 0;
  // Of activation_bytes, what the computation after the last unit that is not the root holds (a
  // language model's head: its logits, their log-softmax and the loss's gradient of that size):
  // backward frees it first, before any unit's backward starts. 0: all activations are taken as
  // spread evenly over the units.
  int64_t head_activation_bytes = 0;
  // Asynchronous checkpoints (checkpoint.h) keep a copy of this rank's shards and optimizer state
  // in host memory until it is written: counted in the plan when set. Set it where host memory is
  // what the budget holds (the CPU); on CUDA the copy is not device memory.
  bool async_checkpoint = false;
};

// The ignored parameters split by rows across the ranks of the mesh the model is wrapped over,
// as torchrec's row-wise sharding splits an embedding table (in PyTorch, a DTensor placed
// Shard(0); a ShardedTensor with one shard per rank): each rank declares its own part, and the
// ranks' row ranges tile the table. Checkpoints save each table whole, under the parameter's name
// and the table's shape [rows, ...], with its optimizer state (AdamW's exp_avg and exp_avg_sq of
// the rows, and the step count) under the same keys as every other parameter's: a SHARDED save
// writes each rank's rows as its own piece at its row offset (Python's torch.distributed.
// checkpoint reads the table whole), a FULL one (and export_full, full_state_dict) gathers them
// to rank 0. A load at any world size re-splits the table: each rank reads the rows its
// declaration names from the saved whole, and a checkpoint without the table, or with another
// shape, is refused by name with nothing changed on any rank.
//
// Checked when the model is wrapped, on every rank alike (so that no rank waits for another
// that failed): the parameter must be ignored (in ignored_modules or ignored_parameters), be
// declared once, have rows [row_begin, row_begin + parameter.size(0)) within [0, rows); and
// across the ranks the tables must have the same rows, trailing shape and dtype, and their row
// ranges must tile [0, rows) exactly, each row held by one rank (a rank may hold none). A
// refusal names the parameter and the ranks, gaps or overlaps to fix. Not with
// tensor_parallel (the rows' ranks would be the data-parallel mesh's, and a TP model's
// checkpoints are gathered per TP group).
//   opts.ignored_modules = {model->tables};
//   opts.row_sharded_parameters = {{model->tables->weight, model->tables->row_begin(), total_rows}};
struct RowShardedParameter {
  at::Tensor parameter;   // this rank's rows [local_rows, ...]: a parameter of the wrapped model
  int64_t row_begin = 0;  // the table's row that this rank's first row is
  int64_t rows = 0;       // rows of the whole table, all ranks together
};

struct Options {
  ShardingStrategy strategy = ShardingStrategy::FULL_SHARD;
  // F for the hybrid strategies; 0 means LOCAL_WORLD_SIZE (shard within a node). Ignored by the
  // others (FULL_SHARD and SHARD_GRAD_OP use F = W, NO_SHARD uses F = 1).
  int shard_size = 0;
  // Modules that become units besides those marked with fully_shard(). Empty: no automatic units.
  WrapPolicy auto_wrap_policy;
  // Parameters fsdp leaves alone (PyTorch's ignored_modules / ignored_states): every parameter of
  // these modules' subtrees, and these parameters. They are in no unit: never flattened, sharded,
  // gathered, reduced, cast for mixed precision or broadcast by sync_module_states, and autograd
  // accumulates their gradients as in plain libtorch. What they hold is the caller's to keep
  // consistent: the paper's DHEN (§2.3, §5) shards its embedding tables model-parallel this way,
  // each rank its own rows, exchanged with all-to-all (models/row_sharded_embedding.h). They may
  // differ in shape across ranks. They stay in parameters() (an optimizer built from it steps
  // them) but clip_grad_norm_ covers only fsdp's parameters (and those it is given). A
  // deferred_init model materializes them whole, on every rank.
  //
  // Checkpoints save them with the rest, by what kind they are (docs/checkpoints.md, "Ignored
  // parameters"): an ignored parameter declared in row_sharded_parameters holds its rank's rows
  // of a table; every other one is REPLICATED: every rank holds the same whole tensor (kept so
  // by the caller: fsdp averages none of their gradients), saved once, rank 0's copy. A save
  // checks that the ranks' copies are bitwise equal and refuses, naming the parameter, when they
  // are not (a table left undeclared; a parameter each rank trained on its own gradients).
  std::vector<std::shared_ptr<torch::nn::Module>> ignored_modules;
  std::vector<at::Tensor> ignored_parameters;
  // Which ignored parameters hold their rank's rows of a table (see RowShardedParameter above);
  // the others are replicated.
  std::vector<RowShardedParameter> row_sharded_parameters;

  UnitDetection unit_detection = UnitDetection::DISPATCH_KEY;

  // --- overlap of communication with computation (paper §3.3, §3.4) ---
  BackwardPrefetch backward_prefetch = BackwardPrefetch::BACKWARD_PRE;
  // Issue the next units' all-gathers when a unit's forward starts, in the order the previous
  // iteration ran them. Only right for static graphs (a wrong guess costs memory and bandwidth,
  // never correctness), so off by default.
  bool forward_prefetch = false;
  // How many units ahead a prefetch reaches (PyTorch prefetches 1).
  int prefetch_count = 1;
  // The rate limiter: at most this many all-gathers in flight; 0 switches it off. On CUDA an
  // all-gather stays in flight until the device has freed its unsharded buffer (it bounds how
  // far the CPU can run ahead of the caching allocator); on CPU until the compute thread has
  // waited for it.
  int limit_all_gathers = 2;

  // --- fewer bytes on the wire (ZeRO++'s three ideas; issue 26) ---
  GlooReduceScatter gloo_reduce_scatter = GlooReduceScatter::RING;
  // hpZ (FSDP2's reshard_after_forward=<int>): after a unit's forward, keep its gathered
  // parameters sharded over groups of this many consecutive ranks (a secondary shard of 1/N of the
  // unit per rank, in the compute dtype) instead of freeing them to the F-way shard, so that
  // backward's all-gather runs within the group: with N = ranks per host it never crosses hosts.
  // 0: off; kRanksPerNode: N = LOCAL_WORLD_SIZE. N must divide F and be smaller; only for the
  // strategies that reshard after forward (FULL_SHARD, HYBRID_SHARD). The memory plan counts the
  // secondary shards.
  static constexpr int kRanksPerNode = -1;
  int reshard_after_forward_to = 0;
  // Per unit, by its module path (UnitInfo::name), what it reshards to after forward instead:
  // 0 frees it to its shard (no secondary shard: a large embedding whose 1/N would cost too much),
  // N or kRanksPerNode as above. A name that is no unit is refused with the units' names.
  std::map<std::string, int> reshard_after_forward_to_by_unit;
  // Units, by module path, that stay gathered from their forward until their backward although the
  // strategy reshards after forward (FSDP2's reshard_after_forward=False on one module). The unit
  // backward needs first (a GPT's last block) is the one to name, as torchtitan does: resharding it
  // only to gather it again as backward starts is an all-gather nothing can hide (measured in
  // docs/performance.md). Costs that unit's gathered parameters from its forward to its backward;
  // the memory plan counts them. Only with FULL_SHARD and HYBRID_SHARD, and not with hpZ for the
  // same unit; a name that is no unit is refused with the units' names.
  std::vector<std::string> keep_gathered_after_forward;
  AllGatherQuantization quantize_all_gather = AllGatherQuantization::NONE;
  // Elements per scale. 64: 300 steps of the default GPT end within 0.4 % of fp32 all-gathers
  // (256: 1.1 %) for 1/16 byte of scale per element (docs/performance.md, "Less on the wire").
  int quantization_block = 64;

  // Mixed precision; unset: everything in the parameters' own dtype.
  std::optional<MixedPrecision> mixed_precision;
  // Broadcast rank 0's parameters and buffers at construction, so ranks that built the model with
  // different seeds (or loaded different files) start equal.
  bool sync_module_states = false;
  // Where the shards live. Unset: the parameters' device, or the CPU for a model built with
  // deferred_init. Set to a device other than the parameters' (e.g. CUDA for a model built on the
  // CPU), each unit is flattened where it is and only its shard is moved, one unit at a time.
  std::optional<c10::Device> init_device;
  // The per-rank memory budget the plan is held against at construction.
  MemoryBudget memory_budget;
  // Tensor parallelism (fsdp/tensor_parallel.h): the TP group the model's split parameters
  // (fsdp::parallelize) belong to. Required when the model has any: the model must then be wrapped
  // over tensor_parallel->data_parallel(), and clip_grad_norm_ sums the split parameters' squares
  // over the TP group too. Checkpoints then save and load whole tensors by their original names.
  std::shared_ptr<TensorParallel> tensor_parallel;
};

}  // namespace fsdp
