// fsdp::FusedAdamW (include/fsdp/fused_optimizer.h): libtorch AdamW's bookkeeping (state created on
// a parameter's first step, the step count per parameter), then one fused call per parameter
// group and dtype instead of eight operators per parameter.
#include "fsdp/fused_optimizer.h"

#include <torch/optim/serialize.h>

#include "optim/fused_ops.h"
#include "optim/optimizer_lists.h"

namespace fsdp {
namespace {

constexpr const char* kFusedAdamW = "FusedAdamW";

}  // namespace

FusedAdamW::FusedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                       torch::optim::AdamWOptions defaults)
    : Optimizer(param_groups, std::make_unique<torch::optim::AdamWOptions>(defaults)) {
  optim::check_unique(kFusedAdamW, param_groups_);
  optim::check_adamw_options(param_groups_);
}

FusedAdamW::FusedAdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults)
    : FusedAdamW({torch::optim::OptimizerParamGroup(std::move(params))}, defaults) {}

at::Tensor FusedAdamW::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  const at::Tensor loss = optim::begin_step(kFusedAdamW, param_groups_, closure);
  struct Lists {
    std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
    std::vector<int64_t> steps;
    std::vector<torch::optim::AdamWParamState*> states;
    std::vector<bool> created;
  };
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    auto& group = param_groups_[gi];
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    optim::Partitions<Lists> parts;
    for (size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& p = group.params()[i];
      if (!p.grad().defined()) continue;
      at::Tensor grad = optim::checked_grad(kFusedAdamW, p, gi, i);
      auto it = state_.find(p.unsafeGetTensorImpl());
      const bool created = it == state_.end();
      if (created) {
        auto s = std::make_unique<torch::optim::AdamWParamState>();
        s->step(0);
        s->exp_avg(at::zeros_like(p, at::MemoryFormat::Contiguous));
        s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Contiguous));
        if (o.amsgrad()) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Contiguous));
        it = state_.emplace(p.unsafeGetTensorImpl(), std::move(s)).first;
      }
      auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
      if (o.amsgrad() && !s.max_exp_avg_sq().defined()) s.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Contiguous));
      s.step(s.step() + 1);
      Lists& l = parts[optim::partition_key(p)];
      l.params.push_back(p);
      l.grads.push_back(std::move(grad));
      l.exp_avgs.push_back(optim::kernel_ready(s.exp_avg(), p));
      l.exp_avg_sqs.push_back(optim::kernel_ready(s.exp_avg_sq(), p));
      if (o.amsgrad()) l.max_exp_avg_sqs.push_back(optim::kernel_ready(s.max_exp_avg_sq(), p));
      l.steps.push_back(s.step());
      l.states.push_back(&s);
      l.created.push_back(created);
    }
    const optim::AdamWHyper h{o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), o.amsgrad()};
    for (auto it = parts.begin(); it != parts.end(); ++it) {
      try {
        optim::fused_adamw(it->second.params, it->second.grads, it->second.exp_avgs, it->second.exp_avg_sqs,
                           it->second.max_exp_avg_sqs, it->second.steps, h);
      } catch (...) {
        // Refused (fsdp's guard checks every parameter before the kernel writes any): the
        // parameters of this call and of the group's calls not made yet keep the state they had.
        for (auto rest = it; rest != parts.end(); ++rest) {
          Lists& l = rest->second;
          for (size_t i = 0; i < l.params.size(); ++i) {
            if (l.created[i]) state_.erase(l.params[i].unsafeGetTensorImpl());
            else l.states[i]->step(l.states[i]->step() - 1);
          }
        }
        throw;
      }
    }
  }
  return loss;
}

void FusedAdamW::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(archive, *this);
}

void FusedAdamW::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(archive, *this);
}

}  // namespace fsdp
