// What the fused optimizers (include/fsdp/fused_optimizer.h) share: checking a parameter before
// its update, and sorting a group's parameters into the lists one fused call takes (one dtype and
// device per call).
#pragma once

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

namespace fsdp::optim {

// Refuses, naming `optimizer` and the parameter's place, what the fused kernels cannot step: a
// sparse gradient, a dtype other than float32/float64, a device other than CPU/CUDA, a
// non-contiguous parameter. Returns the gradient as the kernels read it (contiguous).
at::Tensor checked_grad(const char* optimizer, const at::Tensor& param, size_t group, size_t index);

// Refuses a parameter listed twice across the groups (a tied weight under each of its names):
// libtorch's optimizers step it twice per step; a fused call would update it from two threads.
void check_unique(const char* optimizer, const std::vector<torch::optim::OptimizerParamGroup>& groups);

// A state tensor as the kernels read it: contiguous, of the parameter's dtype, device and shape
// (a checkpoint or a live replica's transfer may have set one that is not); converted in place.
at::Tensor& kernel_ready(at::Tensor& state, const at::Tensor& param);

// What libtorch's constructors refuse, refused alike: a negative learning rate, epsilon or weight
// decay, betas outside [0, 1), SGD's negative momentum and Nesterov without momentum or with
// dampening. Every group's options.
void check_adamw_options(const std::vector<torch::optim::OptimizerParamGroup>& groups);
void check_sgd_options(const std::vector<torch::optim::OptimizerParamGroup>& groups);

// The start of a step, as libtorch's optimizers do it: the closure's loss (with gradients on), and
// the parameters checked to be listed once.
at::Tensor begin_step(const char* optimizer, const std::vector<torch::optim::OptimizerParamGroup>& groups,
                      const torch::optim::Optimizer::LossClosure& closure);

// Parameters of one (dtype, device), in the order they were added.
template <typename Lists>
using Partitions = std::map<std::tuple<int, int, int>, Lists>;
inline std::tuple<int, int, int> partition_key(const at::Tensor& t) {
  return {static_cast<int>(t.scalar_type()), static_cast<int>(t.device().type()), t.device().index()};
}

}  // namespace fsdp::optim
