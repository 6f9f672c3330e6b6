// The runtime's forward (runtime.h): the root's forward opening and closing the FORWARD phase, and
// a unit's forward beginning (gather, forward prefetch) and ending. Separate from the operator
// touches that drive it in between (runtime_touches.cpp) and from backward (runtime_backward.cpp).
#include "engine/runtime.h"

#include <c10/util/ScopeExit.h>

#include <string>

#include <torch/csrc/autograd/graph_task.h>

namespace fsdp {

void Runtime::begin_forward() {
  check_not_failed();
  TORCH_CHECK(!summoned_, "fsdp: forward inside summon_full_params: the parameters are whole for inspection there; "
                          "end the summon_full_params scope before calling forward");
  // A backward that is not running on this thread (none is: we are outside autograd) yet left the
  // phase at BACKWARD ended without its callback, and BackwardEnd did not see it go: finish it.
  if (phase_ == Phase::BACKWARD && torch::autograd::get_current_graph_task_id() == -1) abort_backward();
  if (drain_pending_) drain_ready_queue();
  TORCH_CHECK(phase_ != Phase::BACKWARD && phase_ != Phase::FORWARD,
              "fsdp: the root's forward was called inside its own forward or backward; "
              "call it once per micro-batch, outside backward");
  // Forwards whose graphs are all gone will never be backwarded: their iteration is over.
  end_abandoned_forward();
  if (phase_ == Phase::IDLE) {
    check_parameters_intact();
    install_missing_hooks();
    order_.start_iteration();
    touch::arm(this, options_.unit_detection == UnitDetection::RECORD_FUNCTION);
  }
  phase_ = Phase::FORWARD;
  owns_forward_phase_ = open_phase(fsdp::StepPhase::FORWARD);
  pending_before_forward_ = backward_pending_;
  comm_.set_backward_pass(false);
  touch::enter_forward();
  outer_forward_nodes_ = touch::set_forward_nodes(&forward_nodes_);
}

void Runtime::forward_begins(size_t u) {
  order_.forward_started(u);
  gather(u);
  if (options_.forward_prefetch) {
    // Issued before this unit's all-gather is waited for: both are in flight while it arrives.
    for (size_t v : order_.next_in_forward(u, options_.prefetch_count, [](size_t) { return false; })) gather(v);
  }
  use(u);
  units_[u]->pre_forward();
}

void Runtime::forward_ends(size_t u) {
  units_[u]->post_forward();
  order_.forward_ended(u);
}

void Runtime::end_forward(bool ok) {
  touch::leave_forward();
  touch::set_forward_nodes(outer_forward_nodes_);
  const auto closes = c10::make_scope_exit([this] { close_owned_phase(owns_forward_phase_, fsdp::StepPhase::FORWARD); });
  // Its last operator has run; every unit deferred is freed below with the rest (or stays for
  // backward, as any unit of a strategy that does not reshard after forward).
  operator_units_.clear();
  deferred_reshards_.clear();
  operator_delivered_ = false;
  if (!ok) {
    // A forward that threw merges nothing: its writes are dropped with the gathered copies.
    for (auto& s : write_snapshots_) s = at::Tensor();
    operator_wrote_ = merge_due_ = false;
  }
  check_not_failed();
  if (current_unit_ && units_[*current_unit_]->state() == Unit::State::FORWARD) forward_ends(*current_unit_);
  current_unit_.reset();
  // Units still open: the root, and units containing others (not ended by a sibling starting).
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u]->state() == Unit::State::FORWARD) forward_ends(u);
  }
  // Writes to units that stay gathered (the root, NRAF, F = 1) are merged now, in unit order.
  merge_pending_writes();
  for (size_t u = 0; u < units_.size(); ++u) {
    // Also frees forward prefetches that were not used (the guess from the last iteration was off).
    if (!ok || (reshard_after_forward_[u] && u != root_unit_)) reshard(u, /*after_forward=*/ok);
  }
  // Units left gathered for backward: whatever touches them before it must ask first.
  {
    touch::Suppress own_work;
    for (size_t u = 0; u < units_.size(); ++u) {
      if (!pinned(u)) units_[u]->handle().guard_gathered();
    }
  }
  // A forward that threw leaves no graph to wait for, but an earlier forward of this iteration may.
  if (!ok) backward_pending_ = pending_before_forward_;
  if (backward_pending_) {
    phase_ = Phase::FORWARD_DONE;
  } else {
    end_iteration();  // inference, or a forward without grad: nothing will come back
  }
  if (!refuse_at_end_.empty()) {  // refused inside the RecordFunction callback (on_touch)
    const std::string refusal = std::move(refuse_at_end_);
    refuse_at_end_.clear();
    throw Refusal(refusal);
  }
}

}  // namespace fsdp
