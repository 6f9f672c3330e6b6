// fsdp::FusedSGD (include/fsdp/fused_optimizer.h): libtorch SGD's bookkeeping (the momentum buffer
// created on a parameter's first step, as the step's direction), then one fused call per parameter
// group and dtype.
#include "fsdp/fused_optimizer.h"

#include <torch/optim/serialize.h>

#include "optim/fused_ops.h"
#include "optim/optimizer_lists.h"

namespace fsdp {
namespace {

constexpr const char* kFusedSGD = "FusedSGD";

}  // namespace

FusedSGD::FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, torch::optim::SGDOptions defaults)
    : Optimizer(param_groups, std::make_unique<torch::optim::SGDOptions>(defaults)) {
  optim::check_unique(kFusedSGD, param_groups_);
  optim::check_sgd_options(param_groups_);
}

FusedSGD::FusedSGD(std::vector<at::Tensor> params, torch::optim::SGDOptions defaults)
    : FusedSGD({torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}

at::Tensor FusedSGD::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  const at::Tensor loss = optim::begin_step(kFusedSGD, param_groups_, closure);
  struct Lists {
    std::vector<at::Tensor> params, grads, buffers;
    std::vector<int64_t> fresh;
  };
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    auto& group = param_groups_[gi];
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    optim::Partitions<Lists> parts;
    for (size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& p = group.params()[i];
      if (!p.grad().defined()) continue;
      at::Tensor grad = optim::checked_grad(kFusedSGD, p, gi, i);
      Lists& l = parts[optim::partition_key(p)];
      l.params.push_back(p);
      l.grads.push_back(std::move(grad));
      if (o.momentum() == 0) {
        l.fresh.push_back(0);
        continue;
      }
      auto it = state_.find(p.unsafeGetTensorImpl());
      const bool fresh = it == state_.end();
      if (fresh) {
        // libtorch's first step clones the direction into a new buffer; the kernel writes it.
        auto s = std::make_unique<torch::optim::SGDParamState>();
        s->momentum_buffer(at::empty_like(p, at::MemoryFormat::Contiguous));
        it = state_.emplace(p.unsafeGetTensorImpl(), std::move(s)).first;
      }
      auto& s = static_cast<torch::optim::SGDParamState&>(*it->second);
      l.buffers.push_back(optim::kernel_ready(s.momentum_buffer(), p));
      l.fresh.push_back(fresh ? 1 : 0);
    }
    const optim::SGDHyper h{o.lr(), o.momentum(), o.dampening(), o.weight_decay(), o.nesterov()};
    for (auto it = parts.begin(); it != parts.end(); ++it) {
      try {
        optim::fused_sgd(it->second.params, it->second.grads, it->second.buffers, it->second.fresh, h);
      } catch (...) {
        // Refused before any write (fsdp's guard): buffers this step created are dropped again.
        for (auto rest = it; rest != parts.end(); ++rest) {
          for (size_t i = 0; i < rest->second.params.size(); ++i) {
            if (rest->second.fresh[i] != 0) state_.erase(rest->second.params[i].unsafeGetTensorImpl());
          }
        }
        throw;
      }
    }
  }
  return loss;
}

void FusedSGD::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<torch::optim::SGDParamState, torch::optim::SGDOptions>(archive, *this);
}

void FusedSGD::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<torch::optim::SGDParamState, torch::optim::SGDOptions>(archive, *this);
}

}  // namespace fsdp
