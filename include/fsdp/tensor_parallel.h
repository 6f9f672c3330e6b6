// Tensor parallelism with fsdp (paper §7.1; docs/design.md "Two dimensions"): Megatron-style
// column- and row-parallel linear layers inside a host, fsdp over the data-parallel ranks across
// hosts.
//
//   auto world = fsdp::Mesh::create(fsdp::LaunchEnv::from_environment());
//   auto tp = fsdp::TensorParallel::create(world, 2);        // TP 2 x DP W/2, TP inside a host
//   torch::manual_seed(0);
//   auto model = models::GPT(cfg);                           // built whole, as for local training
//   fsdp::parallelize(*model, tp, models::gpt_tensor_parallel_plan());  // keeps this rank's parts
//   fsdp::Options opts;  opts.tensor_parallel = tp;  ...
//   fsdp::FullyShardedDataParallel fsdp_model(model, tp->data_parallel(), opts);
//   fsdp::Checkpointer ckpt(tp->world(), "ckpt", {fsdp::StateDictKind::FULL});  // whole tensors
//
// A model takes part in three ways. (1) A plan, applied once after construction, names which
// parameters are split and along which dimension (column-parallel: a Linear's output features,
// dim 0; row-parallel: its input features, dim 1; a vocabulary-parallel embedding: its rows, dim
// 0); each named parameter keeps its TensorImpl and its name and from then on holds only this
// rank's part (set_data), so optimizers, fsdp and checkpoints see the same parameters as before.
// (2) The model's forward calls its split layers through column_parallel / row_parallel /
// vocab_parallel_embedding (plain calls when the parameter is not split: the same model trains
// with and without TP) and reads head counts from the local shapes. (3) The loss of split logits
// is vocab_parallel_cross_entropy. Parameters no rule names are replicated: every TP rank holds
// them whole and computes the same gradient for them. Every TP rank builds the model whole from
// the same seed before the plan, so each starts from local training's values. Checkpoints of a
// split model hold every tensor whole under its original name (FULL kind; docs/checkpoints.md).
// Sequence parallelism (TensorParallelOptions) keeps the activations between the split layers in
// chunks of the sequence; dropout draws from seed_tensor_parallel_rng's streams. Not supported with
// TP: deferred initialization.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "fsdp/mesh.h"

namespace fsdp {

struct TensorParallelOptions {
  // Megatron-LM's sequence parallelism (Korthikanti et al. 2022): between the split layers (the
  // LayerNorms, dropout and residual additions a transformer does on every TP rank alike) each rank
  // holds only its chunk of the sequence, 1 / size of those activations. column_parallel then
  // all-gathers its input along the sequence and row_parallel reduce-scatters its output (the bytes
  // of the all-reduces they replace); the model enters the sequence region once, after its
  // embedding (scatter_to_sequence_parallel_region), and the parameters applied to chunks (the
  // norms' weights, a row-parallel layer's bias) are partial_gradient_rule parameters: each rank's
  // gradient is its chunk's share. The sequence length must be a multiple of the TP size, and the
  // split layers' inputs have three dimensions at least ([batch, sequence, features]); a layer on
  // pooled features is written out (column_parallel refuses a 2-D input and says how). Not
  // detected: a pooled tensor that keeps a sequence dimension ([batch, 1, features], or any
  // tensor every TP rank computed alike) given to column_parallel would be gathered as if each
  // rank held a chunk: its layers' gradients TP times too large. Write such layers out too.
  bool sequence_parallel = false;
  // The activations' sequence dimension: 1 for [batch, sequence, features].
  int64_t sequence_dim = 1;
};

// The 2-D mesh: W = DP x TP ranks; a TP group is `size` consecutive ranks (inside one host when
// `size` divides the ranks per node, which create() requires of a multi-host job), a DP group
// the ranks with the same place in their TP group.
class TensorParallel {
 public:
  // Collective over `world`. Throws std::invalid_argument when `size` does not divide the world
  // size, or (with more than one host) the ranks per node: TP's activations cross the TP group
  // twice per layer and pass, which only a host's links carry at the speed it needs.
  static std::shared_ptr<TensorParallel> create(const std::shared_ptr<Mesh>& world, int size,
                                                const TensorParallelOptions& options = {});
  ~TensorParallel();

