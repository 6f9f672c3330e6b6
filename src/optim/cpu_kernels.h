// The per-element loops of the fused optimizers on CPU (fused_ops.cpp calls them, one contiguous
// range of one parameter at a time). Raw pointers and no ATen: this file is compiled with its own
// floating-point flags (CMakeLists.txt) and must not see code that relies on the defaults.
#pragma once

#include <cstdint>

namespace fsdp::optim::cpu {

// The scalars of one AdamW update, already rounded to the parameter's dtype as libtorch's scalar
// arguments are: decay = 1 - lr·wd (1 without weight decay), neg_step = -lr / (1 - β1^t),
// bc2_sqrt = sqrt(1 - β2^t).
template <typename T>
struct AdamWStep {
  T decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step;
};

// max_exp_avg_sq: null unless amsgrad.
void adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, int64_t n,
           const AdamWStep<float>& s);
void adamw(double* param, const double* grad, double* exp_avg, double* exp_avg_sq, double* max_exp_avg_sq,
           int64_t n, const AdamWStep<double>& s);

template <typename T>
struct SGDStep {
  T weight_decay, momentum, one_minus_dampening, neg_lr;
  bool has_weight_decay, has_momentum, nesterov, fresh;  // fresh: the buffer is created by this step
};

// momentum_buffer: null without momentum.
void sgd(float* param, const float* grad, float* momentum_buffer, int64_t n, const SGDStep<float>& s);
void sgd(double* param, const double* grad, double* momentum_buffer, int64_t n, const SGDStep<double>& s);

}  // namespace fsdp::optim::cpu
