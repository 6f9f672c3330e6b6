// The forward of tensor-parallel layers (Megatron-LM's f and g): a column-parallel layer copies its
// whole input into the TP region (identity forward, all-reduce of the input's gradient backward), a
// row-parallel layer reduces its partial products out of it (all-reduce forward, identity
// backward). With a vocabulary split the same way, the embedding's lookup and the cross entropy
// never hold the whole vocabulary. Every collective here is over the TP group, on the thread that
// runs the layer (forward) or autograd's (backward), and waited for at once: the next operator needs
// its result.
#include "fsdp/tensor_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <stdexcept>

#include "tensor_parallel/group_ops.h"
#include "tensor_parallel/layer_scope.h"
#include "tensor_parallel/replica_agreement.h"

namespace fsdp {
namespace {

const char* const kEmbeddingIds = "the ids of fsdp::vocab_parallel_embedding";

// How many TensorParallelLayerScopes this thread is in (fsdp's layers open one around the
// operators that read a split weight).
thread_local int t_layer_depth = 0;

using detail::all_gather_along;
using detail::all_reduce_;
using detail::by_key;
using detail::key_of;
using detail::wrap_dim;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using detail::active;

// f: identity forward, all-reduce of the gradient backward.
struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp_key) {
    ctx->saved_data["tp"] = tp_key;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

// g: all-reduce forward, identity backward.
struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, int64_t tp_key);
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

variable_list CopyToRegion::backward(AutogradContext* ctx, variable_list grads) {
  at::Tensor g = grads[0].contiguous().clone();
  all_reduce_(g, c10d::ReduceOp::SUM, *by_key(ctx->saved_data["tp"].toInt()), "a column-parallel input's gradient");
  return {g, at::Tensor()};
}

at::Tensor ReduceFromRegion::forward(AutogradContext*, const at::Tensor& x, int64_t tp_key) {
  at::Tensor y = x.contiguous().clone();
  all_reduce_(y, c10d::ReduceOp::SUM, *by_key(tp_key), "a row-parallel output");
  return y;
}

void expect_dim(const TensorParallelPlacement& p, int64_t dim, const char* layer) {
  if (p.shard.dim != dim) {
    throw std::invalid_argument(std::string("fsdp: ") + layer + " needs its weight split along dimension " +
                                std::to_string(dim) + ", but the plan split it along dimension " +
                                std::to_string(p.shard.dim) + " (column-parallel: dim 0, row-parallel: dim 1)");
  }
}

// Under sequence parallelism a layer's activations are [batch, sequence, features] (or [sequence,
// batch, features] with sequence_dim 0): at least three dimensions, the sequence's inside. A pooled
// [batch, features] tensor has none to gather or scatter; treated as one, its batch would be taken
// for the sequence (the gradients TP times too large) or fail later with a size error that names
// nothing.
void expect_sequence(const at::Tensor& x, const TensorParallel& tp, const char* layer) {
  if (x.dim() >= std::max<int64_t>(3, tp.sequence_dim() + 2)) return;
  throw std::invalid_argument(std::string("fsdp: under sequence parallelism ") + layer + "'s input is this rank's "
                              "chunk of the sequence (its dimension " + std::to_string(tp.sequence_dim()) + ", the "
                              "TensorParallelOptions::sequence_dim: [batch, sequence, features] with 1, [sequence, "
                              "batch, features] with 0; three dimensions at least), and this input has " + std::to_string(x.dim()) + ": for features without a sequence "
                              "(pooled), write the layer out inside a fsdp::TensorParallelLayerScope: at::linear("
                              "fsdp::copy_to_tensor_parallel_region(x, tp), weight) for a column-parallel one, "
                              "fsdp::reduce_from_tensor_parallel_region(at::linear(x, weight), tp) for a row-parallel one");
}

at::Tensor column_split(const TensorParallelPlacement& p, const at::Tensor& x, const at::Tensor& weight,
                        const at::Tensor& bias) {
  expect_dim(p, 0, "column_parallel");
  // Each rank computes its output features, so the bias is split with the weight. (Its placement,
  // not its size: before the unit is gathered the bias may still be fsdp's 1-D shard.)
  if (bias.defined() && !tensor_parallel_placement(bias)) {
    throw std::invalid_argument("fsdp: column_parallel's weight is split by output features and its bias is not: split "
                                "the bias with it (fsdp::column_parallel_rule(pattern, parts, /*bias=*/true), or a rule "
                                "{\"<layer>.bias\", {0, parts}})");
  }
  if (p.tp->sequence_parallel()) expect_sequence(x, *p.tp, "column_parallel");
  TensorParallelLayerScope layer;
  const at::Tensor in = p.tp->sequence_parallel() ? gather_from_sequence_parallel_region(x, p.tp, /*into_split_computation=*/true)
                                                  : CopyToRegion::apply(x, key_of(p.tp));
  return at::linear(in, weight, bias);
}

at::Tensor row_split(const TensorParallelPlacement& p, const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& bias) {
  expect_dim(p, 1, "row_parallel");
  if (bias.defined() && tensor_parallel_placement(bias)) {
    throw std::invalid_argument("fsdp: row_parallel's bias must be replicated (added once, after the reduction); the plan split it");
  }
  if (p.tp->sequence_parallel()) expect_sequence(x, *p.tp, "row_parallel");
  TensorParallelLayerScope layer;
  const at::Tensor partial = at::linear(x, weight);
  const at::Tensor y = p.tp->sequence_parallel() ? reduce_scatter_to_sequence_parallel_region(partial, p.tp)
                                                 : ReduceFromRegion::apply(partial, key_of(p.tp));
  return bias.defined() ? y + bias : y;
}

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, int64_t tp_key) {
    const auto tp = by_key(tp_key);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["rank"] = static_cast<int64_t>(tp->rank());
    ctx->saved_data["n"] = x.size(dim);
    return all_gather_along(x, dim, *tp, "a tensor gathered from the TP region");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt(), n = ctx->saved_data["n"].toInt();
    return {grads[0].narrow(dim, ctx->saved_data["rank"].toInt() * n, n).contiguous(), at::Tensor(), at::Tensor()};
  }
};

struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, int64_t tp_key) {
    const auto tp = by_key(tp_key);
    TORCH_CHECK(x.size(dim) % tp->size() == 0, "fsdp::scatter_to_tensor_parallel_region: dimension ", dim, " (",
                x.size(dim), ") does not split into ", tp->size(), " equal parts");
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["tp"] = tp_key;
    const int64_t n = x.size(dim) / tp->size();
    return x.narrow(dim, tp->rank() * n, n).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto tp = by_key(ctx->saved_data["tp"].toInt());
    return {all_gather_along(grads[0], ctx->saved_data["dim"].toInt(), *tp, "the gradient of a scattered tensor"),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

namespace detail {
bool in_tensor_parallel_layer() { return t_layer_depth > 0; }
}  // namespace detail

TensorParallelLayerScope::TensorParallelLayerScope() { ++t_layer_depth; }
TensorParallelLayerScope::~TensorParallelLayerScope() { --t_layer_depth; }

at::Tensor copy_to_tensor_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp) {
  TORCH_CHECK(tp, "fsdp::copy_to_tensor_parallel_region: the TensorParallel is null");
  return tp->size() == 1 ? x : CopyToRegion::apply(x, key_of(tp));
}

at::Tensor reduce_from_tensor_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp) {
  TORCH_CHECK(tp, "fsdp::reduce_from_tensor_parallel_region: the TensorParallel is null");
  return tp->size() == 1 ? x : ReduceFromRegion::apply(x, key_of(tp));
}

at::Tensor gather_from_tensor_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp, int64_t dim) {
  TORCH_CHECK(tp, "fsdp::gather_from_tensor_parallel_region: the TensorParallel is null");
  return tp->size() == 1 ? x : GatherFromRegion::apply(x, wrap_dim(dim, x), key_of(tp));
}

at::Tensor scatter_to_tensor_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp, int64_t dim) {
  TORCH_CHECK(tp, "fsdp::scatter_to_tensor_parallel_region: the TensorParallel is null");
  return tp->size() == 1 ? x : ScatterToRegion::apply(x, wrap_dim(dim, x), key_of(tp));
}

at::Tensor column_parallel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const auto p = active(weight);
  return p ? column_split(*p, x, weight, bias) : at::linear(x, weight, bias);
}

// Not split: the module's own forward, whose arithmetic (libtorch's F::linear: matmul, then the
// bias added in place, for inputs of more than two dimensions) differs in its last bits from
// at::linear's fused one; a model without a plan computes exactly what it computed before.
at::Tensor column_parallel(torch::nn::Linear& linear, const at::Tensor& x) {
  const auto p = active(linear->weight);
  return p ? column_split(*p, x, linear->weight, linear->bias) : linear->forward(x);
}

