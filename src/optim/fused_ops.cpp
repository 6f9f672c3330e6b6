#include "optim/fused_ops.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "optim/cpu_kernels.h"

namespace fsdp::optim {
namespace {

// Work for the intra-op threads in ranges of at most this many elements, so that one large
// parameter spreads over every thread and small ones share one.
constexpr int64_t kChunk = 1 << 15;

struct Range {
  size_t tensor;
  int64_t begin, end;
};

std::vector<Range> chunks(const at::TensorList params) {
  std::vector<Range> out;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    for (int64_t b = 0; b < n; b += kChunk) out.push_back({i, b, std::min(n, b + kChunk)});
  }
  return out;
}

void check_lists(const char* op, const at::TensorList params, std::initializer_list<std::pair<const char*, at::TensorList>> others) {
  for (const auto& [name, list] : others) {
    if (list.size() != params.size()) {
      throw std::invalid_argument(std::string("fsdp: ") + op + ": " + std::to_string(list.size()) + " " + name +
                                  " for " + std::to_string(params.size()) + " parameters");
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    if (p.scalar_type() != params[0].scalar_type() || p.device() != params[0].device() || !p.is_contiguous()) {
      throw std::invalid_argument(std::string("fsdp: ") + op + ": parameter " + std::to_string(i) +
                                  " is not contiguous or not of the first one's dtype and device");
    }
    for (const auto& [name, list] : others) {
      const at::Tensor& t = list[i];
      const std::string what = std::string("fsdp: ") + op + ": parameter " + std::to_string(i) + "'s " + name;
      if (!t.defined()) throw std::invalid_argument(what + " is undefined");
      if (t.scalar_type() != p.scalar_type()) {
        throw std::invalid_argument(what + " is " + std::string(c10::toString(t.scalar_type())) + ", the parameter " +
                                    std::string(c10::toString(p.scalar_type())) + ": cast it to the parameter's dtype");
      }
      if (t.sizes() != p.sizes()) {
        // libtorch's operators would refuse it (or broadcast it); read flat it would land on the
        // wrong elements.
        throw std::invalid_argument(what + " has shape " + c10::str(t.sizes()) + ", the parameter " + c10::str(p.sizes()) +
                                    ": give it the parameter's shape. Under fsdp a parameter holds its whole value inside "
                                    "summon_full_params() and unshard() scopes and while a forward's output waits for its "
                                    "backward, and this rank's shard (as its gradient and state do) everywhere else: step there");
      }
      if (t.device() != p.device() || !t.is_contiguous()) {
        throw std::invalid_argument(what + " is not a contiguous tensor on the parameter's device " + p.device().str());
      }
    }
  }
}

// In the kernels, below fsdp's guard: what the guard refuses by name (a no_sync gradient, in the
// whole parameter's shape) is refused there first.
void check_adamw(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, bool amsgrad) {
  check_lists("FusedAdamW", params, {{"gradient", grads}, {"exp_avg", exp_avgs}, {"exp_avg_sq", exp_avg_sqs}});
  if (amsgrad) check_lists("FusedAdamW", params, {{"max_exp_avg_sq", max_exp_avg_sqs}});
}

void check_sgd(at::TensorList params, at::TensorList grads, at::TensorList bufs, double momentum) {
  check_lists("FusedSGD", params, {{"gradient", grads}});
  if (momentum != 0) check_lists("FusedSGD", params, {{"momentum_buffer", bufs}});
}

template <typename T>
cpu::AdamWStep<T> adamw_step(const AdamWHyper& h, int64_t step) {
  // libtorch AdamW's scalars, in double, then rounded to T as a Scalar argument is.
  const double bc1 = 1 - std::pow(h.beta1, step), bc2 = 1 - std::pow(h.beta2, step);
  return {static_cast<T>(h.weight_decay != 0 ? 1 - h.lr * h.weight_decay : 1.0), static_cast<T>(h.beta1),
          static_cast<T>(1 - h.beta1), static_cast<T>(h.beta2), static_cast<T>(1 - h.beta2),
          static_cast<T>(std::sqrt(bc2)), static_cast<T>(h.eps), static_cast<T>(-(h.lr / bc1))};
}

template <typename T>
void adamw_cpu_typed(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     at::TensorList max_exp_avg_sqs, at::IntArrayRef steps, const AdamWHyper& h) {
  std::vector<cpu::AdamWStep<T>> scalars;
  scalars.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) scalars.push_back(adamw_step<T>(h, steps[i]));
  const std::vector<Range> work = chunks(params);
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const Range& r = work[c];
      const size_t i = r.tensor;
      T* vmax = h.amsgrad ? max_exp_avg_sqs[i].data_ptr<T>() + r.begin : nullptr;
      cpu::adamw(params[i].data_ptr<T>() + r.begin, grads[i].data_ptr<T>() + r.begin,
                 exp_avgs[i].data_ptr<T>() + r.begin, exp_avg_sqs[i].data_ptr<T>() + r.begin, vmax, r.end - r.begin,
                 scalars[i]);
    }
  });
}

// Kernels take the op's arguments as the schema below declares them.
void adamw_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::IntArrayRef steps, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool amsgrad) {
  const AdamWHyper h{lr, beta1, beta2, eps, weight_decay, amsgrad};
  check_adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad);
  if (params.empty()) return;
  if (params[0].scalar_type() == at::kFloat) {
    adamw_cpu_typed<float>(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, h);
  } else {
    adamw_cpu_typed<double>(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, h);
  }
}