  int size() const;
  int rank() const;  // in the TP group
  bool sequence_parallel() const;
  int64_t sequence_dim() const;
  // The mesh of this rank's DP group (W / size ranks, W / size / hosts per node): what
  // FullyShardedDataParallel is given. The Checkpointer and the ShardedGradScaler take world(),
  // so that every rank of the job agrees (an overflow in one TP rank's parts skips every rank's step).
  const std::shared_ptr<Mesh>& data_parallel() const;
  const std::shared_ptr<Mesh>& world() const;
  // The TP group for tensors of `device` (Gloo for CPU, NCCL for CUDA), built on first use.
  const c10::intrusive_ptr<c10d::Backend>& group(c10::DeviceType device) const;

 private:
  TensorParallel() = default;
  struct State;
  std::unique_ptr<State> state_;
};

// How one parameter is split across the TP group: the whole tensor viewed as [parts, n / parts,
// ...] along `dim` (parts = 3 for a fused q/k/v projection, so each rank holds its heads of each of
// q, k and v), and each part cut into `size` equal slices; rank r holds slice r of every part.
struct TensorParallelShard {
  int64_t dim = 0;
  int64_t parts = 1;
  // A vocabulary the TP size does not divide (GPT-2's 50257 rows at TP 4): padded with zero rows
  // to the next multiple of the TP size, as Megatron-LM's make-vocab-size-divisible-by, the last
  // rank holding them (vocab_parallel_rule). Only along dimension 0 in one part. The padding is
  // invisible outside: the placement's full_shape, checkpoints, state dicts and export keep the
  // original shape; the embedding never looks the padding rows up and the cross entropy leaves
  // their logits out, so they stay zero.
  bool pad = false;
};

// One rule of a plan: parameters whose name matches `pattern` ('*' matches any run of characters
// but '.', "**" any run at all) are split as `shard`; or, with `partial_gradient`, not split but
// summed over the TP group in backward (partial_gradient_rule).
struct TensorParallelRule {
  std::string pattern;
  TensorParallelShard shard;
  bool partial_gradient = false;
};
// The usual rules, for a Linear named by its module path: weight and bias split by output
// features (column) or the weight by input features and the bias replicated (row).
std::vector<TensorParallelRule> column_parallel_rule(const std::string& module_pattern, int64_t parts = 1,
                                                     bool bias = true);
std::vector<TensorParallelRule> row_parallel_rule(const std::string& module_pattern);
// An embedding (and the head tied to it) split by rows over the vocabulary, padded when the TP size
// does not divide it (TensorParallelShard::pad).
TensorParallelRule vocab_parallel_rule(const std::string& param_pattern);
// A replicated parameter (every TP rank holds it whole) that each TP rank applies to its own part
// of split activations: a QK-norm's weight over this rank's heads, a scale per head indexed by the
// local heads, key/value projections replicated because there are fewer KV heads than TP ranks.
// Each rank's gradient is then its part's share; fsdp sums the shares over the TP group before the
// data-parallel reduction, so every rank steps the whole gradient. Without the rule the check
// after backward refuses such a parameter by name (its gradient differs across the TP group).
TensorParallelRule partial_gradient_rule(const std::string& param_pattern);

// Applies `plan` to `model` (built whole, every TP rank from the same seed): each parameter a rule
// names keeps its TensorImpl and now holds this rank's part. Throws std::invalid_argument naming
// the rule or parameter when a rule matches nothing, a split dimension is not divisible by
// parts x size, or the model is already split; call it before wrapping with fsdp. A tied weight
// is split once.
void parallelize(torch::nn::Module& model, const std::shared_ptr<TensorParallel>& tp,
                 const std::vector<TensorParallelRule>& plan);

// What parallelize made of `param` (by TensorImpl; it survives fsdp's sharding): the split, the
// whole tensor's shape and the group; nullopt for a parameter that is not split.
struct TensorParallelPlacement {
  TensorParallelShard shard;
  std::vector<int64_t> full_shape;
  std::shared_ptr<TensorParallel> tp;
  // The split dimension's size with its padding (shard.pad): full_shape[dim] rounded up to a
  // multiple of the TP size; full_shape[dim] without padding.
  int64_t split_size() const;
};
std::optional<TensorParallelPlacement> tensor_parallel_placement(const at::Tensor& param);
// The TP group a partial_gradient_rule named `param` for (by TensorImpl), null for any other.
std::shared_ptr<TensorParallel> tensor_parallel_partial_gradient(const at::Tensor& param);
// This rank's part of a whole tensor split as `shard` over `size` ranks (a contiguous copy).
at::Tensor tensor_parallel_part(const at::Tensor& whole, const TensorParallelShard& shard, int rank, int size);
// The whole tensor from every rank's part (collective over the TP group; a copy).
at::Tensor tensor_parallel_whole(const at::Tensor& part, const TensorParallelPlacement& placement);

// A layer of your own that uses split parameters directly (at::linear on a column-split weight
// between the region primitives below, an embedding of heads split along dimension 1): operators
// that reach a split parameter inside the scope are the layer's, and fsdp lets them pass. Outside
// any scope (and outside fsdp's own layers, which open one) such an operator is refused in forward:
// it would compute with this rank's part as if it were the whole (partial gradients for everything
// before it, silently). Per thread; nests.
class TensorParallelLayerScope {
 public:
  TensorParallelLayerScope();
  ~TensorParallelLayerScope();
  TensorParallelLayerScope(const TensorParallelLayerScope&) = delete;
  TensorParallelLayerScope& operator=(const TensorParallelLayerScope&) = delete;
};

// The regions of Megatron-LM (its f, g and the gathers), for layers of your own. Collective over
// `tp`'s group; each is the identity when `tp` has one rank.
// copy_to: identity forward; backward sums the gradient over the group (a replicated input enters
// split computation: each rank's gradient is a part of the whole one).
at::Tensor copy_to_tensor_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp);
// reduce_from: sums partial results over the group in forward; identity backward.
at::Tensor reduce_from_tensor_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp);
// gather_from: each rank's part of `dim` put side by side (rank order) in forward; backward keeps
// this rank's part of the gradient. For split logits: the whole vocabulary, to sample from.
at::Tensor gather_from_tensor_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp,
                                              int64_t dim = -1);