at::Tensor row_parallel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const auto p = active(weight);
  return p ? row_split(*p, x, weight, bias) : at::linear(x, weight, bias);
}

at::Tensor row_parallel(torch::nn::Linear& linear, const at::Tensor& x) {
  const auto p = active(linear->weight);
  return p ? row_split(*p, x, linear->weight, linear->bias) : linear->forward(x);
}

// This rank's rows of a table split by rows: [begin, begin + rows). From the placement, never from
// the weight itself: fsdp gathers a unit at the first operator that reads it, so before the lookup
// the weight may still be this rank's 1-D shard (of another length).
std::pair<int64_t, int64_t> rows_of(const TensorParallelPlacement& p) {
  const int64_t rows = p.split_size() / p.tp->size();  // with a padded vocabulary's padding
  return {p.tp->rank() * rows, rows};
}

at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight) {
  const auto p = active(weight);
  if (!p) return at::embedding(weight, ids);
  expect_dim(*p, 0, "vocab_parallel_embedding");
  detail::check_ids_across_tensor_parallel(*p->tp, ids, p->full_shape[0], std::nullopt, kEmbeddingIds);
  const auto [begin, rows] = rows_of(*p);
  const at::Tensor outside = (ids < begin).logical_or(ids >= begin + rows);
  const at::Tensor local = (ids - begin).masked_fill(outside, 0);
  TensorParallelLayerScope layer;
  const at::Tensor out = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  return ReduceFromRegion::apply(out, key_of(p->tp));
}

at::Tensor vocab_parallel_embedding(torch::nn::Embedding& embedding, const at::Tensor& ids) {
  const at::Tensor& weight = embedding->weight;
  const auto p = active(weight);
  if (!p) return embedding->forward(ids);
  expect_dim(*p, 0, "vocab_parallel_embedding");
  detail::check_ids_across_tensor_parallel(*p->tp, ids, p->full_shape[0], std::nullopt, kEmbeddingIds);
  const auto& o = embedding->options;
  const auto [begin, rows] = rows_of(*p);
  const at::Tensor here = (ids >= begin).logical_and(ids < begin + rows);
  const at::Tensor local = (ids - begin).masked_fill(here.logical_not(), 0);
  // The padding row, if this rank holds it (at::embedding: -1 for none).
  int64_t padding = -1;
  if (o.padding_idx() && *o.padding_idx() >= begin && *o.padding_idx() < begin + rows) padding = *o.padding_idx() - begin;
  TensorParallelLayerScope layer;
  if (o.max_norm()) {
    // The rows this rank holds that the batch looks up, renormalized in the weight (an in-place
    // write in forward, which fsdp merges across the data-parallel ranks), as the module does.
    at::NoGradGuard no_grad;
    at::Tensor table = weight;
    at::embedding_renorm_(table, local.masked_select(here), *o.max_norm(), o.norm_type());
  }
  at::Tensor out;
  if (!o.scale_grad_by_freq()) {
    out = at::embedding(weight, local, padding, false, o.sparse()).masked_fill(here.logical_not().unsqueeze(-1), 0.0);
  } else {
    // Frequencies over this rank's ids only (every id is on one rank, so its count is the whole
    // batch's): the ids of other ranks' rows must not count as row 0.
    const at::Tensor flat = local.reshape({-1});
    const at::Tensor mine = here.reshape({-1}).nonzero().squeeze(1);
    const at::Tensor looked = at::embedding(weight, flat.index_select(0, mine), padding, true, o.sparse());
    std::vector<int64_t> shape = ids.sizes().vec();
    shape.push_back(weight.size(1));
    out = at::zeros({flat.numel(), weight.size(1)}, looked.options()).index_copy(0, mine, looked).view(shape);
  }
  return ReduceFromRegion::apply(out, key_of(p->tp));
}

at::Tensor gather_vocab_parallel_logits(const at::Tensor& logits, const at::Tensor& weight) {
  const auto p = active(weight);
  if (!p) return logits;
  const at::Tensor whole = gather_from_tensor_parallel_region(logits, p->tp, -1);
  return whole.size(-1) == p->full_shape[0] ? whole : whole.narrow(-1, 0, p->full_shape[0]);
}

}  // namespace fsdp
