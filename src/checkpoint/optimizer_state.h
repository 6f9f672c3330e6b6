// An optimizer's state keyed by what a checkpoint can name (docs/checkpoints.md): libtorch keys
// each parameter's state by its TensorImpl pointer and hides it behind one class per optimizer,
// so each supported optimizer has an adapter that lists its per-parameter tensors by name
// ("exp_avg", "momentum_buffer", ...), its step count, and its group hyper-parameters as JSON.
// Under fsdp every state tensor has its parameter's local shape (this rank's slice), so a
// checkpoint places it exactly like the parameter it belongs to.
//
// Supported: SGD, Adam, AdamW, RMSprop, Adagrad. Others (LBFGS, user optimizers) are refused by
// for_optimizer() with a message that says so, before anything is written.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>

namespace fsdp {

struct ParamOptimState {
  bool present = false;     // libtorch creates state lazily: none before a parameter's first step
  int64_t step = 0;         // optimizers without a per-parameter step count keep 0
  std::map<std::string, at::Tensor> tensors;  // defined tensors only
};

class OptimizerStateAdapter {
 public:
  virtual ~OptimizerStateAdapter() = default;
  // The adapter for `optimizer`'s class; throws std::invalid_argument for an unsupported one.
  static std::unique_ptr<OptimizerStateAdapter> for_optimizer(torch::optim::Optimizer& optimizer);
  // The class's name as the manifest records it ("AdamW").
  virtual std::string name() const = 0;
  // Every per-parameter tensor the class may keep, in a fixed order.
  virtual std::vector<std::string> tensor_keys() const = 0;
  virtual ParamOptimState get(torch::optim::Optimizer& optimizer, const at::Tensor& param) const = 0;
  // Replaces `param`'s state (tensors are taken as given: the caller passes fresh ones).
  virtual void set(torch::optim::Optimizer& optimizer, const at::Tensor& param, const ParamOptimState& state) const = 0;
  virtual nlohmann::json group_options(torch::optim::OptimizerParamGroup& group) const = 0;
  // Throws std::invalid_argument naming the field when `options` lacks one or has the wrong type.
  virtual void set_group_options(torch::optim::OptimizerParamGroup& group, const nlohmann::json& options) const = 0;
};

}  // namespace fsdp