// scatter_to: this rank's part of `dim` (which the group size must divide) in forward; backward
// gathers the parts' gradients.
at::Tensor scatter_to_tensor_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp,
                                             int64_t dim = -1);
// The regions of sequence parallelism (TensorParallelOptions), along tp->sequence_dim(); each the
// identity when `tp` has one rank. Collective over `tp`'s group.
// scatter_to: this rank's chunk of the sequence (the length a multiple of the group size); backward
// gathers the chunks' gradients. Where a model enters the sequence region: after the embedding.
at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp);
// gather_from: the whole sequence from the chunks. Backward: with `into_split_computation` (what
// column_parallel uses: each rank's gradient is its features' part) the gradients summed over the
// group and this rank's chunk kept (a reduce-scatter); without it, this rank's chunk of its own
// gradient (the whole sequence feeds computation every rank does alike: a pooling, a replicated
// head). No default: the wrong one gives gradients TP times too large, silently.
at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp,
                                                bool into_split_computation);
// reduce_scatter_to: the sum of the ranks' partial results, this rank's chunk of the sequence (what
// row_parallel uses); backward gathers the gradient.
at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp);
// The TensorParallel of a split `weight` when it runs sequence-parallel over more than one rank;
// null otherwise (no split, one rank, or sequence parallelism off): what a model asks once to know
// whether to enter the sequence region.
std::shared_ptr<TensorParallel> sequence_parallel_of(const at::Tensor& weight);

// Dropout inside a TP model (Megatron-LM's RNG tracker). Activations every TP rank holds alike
// (the residual stream without sequence parallelism) need the same mask on each: the default
// generator, seeded alike on the TP ranks of a data-parallel group. Activations split across the
// group (a feed-forward's features, a head's scores, a sequence-parallel chunk) need an independent
// mask on each: this TP rank's own stream, which TensorParallelRngScope swaps into the default
// generator. seed_tensor_parallel_rng seeds both (the default generator with `seed`, this rank's
// stream from `seed` and its TP rank); pass the same seed on the TP ranks of a data-parallel group
// and different ones across it. Checkpoints save and restore both streams with each rank's state,
// so a resumed run draws the masks an uninterrupted one would. A replicated mask drawn from
// differing generators is caught by the replicated-gradient check after backward.
void seed_tensor_parallel_rng(const std::shared_ptr<TensorParallel>& tp, uint64_t seed);
// Inside: the default generators (CPU and, with CUDA, the current device's) draw from this TP
// rank's stream; outside, as before. A no-op for a null or one-rank `tp`; nests (the outer scope
// swaps). Throws std::logic_error, saying what to call, when seed_tensor_parallel_rng was not.
class TensorParallelRngScope {
 public:
  explicit TensorParallelRngScope(const std::shared_ptr<TensorParallel>& tp);
  ~TensorParallelRngScope();
  TensorParallelRngScope(const TensorParallelRngScope&) = delete;
  TensorParallelRngScope& operator=(const TensorParallelRngScope&) = delete;

