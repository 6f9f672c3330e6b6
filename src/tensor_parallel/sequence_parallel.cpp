// Sequence parallelism (Megatron-SP, Korthikanti et al. 2022; fsdp/tensor_parallel.h): outside the
// split layers a transformer's activations (LayerNorm, dropout, the residual stream) are the same
// on every TP rank, so each rank keeps only its chunk of the sequence there. A column-parallel
// layer then all-gathers its input along the sequence (instead of copying it in) and reduce-scatters
// the input's gradient (instead of all-reducing it); a row-parallel layer reduce-scatters its
// partial products (instead of all-reducing them) and all-gathers their gradient. The same bytes
// cross the group as with the all-reduces (an all-reduce is a reduce-scatter and an all-gather),
// and the activations between the layers fall by the TP size.
#include "fsdp/tensor_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <stdexcept>

#include "tensor_parallel/group_ops.h"

namespace fsdp {
namespace {

using detail::all_gather_along;
using detail::by_key;
using detail::key_of;
using detail::reduce_scatter_along;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The sequence dimension exists (and, to split it, divides into the group's chunks).
void expect_sequence(const at::Tensor& x, const TensorParallel& tp, const char* what, bool split) {
  const int64_t dim = tp.sequence_dim();
  if (dim >= x.dim()) {
    throw std::invalid_argument(std::string("fsdp::") + what + ": the sequence dimension is " + std::to_string(dim) +
                                " (TensorParallelOptions::sequence_dim) and this tensor of shape " + c10::str(x.sizes()) +
                                " has " + std::to_string(x.dim()) + " dimensions: pass the activations with their "
                                "sequence dimension, or create the TensorParallel with the sequence_dim they use");
  }
  if (split && x.size(dim) % tp.size() != 0) {
    throw std::invalid_argument(std::string("fsdp::") + what + ": the sequence (dimension " + std::to_string(dim) +
                                " of shape " + c10::str(x.sizes()) + ") does not split into " + std::to_string(tp.size()) +
                                " equal chunks: under sequence parallelism the sequence length must be a multiple of "
                                "the TP size (pad the sequences to one)");
  }
}

// This rank's chunk of the sequence; backward gathers the chunks' gradients.
struct ScatterSequence : torch::autograd::Function<ScatterSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp_key) {
    const auto tp = by_key(tp_key);
    ctx->saved_data["tp"] = tp_key;
    const int64_t dim = tp->sequence_dim(), n = x.size(dim) / tp->size();
    return x.narrow(dim, tp->rank() * n, n).contiguous();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto tp = by_key(ctx->saved_data["tp"].toInt());
    return {all_gather_along(grads[0], tp->sequence_dim(), *tp, "a sequence chunk's gradient"), at::Tensor()};
  }
};

// The whole sequence from the chunks. Backward: the gradient's sum over the group, this rank's chunk
// of it, when the whole sequence feeds split computation (each rank's gradient is its features'
// part); this rank's chunk alone when it feeds computation every rank does alike.
struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp_key, bool partial_gradient) {
    const auto tp = by_key(tp_key);
    ctx->saved_data["tp"] = tp_key;
    ctx->saved_data["partial"] = partial_gradient;
    ctx->saved_data["n"] = x.size(tp->sequence_dim());
    return all_gather_along(x, tp->sequence_dim(), *tp, "the sequence chunks");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto tp = by_key(ctx->saved_data["tp"].toInt());
    const int64_t dim = tp->sequence_dim(), n = ctx->saved_data["n"].toInt();
    at::Tensor g = ctx->saved_data["partial"].toBool()
                       ? reduce_scatter_along(grads[0], dim, *tp, "the gradient of a gathered sequence")
                       : grads[0].narrow(dim, tp->rank() * n, n).contiguous();
    return {g, at::Tensor(), at::Tensor()};
  }
};

// The sum of the ranks' partial results, this rank's chunk of the sequence; backward gathers.
struct ReduceScatterSequence : torch::autograd::Function<ReduceScatterSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t tp_key) {
    const auto tp = by_key(tp_key);
    ctx->saved_data["tp"] = tp_key;
    return reduce_scatter_along(x, tp->sequence_dim(), *tp, "a row-parallel output");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto tp = by_key(ctx->saved_data["tp"].toInt());
    return {all_gather_along(grads[0], tp->sequence_dim(), *tp, "a reduce-scattered output's gradient"), at::Tensor()};
  }
};

}  // namespace

at::Tensor scatter_to_sequence_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp) {
  if (!tp) throw std::invalid_argument("fsdp::scatter_to_sequence_parallel_region: the TensorParallel is null");
  if (tp->size() == 1) return x;
  expect_sequence(x, *tp, "scatter_to_sequence_parallel_region", /*split=*/true);
  return ScatterSequence::apply(x, key_of(tp));
}

at::Tensor gather_from_sequence_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp,
                                                bool into_split_computation) {
  if (!tp) throw std::invalid_argument("fsdp::gather_from_sequence_parallel_region: the TensorParallel is null");
  if (tp->size() == 1) return x;
  expect_sequence(x, *tp, "gather_from_sequence_parallel_region", /*split=*/false);
  return GatherSequence::apply(x, key_of(tp), into_split_computation);
}

at::Tensor reduce_scatter_to_sequence_parallel_region(const at::Tensor& x, const std::shared_ptr<TensorParallel>& tp) {
  if (!tp) throw std::invalid_argument("fsdp::reduce_scatter_to_sequence_parallel_region: the TensorParallel is null");
  if (tp->size() == 1) return x;
  expect_sequence(x, *tp, "reduce_scatter_to_sequence_parallel_region", /*split=*/true);
  return ReduceScatterSequence::apply(x, key_of(tp));
}

std::shared_ptr<TensorParallel> sequence_parallel_of(const at::Tensor& weight) {
  auto p = tensor_parallel_placement(weight);
  return p && p->tp->size() > 1 && p->tp->sequence_parallel() ? p->tp : nullptr;
}

}  // namespace fsdp
