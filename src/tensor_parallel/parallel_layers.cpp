// The forward of tensor-parallel layers (Megatron-LM's f and g): a column-parallel layer copies its
// whole input into the TP region (identity forward, all-reduce of the input's gradient backward), a
// row-parallel layer reduces its partial products out of it (all-reduce forward, identity
// backward). With a vocabulary split the same way, the embedding's lookup and the cross entropy
// never hold the whole vocabulary. Every collective here is over the TP group, on the thread that
// runs the layer (forward) or autograd's (backward), and waited for at once: the next operator needs
// its result.
#include "fsdp/tensor_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <stdexcept>

namespace fsdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The weight's placement when it is split over more than one rank (one registry lookup per call).
std::optional<TensorParallelPlacement> active(const at::Tensor& weight) {
  auto placement = tensor_parallel_placement(weight);
  if (!placement || placement->tp->size() == 1) return std::nullopt;
  return placement;
}

// In place on a fresh tensor; throws what failed and where.
void all_reduce_(at::Tensor& t, c10d::ReduceOp op, const TensorParallel& tp, const char* what) {
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  try {
    auto work = tp.group(t.device().type())->allreduce(v, o);
    if (!work->wait()) throw std::runtime_error("the work did not complete");
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("fsdp: the tensor-parallel all-reduce of ") + what + " failed on TP rank " +
                             std::to_string(tp.rank()) + " of " + std::to_string(tp.size()) + ": " +
                             std::string(e.what()).substr(0, std::string(e.what()).find('\n')));
  }
}

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

// The autograd Functions carry the group as a key into this table (IValues cannot hold a
// shared_ptr of a plain class): the TensorParallel lives as long as any placement names it.
std::mutex keys_mutex;
std::vector<std::weak_ptr<TensorParallel>>& keys() {
  static std::vector<std::weak_ptr<TensorParallel>> k;
  return k;
}
int64_t key_of(const std::shared_ptr<TensorParallel>& tp) {
  std::lock_guard<std::mutex> lock(keys_mutex);
  auto& k = keys();
  for (size_t i = 0; i < k.size(); ++i)
    if (k[i].lock() == tp) return static_cast<int64_t>(i);
  k.push_back(tp);
  return static_cast<int64_t>(k.size() - 1);
}
std::shared_ptr<TensorParallel> by_key(int64_t key) {
  std::lock_guard<std::mutex> lock(keys_mutex);
  auto tp = keys().at(static_cast<size_t>(key)).lock();
  TORCH_CHECK(tp, "fsdp: a tensor-parallel layer's group ended before its backward");
  return tp;
}

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

// Cross entropy over classes split across the TP group: each rank holds logits [N, V / tp] of the
// classes [begin, begin + V / tp). Computed in fp32 whatever the logits' dtype.
struct SplitCrossEntropy : torch::autograd::Function<SplitCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets, int64_t begin,
                            int64_t tp_key) {
    const auto tp = by_key(tp_key);
    const int64_t local = logits.size(-1);
    // Two [N, V / tp] fp32 arrays at most (the logits' fp32 copy and the exponentials, which become
    // the softmax in place): what the memory plan counts (models::GPTConfig::head_activation_bytes).
    at::Tensor x = logits.reshape({-1, local}).to(at::kFloat);
    const at::Tensor t = targets.reshape({-1});
    at::Tensor max = std::get<0>(x.max(-1));
    all_reduce_(max, c10d::ReduceOp::MAX, *tp, "the logits' maximum");
    const at::Tensor here = (t >= begin).logical_and(t < begin + local);
    const at::Tensor index = (t - begin).masked_fill(here.logical_not(), 0);
    const at::Tensor picked = x.gather(1, index.unsqueeze(1)).squeeze(1).sub(max).masked_fill(here.logical_not(), 0.0);
    at::Tensor e = (x - max.unsqueeze(1)).exp_();
    x = at::Tensor();
    at::Tensor sums = at::stack({e.sum(-1), picked});  // one all-reduce for both
    all_reduce_(sums, c10d::ReduceOp::SUM, *tp, "the softmax's denominators");
    const at::Tensor loss = (sums[0].log() - sums[1]).mean();
    ctx->save_for_backward({e.div_(sums[0].unsqueeze(1)), index, here});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    ctx->saved_data["shape"] = logits.sizes().vec();
    return loss.to(logits.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor g = saved[0].clone();  // softmax of this rank's classes
    const at::Tensor rows = at::arange(g.size(0), saved[1].options());
    g.index_put_({rows, saved[1]}, g.index({rows, saved[1]}) - saved[2].to(g.scalar_type()));
    g.mul_(grads[0].to(at::kFloat) / static_cast<double>(g.size(0)));
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {g.to(dtype).view(ctx->saved_data["shape"].toIntVector()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void expect_dim(const TensorParallelPlacement& p, int64_t dim, const char* layer) {
  if (p.shard.dim != dim) {
    throw std::invalid_argument(std::string("fsdp: ") + layer + " needs its weight split along dimension " +
                                std::to_string(dim) + ", but the plan split it along dimension " +
                                std::to_string(p.shard.dim) + " (column-parallel: dim 0, row-parallel: dim 1)");
  }
}

at::Tensor column_split(const TensorParallelPlacement& p, const at::Tensor& x, const at::Tensor& weight,
                        const at::Tensor& bias) {
  expect_dim(p, 0, "column_parallel");
  return at::linear(CopyToRegion::apply(x, key_of(p.tp)), weight, bias);
}

at::Tensor row_split(const TensorParallelPlacement& p, const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& bias) {
  expect_dim(p, 1, "row_parallel");
  if (bias.defined() && tensor_parallel_placement(bias)) {
    throw std::invalid_argument("fsdp: row_parallel's bias must be replicated (added once, after the reduction); the plan split it");
  }
  const at::Tensor y = ReduceFromRegion::apply(at::linear(x, weight), key_of(p.tp));
  return bias.defined() ? y + bias : y;
}

}  // namespace

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

at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight) {
  const auto p = active(weight);
  if (!p) return at::embedding(weight, ids);
  expect_dim(*p, 0, "vocab_parallel_embedding");
  const int64_t rows = weight.size(0), begin = p->tp->rank() * rows;
  const at::Tensor outside = (ids < begin).logical_or(ids >= begin + rows);
  const at::Tensor local = (ids - begin).masked_fill(outside, 0);
  const at::Tensor out = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  return ReduceFromRegion::apply(out, key_of(p->tp));
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& weight) {
  const auto p = active(weight);
  if (!p) return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  TORCH_CHECK(p->shard.parts == 1 && p->shard.dim == 0, "fsdp: vocab_parallel_cross_entropy needs a weight split by rows");
  // A target outside the classes would be "on no rank" and count as a logit of 0, silently: refused
  // (cross_entropy's ignore_index, -100, is not supported here). One check, one device sync.
  const int64_t classes = logits.size(-1) * p->tp->size();
  TORCH_CHECK(!targets.lt(0).logical_or(targets.ge(classes)).any().item<bool>(),
              "fsdp::vocab_parallel_cross_entropy: every target must be a class in [0, ", classes,
              "); ignore_index is not supported");
  return SplitCrossEntropy::apply(logits, targets, p->tp->rank() * logits.size(-1), key_of(p->tp));
}

}  // namespace fsdp