 private:
  std::vector<at::Tensor> saved_;  // the default generators' states while the scope swaps them
  bool active_ = false, nested_ = false;
};

// The whole logits [..., V] from logits split by a vocabulary-split `weight` (column_parallel's
// output with the embedding or head weight): gathered over the TP group, without a padded
// vocabulary's padding classes. For sampling, accuracy, a z-loss. The logits themselves when
// `weight` is not split. Collective over the TP group.
at::Tensor gather_vocab_parallel_logits(const at::Tensor& logits, const at::Tensor& weight);

// The layers' forward. Each is a plain call when its weight is not split (or TP has one rank).
// Column-parallel: x is whole (replicated); the output holds this rank's output features. Backward
// all-reduces x's gradient over the TP group. Under sequence parallelism x is this rank's chunk of
// the sequence, all-gathered first (the gradient reduce-scattered back), and the output covers the
// whole sequence.
at::Tensor column_parallel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});
at::Tensor column_parallel(torch::nn::Linear& linear, const at::Tensor& x);
// Row-parallel: x holds this rank's input features (a column-parallel layer's output); the
// partial products are all-reduced over the TP group, then the (replicated) bias is added once.
// Under sequence parallelism they are reduce-scattered instead: the output is this rank's chunk of
// the sequence, and the bias, added to a chunk, has a partial gradient (partial_gradient_rule).
at::Tensor row_parallel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});
at::Tensor row_parallel(torch::nn::Linear& linear, const at::Tensor& x);
// A lookup in an embedding split by rows: each rank looks up the ids in its rows, the rest are
// zero, and the TP group's sum is the whole lookup. The plain lookup (at::embedding): no
// padding_idx, max_norm or scale_grad_by_freq; the Embedding overload honours them. The lookup
// is whole under sequence parallelism too (add position embeddings, then scatter_to_sequence_...).
at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight);
// The module's lookup with its options, split or not: padding_idx (that row's gradient stays 0),
// max_norm (the rows looked up renormalized in place, by the rank that holds them) and
// scale_grad_by_freq (counts over this data-parallel rank's ids, every TP rank alike, as DDP
// counts per replica); a plain module call when not split. Both lookups refuse, on every rank,
// ids outside [0, rows) and ids that differ across the TP ranks of a data-parallel group
// (a collective over the job per call).
at::Tensor vocab_parallel_embedding(torch::nn::Embedding& embedding, const at::Tensor& ids);
// Mean cross entropy of logits split along the last dimension (each rank's classes, e.g. the
// output of column_parallel with a vocabulary-split weight) against int64 targets, without
// gathering the logits: the max, the sum of exponentials and the target's logit are all-reduced.
// `weight`: the split weight the logits came from (names the group); plain when not split. Every
// target must be a class or, with `options.ignore_index`, that index (a row that counts nothing),
// and every TP rank of a data-parallel group must hold the same targets: both refused on every
// rank otherwise (a collective over the job per call). Anything else computed from split logits
// (a z-loss's logsumexp, an accuracy, torch's own cross entropy) sees this rank's classes only:
// gather them first (gather_from_tensor_parallel_region).
struct VocabParallelCrossEntropyOptions {
  // As torch::nn::functional::cross_entropy: the target that counts nothing (-100 by default there;
  // unset here, so that a stray target is refused rather than ignored), the smoothing of the
  // target distribution towards uniform over all classes, and the reduction: "mean" over the rows
  // that count, "sum", or "none" (one loss per row, 0 for ignored rows).
  std::optional<int64_t> ignore_index;
  double label_smoothing = 0.0;
  std::string reduction = "mean";
};
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& weight,
                                        const VocabParallelCrossEntropyOptions& options = {});

}  // namespace fsdp
