#include "optim/optimizer_lists.h"

#include <stdexcept>
#include <unordered_set>

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace fsdp::optim {

namespace {
std::string where(size_t group, size_t index) {
  return "parameter " + std::to_string(index) + " of parameter group " + std::to_string(group);
}
}  // namespace

at::Tensor checked_grad(const char* optimizer, const at::Tensor& param, size_t group, size_t index) {
  const at::Tensor& grad = param.grad();
  if (grad.is_sparse()) {
    throw std::invalid_argument(std::string("fsdp: ") + optimizer + " does not support sparse gradients (" +
                                where(group, index) + "); use torch::optim's optimizers for them");
  }
  const auto dtype = param.scalar_type();
  if (dtype != at::kFloat && dtype != at::kDouble) {
    throw std::invalid_argument(std::string("fsdp: ") + optimizer + " steps float32 and float64 parameters; " +
                                where(group, index) + " is " + std::string(c10::toString(dtype)) +
                                " (with fsdp's mixed precision the parameters stay float32: pass a param_dtype in "
                                "Options::mixed_precision rather than converting the model), or use torch::optim's optimizers");
  }
  if (!param.device().is_cpu() && !param.device().is_cuda()) {
    throw std::invalid_argument(std::string("fsdp: ") + optimizer + " runs on CPU and CUDA; " + where(group, index) +
                                " is on " + param.device().str());
  }
  if (!param.is_contiguous()) {
    throw std::invalid_argument(std::string("fsdp: ") + optimizer + " steps contiguous parameters; " +
                                where(group, index) + " is not (use torch::optim's optimizers for it)");
  }
  // Its shape is checked by the kernel, after fsdp's guard: a gradient of another shape is what a
  // no_sync backward leaves (this rank's unreduced sum of the whole parameter), and the guard says so.
  // A gradient in a lower precision (MixedPrecision::keep_low_precision_grads) steps as libtorch's
  // optimizers step it: promoted to the parameter's dtype, which holds every value exactly.
  // (A float32 gradient on a float64 parameter is refused, as libtorch refuses it.)
  if (grad.scalar_type() == at::kBFloat16 || grad.scalar_type() == at::kHalf) {
    return grad.to(dtype).contiguous();
  }
  return grad.contiguous();
}

void check_unique(const char* optimizer, const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::unordered_set<const c10::TensorImpl*> seen;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      if (!seen.insert(groups[g].params()[i].unsafeGetTensorImpl()).second) {
        throw std::invalid_argument(std::string("fsdp: ") + optimizer + ": " + where(g, i) +
                                    " is listed twice (a tied weight under each of its names?): it would be stepped "
                                    "twice per step. Build the optimizer from FullyShardedDataParallel::parameters(), "
                                    "which lists each parameter once.");
      }
    }
  }
}

namespace {
void require(bool ok, const std::string& what, size_t group) {
  if (!ok) throw std::invalid_argument("fsdp: " + what + " (parameter group " + std::to_string(group) + ")");
}
}  // namespace

void check_adamw_options(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(groups[g].options());
    const auto [b1, b2] = o.betas();
    require(o.lr() >= 0, "FusedAdamW: invalid learning rate " + std::to_string(o.lr()), g);
    require(o.eps() >= 0, "FusedAdamW: invalid epsilon " + std::to_string(o.eps()), g);
    require(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1,
            "FusedAdamW: betas must lie in [0, 1), got (" + std::to_string(b1) + ", " + std::to_string(b2) + ")", g);
    require(o.weight_decay() >= 0, "FusedAdamW: invalid weight decay " + std::to_string(o.weight_decay()), g);
  }
}

void check_sgd_options(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(groups[g].options());
    require(o.lr() >= 0, "FusedSGD: invalid learning rate " + std::to_string(o.lr()), g);
    require(o.momentum() >= 0, "FusedSGD: invalid momentum " + std::to_string(o.momentum()), g);
    require(o.weight_decay() >= 0, "FusedSGD: invalid weight decay " + std::to_string(o.weight_decay()), g);
    require(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0),
            "FusedSGD: Nesterov momentum needs a momentum above 0 and zero dampening", g);
  }
}

at::Tensor begin_step(const char* optimizer, const std::vector<torch::optim::OptimizerParamGroup>& groups,
                      const torch::optim::Optimizer::LossClosure& closure) {
  at::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  check_unique(optimizer, groups);
  // A forward whose output was dropped leaves its units' parameters whole until an operator
  // reaches one of them, when fsdp's guard ends that forward and puts the shards back: reach each
  // before its shape is read (the state below is kept in the shard's shape).
  for (const auto& group : groups) {
    for (const at::Tensor& p : group.params()) {
      if (p.grad().defined()) (void)p.detach();
    }
  }
  return loss;
}

at::Tensor& kernel_ready(at::Tensor& state, const at::Tensor& param) {
  // A state of another size stays as it is, for the kernel to refuse by name (a parameter held
  // whole where its state is the shard's).
  if (state.numel() != param.numel()) return state;
  if (!state.is_contiguous() || state.sizes() != param.sizes() || state.scalar_type() != param.scalar_type() ||
      state.device() != param.device()) {
    state = state.to(param.options()).reshape(param.sizes()).contiguous();
  }
  return state;
}

}  // namespace fsdp::optim
