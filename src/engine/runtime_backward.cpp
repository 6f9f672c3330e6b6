// The runtime's backward (runtime.h): the gradient hooks on every parameter, the BACKWARD phase
// from its first gradient to the end-of-backward callback (or a backward that threw), backward
// prefetch, freeing units as their gradients are in, and the end of an iteration. Separate from
// forward (runtime_forward.cpp) and from the reduction queue it feeds (runtime_reductions.cpp).
#include "engine/runtime.h"

#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <stdexcept>

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace fsdp {
namespace {

// Fires inside AccumulateGrad once a parameter's gradient for this backward is complete: the
// paper's signal for "this unit's gradients may be reduced now" (§4.3).
struct GradReadyHook : torch::autograd::PostAccumulateGradHook {
  GradReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  void operator()(const torch::autograd::Variable&) override { fn_(); }
  std::function<void()> fn_;
};

// Owned by the end-of-backward callback queued on a graph task. Autograd runs the callback when
// the backward completes; when the backward throws it never does, and drops the callback with the
// graph task, before the exception reaches backward()'s caller: then this ends that backward.
struct BackwardEnd {
  explicit BackwardEnd(std::weak_ptr<Runtime> rt) : runtime(std::move(rt)) {}
  ~BackwardEnd() {
    if (reached) return;
    if (auto rt = runtime.lock()) rt->abort_backward();
  }
  std::weak_ptr<Runtime> runtime;
  bool reached = false;
};

}  // namespace

void Runtime::install_hooks() { install_missing_hooks(); }

void Runtime::install_missing_hooks() {
  for (size_t u = 0; u < units_.size(); ++u) {
    const auto& params = units_[u]->handle().params();
    hooked_[u].resize(params.size(), false);
    for (size_t i = 0; i < params.size(); ++i) {
      // A tensor that does not require grad takes no hooks; one unfrozen later gets them here.
      if (hooked_[u][i] || !params[i].requires_grad()) continue;
      hooked_[u][i] = true;
      // Runs just before AccumulateGrad: the parameter must have its unsharded shape then, even
      // when no backward operator read it (the first layer's weight when the input needs no grad).
      std::weak_ptr<Runtime> weak = weak_from_this();
      at::Tensor(params[i]).register_hook([weak, u](const at::Tensor&) {
        if (auto rt = weak.lock()) rt->on_grad_arriving(u);
      });
      torch::autograd::impl::set_post_acc_grad_hooks(params[i], std::make_unique<GradReadyHook>([weak, u, i] {
        if (auto rt = weak.lock()) rt->on_grad_accumulated(u, i);
      }));
    }
  }
}

void Runtime::on_backward_started() {
  const bool again = phase_ == Phase::IDLE && retained_ && torch::autograd::get_current_graph_task_id() != -1;
  if (phase_ != Phase::FORWARD_DONE && !again) return;
  phase_ = Phase::BACKWARD;
  owns_backward_phase_ = open_phase(fsdp::StepPhase::BACKWARD);
  comm_.set_backward_pass(true);
  refuse_at_end_ = grad_of_parameters();
  auto end = std::make_shared<BackwardEnd>(weak_from_this());
  torch::autograd::Engine::get_default_engine().queue_callback([end] {
    end->reached = true;
    if (auto rt = end->runtime.lock()) rt->finish_backward();
  });
}

void Runtime::backward_needs(size_t u) {
  on_backward_started();
  if (phase_ != Phase::BACKWARD) return;
  if (units_[u]->state() != Unit::State::IDLE) {
    use(u);
    return;
  }
  check_unit_intact_for_backward(u);
  release_passed_frozen(u);
  gather(u);
  if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_PRE) prefetch_backward(u);
  use(u);
  if (units_[u]->state() == Unit::State::IDLE) units_[u]->pre_backward();
}

void Runtime::release_passed_frozen(size_t starting) {
  // Backward has moved on to `starting`: a frozen unit it went through for its inputs' gradients
  // (the blocks between a trainable first layer and the head) brings no gradient whose hook would
  // free it, so it is freed here, as PyTorch's FSDP reshards such units as backward passes them.
  // Needed again after all (another branch), it is gathered again.
  for (size_t v = 0; v < units_.size(); ++v) {
    Unit& unit = *units_[v];
    if (v == starting || v == root_unit_ || unit.state() != Unit::State::PRE_BACKWARD || !unit.frozen()) continue;
    if (unit.contains(*units_[starting]) || units_[starting]->contains(unit)) continue;
    unit.post_backward();
    if (touched_by_operator(v)) {
      deferred_reshards_.push_back(v);  // the operator backward is in reads it too
    } else {
      reshard(v);
    }
  }
}

void Runtime::prefetch_backward(size_t u) {
  // The root stays gathered through backward; units whose backward has begun need nothing more.
  const auto next = order_.next_in_backward(u, options_.prefetch_count, [this](size_t v) {
    return v == root_unit_ || units_[v]->state() != Unit::State::IDLE;
  });
  for (size_t v : next) gather(v);
}

