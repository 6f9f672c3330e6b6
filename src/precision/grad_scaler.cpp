#include "fsdp/grad_scaler.h"
#include "fsdp/tensor_parallel.h"

#include <stdexcept>
#include <unordered_set>

#include "comm/collectives.h"

namespace fsdp {

ShardedGradScaler::ShardedGradScaler(std::shared_ptr<Mesh> mesh, GradScalerOptions options)
    : mesh_(std::move(mesh)), options_(options), scale_(options.init_scale) {
  if (!mesh_) throw std::invalid_argument("fsdp: ShardedGradScaler needs the mesh");
  if (!(options_.init_scale > 0) || !(options_.growth_factor > 1) || !(options_.backoff_factor > 0 && options_.backoff_factor < 1) ||
      options_.growth_interval < 1) {
    throw std::invalid_argument("fsdp: ShardedGradScaler options need init_scale > 0, growth_factor > 1, "
                                "0 < backoff_factor < 1 and growth_interval >= 1");
  }
}

at::Tensor ShardedGradScaler::scale(const at::Tensor& loss) const { return loss * scale_; }

void ShardedGradScaler::check_tensor_parallel_mesh(torch::optim::Optimizer& optimizer) const {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      // A parameter split for tensor parallelism is trained by a job larger than the
      // data-parallel mesh the model is wrapped over: the overflow decision must be the whole
      // job's, or one TP rank skips a step its peers take (decided before anything is divided, on
      // every rank alike: the optimizer's parameters are the same everywhere).
      if (const auto placement = tensor_parallel_placement(p);
          placement && placement->tp->size() > 1 && placement->tp->world()->world_size() != mesh_->world_size()) {
        throw std::invalid_argument(
            "fsdp: this ShardedGradScaler was made on a mesh of " + std::to_string(mesh_->world_size()) +
            " ranks, and the optimizer steps parameters split for tensor parallelism by a job of " +
            std::to_string(placement->tp->world()->world_size()) + ": an overflow in one TP rank's parts must skip "
            "every rank's step, or the TP ranks' replicas drift apart. Make the scaler on the job's mesh: "
            "fsdp::ShardedGradScaler(tp->world()), as the Checkpointer takes it.");
      }
    }
  }
}

void ShardedGradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (unscaled_) throw std::logic_error("fsdp: ShardedGradScaler::unscale_ called twice in one step; call update() after step()");
  at::NoGradGuard no_grad;
  const double inv = 1.0 / scale_;
  // Overflow flags stay on the gradients' device until the end: one host sync per step, not per
  // tensor.
  at::Tensor local_inf;
  // Each gradient once: an optimizer built from model->parameters() lists a tied weight twice, and
  // dividing its gradient twice would unscale it by scale².
  std::unordered_set<const c10::TensorImpl*> seen;
  if (!mesh_checked_.count(&optimizer)) {
    check_tensor_parallel_mesh(optimizer);
    mesh_checked_.insert(&optimizer);
  }
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      at::Tensor g = p.mutable_grad();
      if (!g.defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
      at::Tensor bad = at::logical_not(at::isfinite(g).all());
      local_inf = local_inf.defined() ? at::logical_or(local_inf, bad.to(local_inf.device())) : bad;
      g.mul_(inv);
    }
  }
  // One rank's overflow skips the step on every rank: the flag is summed over the world (on the
  // CPU, where the world group is).
  at::Tensor flag = local_inf.defined() ? local_inf.to(at::kCPU, at::kFloat).reshape({1}) : at::zeros({1}, at::kFloat);
  std::vector<at::Tensor> one{flag};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  wait_for(mesh_->world()->allreduce(one, opts), "all-reduce of the gradient scaler's overflow flag");
  found_inf_ = flag.item<float>() > 0;
  unscaled_ = true;
}

bool ShardedGradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!unscaled_) unscale_(optimizer);
  if (found_inf_) return false;
  optimizer.step();
  return true;
}

void ShardedGradScaler::update() {
  if (!unscaled_) throw std::logic_error("fsdp: ShardedGradScaler::update called before unscale_/step in this step");
  if (found_inf_) {
    scale_ *= options_.backoff_factor;
    good_steps_ = 0;
  } else if (++good_steps_ == options_.growth_interval) {
    scale_ *= options_.growth_factor;
    good_steps_ = 0;
  }
  unscaled_ = false;
  found_inf_ = false;
}

}  // namespace fsdp
