// The one-pass updates of fsdp::FusedAdamW and fsdp::FusedSGD (include/fsdp/fused_optimizer.h),
// reached through the dispatcher as the operators fsdp_cpp::fused_adamw_ and fsdp_cpp::fused_sgd_:
// a parameter is a keyed tensor under fsdp (engine/param_key.h), so an update that went around the
// dispatcher would go around fsdp's guard (engine/param_guard.h) too. One call per parameter group.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp::optim {

struct AdamWHyper {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool amsgrad = false;
};

// Steps every params[i] with grads[i] and its moments (max_exp_avg_sqs empty unless amsgrad),
// `steps[i]` being the step number this update makes (1 for the first).
void fused_adamw(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                 const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<int64_t>& steps,
                 const AdamWHyper& h);

struct SGDHyper {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
};

// Steps every params[i]; with momentum, momentum_buffers[i] is updated, or (fresh[i] != 0) set to
// the first step's direction as libtorch's SGD does when it creates the buffer.
void fused_sgd(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::vector<at::Tensor>& momentum_buffers, const std::vector<int64_t>& fresh,
               const SGDHyper& h);

}  // namespace fsdp::optim
