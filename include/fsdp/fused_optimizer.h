// Optimizers that step each parameter in one pass over its memory (issue 38).
//
// libtorch's AdamW updates a parameter with eight tensor operators (mul_, add_, mul_, addcmul_,
// sqrt, div, add_, addcdiv_), each a pass over the parameter's elements and a trip through the
// dispatcher; under fsdp every one of them on a shard also passes fsdp's parameter guard. The
// optimizers here read each element of the parameter, its gradient and its state once and write
// it once, vectorized and spread over the intra-op threads, with one dispatcher call per parameter
// group per step. After fully_shard the parameters are views of each unit's flat shard, in the
// flat layout's order, so a step walks each unit's shard from one end to the other.
//
//   fsdp::FusedAdamW optimizer(groups, torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
//
// Drop-in for torch::optim::AdamW and torch::optim::SGD: the same options classes (per-parameter
// groups, so no weight decay on norms and biases works as before), the same per-parameter state
// classes and the same state keys, so fsdp's checkpoints (and PyTorch's, through the interop)
// load into either, in both directions. fsdp's guards see the step as they see libtorch's: a step
// on the unreduced gradients of no_sync, inside an unshard() scope, or on parameters gathered for
// a pending backward is refused with the same message.
//
// Results. Every operation rounds as the corresponding libtorch CPU operator does (fused
// multiply-adds where ATen's vectorized kernels use them), so the moments exp_avg, exp_avg_sq,
// max_exp_avg_sq and SGD's momentum buffer are bit for bit libtorch's. One operation differs:
// the square root in AdamW's denominator is the IEEE one (correctly rounded), where libtorch's CPU
// sqrt (MKL's vector math) is off by one unit in the last place for about one element in five.
// An AdamW parameter therefore differs from libtorch's where that happens, by at most a rounding of
// itself and a few of its update per step: |p - p_libtorch| <= n·(ε·|p| + 4ε·lr) after n steps (ε
// the dtype's machine epsilon). tests/test_fused_optimizer.cpp checks it over 50 steps; measured
// there: at most 2.4e-7 on float32 parameters of magnitude up to 4, 0.81 of the bound. SGD has no
// square root and is bit for bit libtorch's.
//
// Dtypes: float32 and float64 parameters, on CPU (fsdp's kernels) and CUDA (torch's own fused
// multi-tensor kernels, aten::_fused_adamw_ and aten::_fused_sgd_, whose rounding is their own;
// the CUDA path has not run on a GPU yet). bf16 and fp16 gradients on them (mixed precision's
// keep_low_precision_grads) are promoted to the parameter's dtype, as libtorch's optimizers
// promote them. Anything else is refused with what to use instead.
#pragma once

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

namespace fsdp {

class FusedAdamW : public torch::optim::Optimizer {
 public:
  explicit FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                      torch::optim::AdamWOptions defaults = {});
  explicit FusedAdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults = {});
  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
};

// SGD with momentum, dampening, Nesterov and weight decay as torch::optim::SGD.
class FusedSGD : public torch::optim::Optimizer {
 public:
  explicit FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                    torch::optim::SGDOptions defaults);
  explicit FusedSGD(std::vector<at::Tensor> params, torch::optim::SGDOptions defaults);
  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
};

}  // namespace fsdp
