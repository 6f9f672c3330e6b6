// The cross entropy of logits split over the vocabulary (fsdp/tensor_parallel.h,
// vocab_parallel_cross_entropy): each rank holds its classes' logits, and the max, the sum of
// exponentials and the target's logit are all-reduced over the TP group instead of the logits
// being gathered, so no rank holds [tokens, V].
#include "fsdp/tensor_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <stdexcept>

#include "tensor_parallel/group_ops.h"
#include "tensor_parallel/replica_agreement.h"

namespace fsdp {
namespace {

using detail::active;
using detail::all_reduce_;
using detail::by_key;
using detail::key_of;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Cross entropy over classes split across the TP group: each rank holds logits [N, V / tp] of the
// classes [begin, begin + V / tp). Computed in fp32 whatever the logits' dtype. As PyTorch's: a row
// whose target is the ignored index counts nothing; with label smoothing e a row's loss is
// (1 - e) (lse - x_t) + e (lse - mean over all V classes of x_c), lse the log-sum-exp; "mean"
// divides by the rows that count.
enum class CeReduction : int64_t { MEAN, SUM, NONE };

struct SplitCrossEntropy : torch::autograd::Function<SplitCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets, int64_t begin,
                            int64_t tp_key, std::optional<int64_t> ignore, double smoothing, int64_t reduction,
                            int64_t classes) {
    // logits: this rank's classes [begin, begin + local) of `classes` (without the padding rows of
    // a padded vocabulary, which vocab_parallel_cross_entropy leaves out).
    const auto tp = by_key(tp_key);
    const int64_t local = logits.size(-1);
    // Two [N, V / tp] fp32 arrays at most (the logits' fp32 copy and the exponentials, which become
    // the softmax in place): what the memory plan counts (models::GPTConfig::head_activation_bytes).
    at::Tensor x = logits.reshape({-1, local}).to(at::kFloat);
    const at::Tensor t = targets.reshape({-1});
    at::Tensor max = std::get<0>(x.max(-1));
    all_reduce_(max, c10d::ReduceOp::MAX, *tp, "the logits' maximum");
    const at::Tensor counts = ignore ? t.ne(*ignore) : at::ones_like(t, t.options().dtype(at::kBool));
    const at::Tensor here = (t >= begin).logical_and(t < begin + local).logical_and(counts);
    const at::Tensor index = (t - begin).masked_fill(here.logical_not(), 0);
    const at::Tensor picked = x.gather(1, index.unsqueeze(1)).squeeze(1).sub(max).masked_fill(here.logical_not(), 0.0);
    std::vector<at::Tensor> parts = {at::Tensor(), picked};
    if (smoothing > 0) parts.push_back((x - max.unsqueeze(1)).sum(-1));
    at::Tensor e = (x - max.unsqueeze(1)).exp_();
    x = at::Tensor();
    parts[0] = e.sum(-1);
    at::Tensor sums = at::stack(parts);  // one all-reduce for all
    all_reduce_(sums, c10d::ReduceOp::SUM, *tp, "the softmax's denominators");
    const at::Tensor lse = sums[0].log();
    at::Tensor rows = lse - sums[1];
    if (smoothing > 0) rows = rows.mul(1.0 - smoothing).add_((lse - sums[2] / static_cast<double>(classes)).mul_(smoothing));
    if (ignore) rows = rows.masked_fill(counts.logical_not(), 0.0);
    const auto red = static_cast<CeReduction>(reduction);
    at::Tensor loss;
    double divisor = 1.0;  // of each row's gradient, for MEAN and SUM
    if (red == CeReduction::NONE) {
      loss = rows.view(targets.sizes());
    } else if (red == CeReduction::SUM) {
      loss = rows.sum();
    } else if (!ignore) {
      loss = rows.mean();
      divisor = static_cast<double>(rows.size(0));
    } else {
      const double n = counts.sum().item<double>();  // 0 rows counting: NaN, as PyTorch's
      loss = rows.sum().div(n);
      divisor = n;
    }
    ctx->save_for_backward({e.div_(sums[0].unsqueeze(1)), index, here, counts});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    ctx->saved_data["shape"] = logits.sizes().vec();
    ctx->saved_data["smoothing"] = smoothing / static_cast<double>(classes);
    ctx->saved_data["keep"] = 1.0 - smoothing;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["divisor"] = divisor;
    return loss.to(logits.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor g = saved[0].clone();  // softmax of this rank's classes
    const at::Tensor rows = at::arange(g.size(0), saved[1].options());
    const double keep = ctx->saved_data["keep"].toDouble(), smoothing = ctx->saved_data["smoothing"].toDouble();
    g.index_put_({rows, saved[1]}, g.index({rows, saved[1]}) - saved[2].to(g.scalar_type()) * keep);
    if (smoothing > 0) g.sub_(smoothing);
    const auto red = static_cast<CeReduction>(ctx->saved_data["reduction"].toInt());
    at::Tensor per_row = red == CeReduction::NONE ? grads[0].reshape({-1, 1}).to(at::kFloat)
                                                  : grads[0].to(at::kFloat) / ctx->saved_data["divisor"].toDouble();
    g.mul_(per_row);
    g.mul_(saved[3].unsqueeze(1));  // ignored rows: no gradient
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {g.to(dtype).view(ctx->saved_data["shape"].toIntVector()), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& weight,
                                        const VocabParallelCrossEntropyOptions& options) {
  CeReduction reduction;
  if (options.reduction == "mean") {
    reduction = CeReduction::MEAN;
  } else if (options.reduction == "sum") {
    reduction = CeReduction::SUM;
  } else if (options.reduction == "none") {
    reduction = CeReduction::NONE;
  } else {
    throw std::invalid_argument("fsdp::vocab_parallel_cross_entropy: reduction '" + options.reduction +
                                "' is not one of mean, sum, none");
  }
  if (!(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0)) {
    throw std::invalid_argument("fsdp::vocab_parallel_cross_entropy: label_smoothing must be in [0, 1], got " +
                                std::to_string(options.label_smoothing));
  }
  if (!at::isIntegralType(targets.scalar_type(), /*includeBool=*/false)) {
    throw std::invalid_argument(std::string("fsdp::vocab_parallel_cross_entropy: the targets are class indices, an "
                                            "integer tensor (int64), not ") + c10::toString(targets.scalar_type()));
  }
  if (logits.dim() == 0 || logits.numel() / std::max<int64_t>(1, logits.size(-1)) != targets.numel()) {
    throw std::invalid_argument("fsdp::vocab_parallel_cross_entropy: logits of shape " + c10::str(logits.sizes()) +
                                " hold " + std::to_string(logits.dim() ? logits.numel() / std::max<int64_t>(1, logits.size(-1)) : 0) +
                                " rows of classes and the targets (shape " + c10::str(targets.sizes()) + ") " +
                                std::to_string(targets.numel()) + ": one target per row of logits");
  }
  const auto p = active(weight);
  if (!p) {
    const at::Tensor out = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), {},
                                                  static_cast<int64_t>(reduction == CeReduction::MEAN  ? at::Reduction::Mean
                                                                       : reduction == CeReduction::SUM ? at::Reduction::Sum
                                                                                                      : at::Reduction::None),
                                                  options.ignore_index.value_or(-100), options.label_smoothing);
    return reduction == CeReduction::NONE ? out.view(targets.sizes()) : out;
  }
  TORCH_CHECK(p->shard.parts == 1 && p->shard.dim == 0, "fsdp: vocab_parallel_cross_entropy needs a weight split by rows");
  const int64_t classes = p->full_shape[0], per_rank = p->split_size() / p->tp->size();
  TORCH_CHECK(logits.size(-1) == per_rank, "fsdp::vocab_parallel_cross_entropy: the logits hold ", logits.size(-1),
              " classes on each of the ", p->tp->size(), " TP ranks, and the weight given was split from ", classes,
              " rows (", per_rank, " a rank): pass the weight the logits came from (column_parallel's, split by rows)");
  // A target outside the classes would be "on no rank" and count as a logit of 0, silently; one that
  // differs across the TP ranks (per-rank label noise) mixes two batches' losses: both refused on
  // every rank (the targets gathered over the job), unless it is the ignored index.
  detail::check_ids_across_tensor_parallel(*p->tp, targets, classes, options.ignore_index,
                                           "the targets of fsdp::vocab_parallel_cross_entropy");
  // A padded vocabulary's padding classes (the last rank's last columns) are no classes: left out
  // (their gradient is zero, so the padding rows stay zero).
  const int64_t begin = p->tp->rank() * per_rank, valid = std::min(per_rank, classes - begin);
  const at::Tensor mine = valid == per_rank ? logits : logits.narrow(-1, 0, valid);
  return SplitCrossEntropy::apply(mine, targets, begin, key_of(p->tp), options.ignore_index, options.label_smoothing,
                                  static_cast<int64_t>(reduction), classes);
}

}  // namespace fsdp