template <typename T>
void sgd_cpu_typed(at::TensorList params, at::TensorList grads, at::TensorList bufs, at::IntArrayRef fresh,
                   const SGDHyper& h) {
  const std::vector<Range> work = chunks(params);
  at::parallel_for(0, static_cast<int64_t>(work.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const Range& r = work[c];
      const size_t i = r.tensor;
      const cpu::SGDStep<T> s{static_cast<T>(h.weight_decay), static_cast<T>(h.momentum),
                              static_cast<T>(1 - h.dampening),   static_cast<T>(-1 * h.lr),
                              h.weight_decay != 0,               h.momentum != 0,
                              h.nesterov,                        fresh[i] != 0};
      T* buf = s.has_momentum ? bufs[i].data_ptr<T>() + r.begin : nullptr;
      cpu::sgd(params[i].data_ptr<T>() + r.begin, grads[i].data_ptr<T>() + r.begin, buf, r.end - r.begin, s);
    }
  });
}

void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList bufs, at::IntArrayRef fresh, double lr,
             double momentum, double dampening, double weight_decay, bool nesterov) {
  const SGDHyper h{lr, momentum, dampening, weight_decay, nesterov};
  check_sgd(params, grads, bufs, momentum);
  if (params.empty()) return;
  if (params[0].scalar_type() == at::kFloat) {
    sgd_cpu_typed<float>(params, grads, bufs, fresh, h);
  } else {
    sgd_cpu_typed<double>(params, grads, bufs, fresh, h);
  }
}

// CUDA: torch's own fused multi-tensor kernels (one launch per group of tensors). They keep the
// step count in a tensor they increment themselves: given step - 1, they update as step.
void adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList max_exp_avg_sqs, at::IntArrayRef steps, double lr, double beta1, double beta2, double eps,
                double weight_decay, bool amsgrad) {
  check_adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, amsgrad);
  if (params.empty()) return;
  std::vector<float> before(steps.begin(), steps.end());
  for (float& s : before) s -= 1;
  const at::Tensor counts = at::tensor(before).to(params[0].device());
  std::vector<at::Tensor> state_steps;
  for (size_t i = 0; i < params.size(); ++i) state_steps.push_back(counts[static_cast<int64_t>(i)]);
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, amsgrad ? max_exp_avg_sqs : at::TensorList(), state_steps, lr,
                    beta1, beta2, weight_decay, eps, amsgrad, /*maximize=*/false);
}

void sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList bufs, at::IntArrayRef fresh, double lr,
              double momentum, double dampening, double weight_decay, bool nesterov) {
  check_sgd(params, grads, bufs, momentum);
  if (params.empty()) return;
  // aten::_fused_sgd_ takes one first-step flag for the whole list: split by it.
  for (const bool first : {true, false}) {
    std::vector<at::Tensor> p, g, b;
    for (size_t i = 0; i < params.size(); ++i) {
      if ((fresh[i] != 0) != first) continue;
      p.push_back(params[i]);
      g.push_back(grads[i]);
      if (momentum != 0) b.push_back(bufs[i]);
    }
    if (p.empty()) continue;
    at::_fused_sgd_(p, g, b, weight_decay, momentum, lr, dampening, nesterov, /*maximize=*/false, first);
  }
}

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

}  // namespace

TORCH_LIBRARY(fsdp_cpp, m) {
  m.def("fused_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] max_exp_avg_sqs, int[] steps, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "bool amsgrad) -> ()");
  m.def("fused_sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, int[] fresh, float lr, "
        "float momentum, float dampening, float weight_decay, bool nesterov) -> ()");
}

TORCH_LIBRARY_IMPL(fsdp_cpp, CPU, m) {
  m.impl("fused_adamw_", TORCH_FN(adamw_cpu));
  m.impl("fused_sgd_", TORCH_FN(sgd_cpu));
}

TORCH_LIBRARY_IMPL(fsdp_cpp, CUDA, m) {
  m.impl("fused_adamw_", TORCH_FN(adamw_cuda));
  m.impl("fused_sgd_", TORCH_FN(sgd_cuda));
}

// Called under NoGradGuard by the optimizers: nothing for autograd to record.
TORCH_LIBRARY_IMPL(fsdp_cpp, Autograd, m) {
  m.impl("fused_adamw_", torch::CppFunction::makeFallthrough());
  m.impl("fused_sgd_", torch::CppFunction::makeFallthrough());
}

void fused_adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                 const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<int64_t>& steps, const AdamWHyper& h) {
  static const auto call = op("fsdp_cpp::fused_adamw_")
                               .typed<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                                           at::IntArrayRef, double, double, double, double, double, bool)>();
  call.call(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay,
            h.amsgrad);
}

void fused_sgd(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& momentum_buffers, const std::vector<int64_t>& fresh, const SGDHyper& h) {
  static const auto call =
      op("fsdp_cpp::fused_sgd_")
          .typed<void(at::TensorList, at::TensorList, at::TensorList, at::IntArrayRef, double, double, double, double, bool)>();
  call.call(params, grads, momentum_buffers, fresh, h.lr, h.momentum, h.dampening, h.weight_decay, h.nesterov);
}

}  // namespace fsdp::optim
