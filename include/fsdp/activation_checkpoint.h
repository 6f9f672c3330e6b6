// Activation checkpointing for libtorch: Python's torch.utils.checkpoint has no C++ counterpart.
// A checkpointed call keeps only its inputs (and the random number generators' states) for
// backward; when backward reaches it, the call runs again with grad mode on, from the same
// inputs and the same RNG state (dropout draws the same mask), and backward goes through what it
// recomputed. Activation memory then grows with the number of checkpointed calls rather than with
// everything inside them, for one more forward's compute.
//
// Usable on its own and under fsdp: inside a wrapped model, the recomputation gathers the units
// it touches through the same mechanism as forward (and backward prefetch looks ahead from it as
// from any unit's backward), each unit's gradients are reduce-scattered as soon as its
// recomputed part has been backwarded, and the unit is freed again.
//
//   // a callable (kept for backward, which calls it again: capture by value, never by reference)
//   torch::Tensor y = fsdp::checkpoint([block](const torch::Tensor& x) { return block->forward(x); }, x);
//
//   // by policy, like the auto-wrap policies: mark modules, and let the model's forward call
//   // its children through fsdp::checkpointable (models/gpt.cpp does for its blocks)
//   fsdp::apply_activation_checkpointing(*model, fsdp::checkpoint_modules_of_type<models::BlockImpl>());
//   x = fsdp::checkpointable(*block, [block](const torch::Tensor& h) { return block->forward(h); }, x);
//
// What is recomputed must compute the same thing when run again: a function of its inputs, the
// parameters and the RNG, with no side effects that matter (a BatchNorm's running statistics
// would be updated twice). It is re-entrant, like torch.utils.checkpoint(use_reentrant=True): its
// backward runs a backward of its own, so torch::autograd::grad over a checkpointed region (rather
// than backward()) is not supported, nor is double backward through one.
#pragma once

#include <functional>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

namespace fsdp {

using TensorFn = std::function<torch::Tensor(const torch::Tensor&)>;
using TensorsFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

// fn(inputs), saving only `inputs` for backward (see above); fn is kept until then. Without grad
// mode, simply fn(inputs).
std::vector<torch::Tensor> checkpoint(const TensorsFn& fn, const std::vector<torch::Tensor>& inputs);
torch::Tensor checkpoint(const TensorFn& fn, const torch::Tensor& input);

// Which modules to checkpoint, decided per module (like fsdp::WrapPolicy for units).
using CheckpointPolicy = std::function<bool(const torch::nn::Module&)>;

// Every module of type `Impl` (e.g. models::BlockImpl), like PyTorch's ModuleWrapPolicy.
template <class Impl>
CheckpointPolicy checkpoint_modules_of_type() {
  return [](const torch::nn::Module& m) { return dynamic_cast<const Impl*>(&m) != nullptr; };
}

// Marks `model` and its submodules for which `policy` holds; returns how many it marked. A mark
// lives as long as its module and changes nothing by itself: the model's forward asks for it
// through checkpointable(). Modules must be owned by a shared_ptr (as ModuleHolders are).
int apply_activation_checkpointing(torch::nn::Module& model, const CheckpointPolicy& policy);
// Removes the marks of `model` and its submodules.
void remove_activation_checkpointing(torch::nn::Module& model);
bool is_checkpointed(const torch::nn::Module& module);

// For a model's forward, where it calls a child: fn(input) checkpointed when `module` is marked,
// plainly otherwise.
torch::Tensor checkpointable(const torch::nn::Module& module, const TensorFn& fn, const torch::Tensor& input);
// The same for a child with several tensor inputs (T5's blocks: the hidden states, the position
// bias, the encoder's output) or several outputs.
std::vector<torch::Tensor> checkpointable(const torch::nn::Module& module, const TensorsFn& fn,
                                          const std::vector<torch::Tensor>& inputs);

}  // namespace fsdp
