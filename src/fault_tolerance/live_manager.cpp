// LiveManager (fsdp/live_manager.h): the calls of a user's own live training loop, on top of a
// rank's LiveReplicas: which model state a joiner copies, the step this rank holds, the average of
// the gradients and the commit.
#include "fsdp/live_manager.h"

#include <cstdio>
#include <stdexcept>

#include "checkpoint/optimizer_state.h"
#include "wrap/sharded_root.h"

namespace fsdp {

std::unique_ptr<LiveManager> LiveManager::connect(const LaunchEnv& env, LiveOptions options, MeshOptions mesh_options) {
  if (options.total_steps <= 0) {
    throw std::invalid_argument("fsdp: LiveManager needs options.total_steps, the run's steps (the same on every "
                                "rank): the coordinator ends the job once every group trained them");
  }
  return std::unique_ptr<LiveManager>(new LiveManager(LiveReplicas::connect(env, std::move(options), mesh_options)));
}

void LiveManager::track(FullyShardedDataParallelBase& model, torch::optim::Optimizer& optimizer) {
  detail::ShardedRoot& root = detail::RootAccess::of(model);
  const Options& o = root.options();
  auto refuse = [](const std::string& what) {
    throw std::invalid_argument("fsdp: LiveManager::track: " + what);
  };
  if (&root.mesh() != live_->replica_mesh().get()) {
    refuse("the model is sharded over another mesh than this rank's replica group; wrap it with "
           "FullyShardedDataParallel(model, live->replica_mesh(), options)");
  }
  if (o.strategy == ShardingStrategy::HYBRID_SHARD || o.strategy == ShardingStrategy::HYBRID_SHARD_ZERO2) {
    refuse("strategy " + to_string(o.strategy) + ": the live groups are the replicas already; shard within the "
           "group with FULL_SHARD (or SHARD_GRAD_OP for hybrid_shard_zero2)");
  }
  if (o.tensor_parallel) {
    refuse("tensor parallelism is not supported with live replica groups (a group's TP ranks would have to join "
           "as one); train without it, or restart from checkpoints (launch --max-restarts)");
  }
  if (o.reshard_after_forward_to != 0 || !o.reshard_after_forward_to_by_unit.empty()) {
    refuse("hpZ (reshard_after_forward_to) keeps a second shard group that a joining group cannot take from a "
           "peer; drop it");
  }
  (void)OptimizerStateAdapter::for_optimizer(optimizer);  // refuses an optimizer whose state cannot be sent
  params_ = model.parameters();
  optimizer_ = &optimizer;
}

std::optional<int64_t> LiveManager::start_step() {
  if (!optimizer_) {
    throw std::logic_error("fsdp: LiveManager::start_step before track(model, optimizer): a joining group would "
                           "receive no state");
  }
  round_ = live_->next_round(step_, params_, optimizer_);
  if (round_.step >= live_->total_steps()) return std::nullopt;
  in_step_ = true;
  step_ = round_.step;  // a joining group now holds the job's step
  return round_.step;
}

namespace {

// The layout of `extra` (how many, each one's dtype and shape), folded to 40 bits so that its
// negation fits the same int64 maximum.
int64_t layout_of(const std::vector<at::Tensor>& extra) {
  uint64_t h = 1469598103934665603ull;
  auto add = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  add(extra.size());
  for (const auto& t : extra) {
    add(static_cast<uint64_t>(t.scalar_type()));
    add(static_cast<uint64_t>(t.dim()));
    for (int64_t d : t.sizes()) add(static_cast<uint64_t>(d));
  }
  return static_cast<int64_t>(h >> 24);
}

}  // namespace

bool LiveManager::should_commit(std::vector<at::Tensor> extra) {
  if (!in_step_) {
    throw std::logic_error("fsdp: LiveManager::should_commit without a step: call it once after each start_step's "
                           "backward");
  }
  for (auto& t : extra) {
    if (!t.defined() || !at::isFloatingType(t.scalar_type())) {
      const std::string what =
          t.defined() ? "not floating-point (" + std::string(c10::toString(t.scalar_type())) + ")" : "undefined";
      throw std::invalid_argument("fsdp: LiveManager::should_commit: an extra tensor is " + what +
                                  ": the groups average it; pass a floating-point tensor (the loss, a metric)");
    }
  }
  in_step_ = false;
  // First what every member must agree on, in one small collective: the same parameters and the
  // same extras (else the average's layouts would differ, which Gloo answers with an abort), and
  // whether some rank lacks a gradient (a unit one group did not use this step).
  bool all_defined = true;
  for (const auto& p : params_) all_defined = all_defined && p.grad().defined();
  const int64_t n = static_cast<int64_t>(params_.size()), layout = layout_of(extra);
  at::Tensor head = at::tensor({n, -n, layout, -layout, all_defined ? int64_t{-1} : int64_t{0}}, at::kLong);
  std::string why;
  bool ok = live_->agree(head, &why);
  std::vector<bool> averaged(params_.size(), true);
  if (ok) {
    if (head[0].item<int64_t>() != -head[1].item<int64_t>()) {
      throw std::invalid_argument("fsdp: LiveManager::should_commit: the ranks track different numbers of parameters "
                                  "(track(model, optimizer)): every group must wrap the same model");
    }
    if (head[2].item<int64_t>() != -head[3].item<int64_t>()) {
      throw std::invalid_argument("fsdp: LiveManager::should_commit: the extra tensors differ across the ranks (their "
                                  "number, dtypes or shapes): pass the same list on every rank (a loss of shape [1], "
                                  "say)");
    }
    if (head[4].item<int64_t>() != -1) {
      // A gradient one rank lacks counts as zeros in the average, as DDP counts an unused
      // parameter's; a parameter no rank has a gradient for keeps none.
      at::Tensor has = at::empty({n}, at::kLong);
      for (int64_t i = 0; i < n; ++i) has[i] = params_[static_cast<size_t>(i)].grad().defined() ? 1 : 0;
      ok = live_->agree(has, &why);
      for (int64_t i = 0; ok && i < n; ++i) {
        at::Tensor p = params_[static_cast<size_t>(i)];
        averaged[static_cast<size_t>(i)] = has[i].item<int64_t>() != 0;
        if (averaged[static_cast<size_t>(i)] && !p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      }
    }
  }
  if (ok) {
    std::vector<at::Tensor> tensors;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (averaged[i]) tensors.push_back(params_[i].grad());
    }
    for (auto& t : extra) tensors.push_back(t.detach());
    ok = live_->average(tensors, &why);
  }
  if (live_->commit(ok, why)) {
    step_ = round_.step + 1;
    failure_.clear();
    return true;
  }
  failure_ = ok ? "another group failed during the step" : why;
  ++discarded_;
  return false;
}

std::string state_digest(const std::vector<at::Tensor>& params, torch::optim::Optimizer& optimizer) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  auto add = [&h](const at::Tensor& t) {
    if (!t.defined()) return;
    const at::Tensor c = t.detach().to(at::kCPU).contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    const size_t n = static_cast<size_t>(c.numel()) * c.element_size();
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  };
  const auto adapter = OptimizerStateAdapter::for_optimizer(optimizer);
  for (const auto& p : params) {
    add(p);
    const ParamOptimState s = adapter->get(optimizer, p);
    if (!s.present) continue;
    for (const auto& key : adapter->tensor_keys()) {
      auto it = s.tensors.find(key);
      if (it != s.tensors.end()) add(it->second);
    }
    add(at::full({1}, s.step, at::kLong));
  }
  char text[20];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  return text;
}

}  // namespace fsdp
