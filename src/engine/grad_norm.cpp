#include "engine/grad_norm.h"

#include <c10/core/GradMode.h>

#include "fsdp/tensor_parallel.h"

namespace fsdp {

double clip_grad_norm(const std::vector<const Unit*>& units, CommContext& comm, double max_norm,
                      const std::vector<at::Tensor>& model_parallel, const TensorParallel* tp) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  // [0]: replicated parameters' squares (every TP rank holds the same), [1]: TP-split ones' (each
  // TP rank its part): the first counted once, the second summed over the TP group too.
  // Squares summed in fp32, or in fp64 when a unit's gradients are fp64 (a model cast to double:
  // an fp32 sum would put its norm, and every clipped gradient, 1e-8 from local training's).
  // Decided by the units' dtypes, which every rank shares, so the all-reduce below agrees.
  c10::ScalarType acc = at::kFloat;
  for (const Unit* u : units) {
    if (u->handle().dtypes().grad == at::kDouble) acc = at::kDouble;
  }
  at::Tensor sums = at::zeros({2}, units.empty() ? at::TensorOptions(acc)
                                                 : units[0]->handle().shard().options().dtype(acc));
  const bool split_dims = tp != nullptr && tp->size() > 1;
  for (const Unit* u : units) {
    for (const auto& p : u->handle().params()) {
      if (!p.grad().defined()) continue;
      grads.push_back(p.grad());
      const bool split = split_dims && tensor_parallel_placement(p).has_value();
      sums[split ? 1 : 0].add_(p.grad().to(acc).pow(2).sum());
    }
  }
  if (comm.mesh().shard_size > 1) {
    InFlight f = comm.issue(CommKind::ALL_REDUCE, Over::SHARD_GROUP, -1, "the gradient norm",
                            [&] { return Buffers{sums, at::Tensor()}; });
    comm.wait(f);
  }
  if (split_dims) {
    at::Tensor part = sums.narrow(0, 1, 1).clone();
    std::vector<at::Tensor> v{part};
    tp->group(part.device().type())->allreduce(v)->wait();
    sums.narrow(0, 1, 1).copy_(part);
  }
  at::Tensor sumsq = sums.sum().reshape({1});
  if (!model_parallel.empty()) {
    // Each rank's part is its own: the world group's sum is the whole tensors' (on the CPU, where
    // the world group runs).
    std::vector<at::Tensor> parts;
    at::Tensor mp = at::zeros({1}, at::kFloat);
    for (const auto& p : model_parallel) {
      if (!p.grad().defined()) continue;
      parts.push_back(p.grad());
      mp.add_(p.grad().to(at::kFloat).pow(2).sum().to(at::kCPU));
    }
    if (comm.mesh().world_size > 1) {
      InFlight f = comm.issue(CommKind::ALL_REDUCE, Over::WORLD, -1, "the model-parallel gradient norm",
                              [&] { return Buffers{mp, at::Tensor()}; });
      comm.wait(f);
    }
    sumsq.add_(mp.to(sumsq.device()));
    grads.insert(grads.end(), parts.begin(), parts.end());
  }
  const at::Tensor total = sumsq.sqrt();
  const at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);
  for (auto& g : grads) g.mul_(coef.to(g.dtype()));
  return total.item<double>();
}

}  // namespace fsdp