void Runtime::on_grad_arriving(size_t u) {
  check_not_failed();  // hooks are where a failure recorded in backward reaches backward()'s caller
  if (!reduce_fifo_.empty()) {
    // Free the inputs of reduce-scatters done since the last unit's backward ended.
    touch::Suppress own_work;
    advance_reductions();
  }
  backward_needs(u);
  check_not_failed();
}

void Runtime::on_grad_accumulated(size_t u, size_t param) {
  check_not_failed();
  on_backward_started();
  if (phase_ != Phase::BACKWARD || !units_[u]->grad_accumulated(param)) return;
  // Every gradient forward made possible for this unit is in: its backward is over.
  units_[u]->post_backward();
  if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_POST) prefetch_backward(u);
  reduce(u);
  reshard(u);
}

void Runtime::drain_ready_queue() {
  drain_pending_ = false;
  touch::Suppress own_work;
  at::AutoGradMode on(true);
  torch::autograd::backward({drain_out_}, {at::ones({1})}, /*retain_graph=*/true);
  drain_leaf_.mutable_grad().reset();
}

void Runtime::abort_backward() noexcept {
  if (phase_ != Phase::BACKWARD || !failure_.empty()) return;  // a failure is final already
  drain_pending_ = true;
  refuse_at_end_.clear();  // the caller gets the backward's own exception
  try {
    // What the backward accumulated up to the exception is reduced, as its end would have.
    finish_backward();
  } catch (const std::exception& e) {
    if (failure_.empty()) failure_ = std::string("fsdp: ending a backward that threw failed: ") + e.what();
  } catch (...) {
    if (failure_.empty()) failure_ = "fsdp: ending a backward that threw failed";
  }
}

void Runtime::finish_backward() {
  const auto closes = c10::make_scope_exit([this] { close_owned_phase(owns_backward_phase_, fsdp::StepPhase::BACKWARD); });
  check_not_failed();
  touch::Suppress own_work;
  advance_reductions();
  memory_.reducing_grads_at_backward_end = memory_.reducing_grads_current;
  memory_.reductions_in_flight_at_backward_end = 0;
  for (size_t u : reduce_fifo_) memory_.reductions_in_flight_at_backward_end += units_[u]->reduction().reducing_bytes() > 0;
  finish_reductions();
  // Units whose gradients did not all arrive through the hooks (a parameter forward touched whose
  // gradient never flowed) are reduced here, in unit order, the same on every rank. A refused
  // backward (torch::autograd::grad of parameters) accumulated nothing and leaves what the
  // parameters held (no_sync sums included) as it was.
  for (size_t u = 0; u < units_.size() && refuse_at_end_.empty(); ++u) {
    if (units_[u]->reduction().has_unreduced()) reduce(u);
  }
  finish_reductions();
  note_memory();
  check_sequence();
  // A graph backwarded with retain_graph may be backwarded again, and so may another forward's
  // graph that is still alive: stay armed for them (end_iteration keeps their nodes).
  const bool synchronized = !no_sync_;
  end_iteration(torch::autograd::get_current_graph_task_keep_graph());
  if (refuse_at_end_.empty() && synchronized) check_replicated_gradients();
  if (!refuse_at_end_.empty()) {
    const std::string refusal = std::move(refuse_at_end_);
    refuse_at_end_.clear();
    throw Refusal(refusal);
  }
}

void Runtime::end_iteration(bool keep_graph) {
  operator_units_.clear();
  deferred_reshards_.clear();  // freed below with every unit
  operator_delivered_ = false;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (!pinned(u)) {
      reshard(u);
      units_[u]->reduction().restore();
    } else {
      // A pinned unit gets its sharded gradients when its unshard() scope ends; until then its
      // parameters show stand-ins that refuse a step or a clip (gradient_reduction.h, hold).
      units_[u]->reduction().hold();
    }
    // The guard follows what the gradients are now (stand-ins made or taken): only a unit that is
    // pinned or had guarded gradients can have changed, so the usual step touches no registry.
    if (pinned(u) || !guarded_grads_[u].empty()) register_unreduced_gradients(u);
    units_[u]->end_iteration(keep_graph);
  }
  backward_pending_ = false;
  forward_nodes_.clear();
  forward_checkpointed_ = false;
  // A graph that lives on (kept by retain_graph, or another forward's not backwarded yet) can be
  // backwarded later, across other iterations: its nodes are kept (weakly) while it lives.
  for (Unit* unit : units_) {
    for (auto& ref : unit->take_graph_refs()) {
      if (!ref.expired()) retained_refs_.push_back(std::move(ref));
    }
  }
  retained_refs_.erase(std::remove_if(retained_refs_.begin(), retained_refs_.end(), [](const auto& r) { return r.expired(); }),
                       retained_refs_.end());
  retained_ = !retained_refs_.empty();
  current_unit_.reset();
  phase_ = Phase::IDLE;
  comm_.set_backward_pass(false);
  if (!retained_) touch::disarm(this);
}

}  // namespace fsdp
