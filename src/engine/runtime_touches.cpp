// What the runtime does when an operator touches a unit's parameters (touch_detection.h tells it):
// failures recorded where libtorch would swallow them, the boundary between operators (deferred
// frees, pending write merges), and, per phase, which unit begins or ends its forward or is needed
// by backward. Separate from the phases' own entry and exit points (runtime_forward.cpp,
// runtime_backward.cpp), which this dispatches to.
#include "engine/runtime.h"

#include <algorithm>
#include <exception>

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/graph_task.h>

namespace fsdp {

void Runtime::on_touch(size_t u, const c10::TensorImpl* tensor, bool builds_graph, bool writes) {
  // libtorch swallows what a RecordFunction callback throws: record it and report it where it
  // reaches the caller (see the header).
  if (!failure_.empty()) {
    units_[u]->handle().poison();
    return;
  }
  try {
    touched(u, tensor, builds_graph, writes);
  } catch (const Refusal& r) {
    // A loop fsdp cannot make exact, refused by name: to the caller, through the key's fallback.
    // libtorch swallows what a RecordFunction callback throws: that route refuses at the end of
    // the forward instead.
    if (options_.unit_detection != UnitDetection::RECORD_FUNCTION) throw;
    if (refuse_at_end_.empty()) refuse_at_end_ = r.what();
  } catch (const std::exception& e) {
    fail(e.what(), u);
  } catch (...) {
    fail("unknown exception", u);
  }
}

bool Runtime::touched_by_operator(size_t u) const {
  return std::find(operator_units_.begin(), operator_units_.end(), u) != operator_units_.end();
}

void Runtime::operator_boundary() {
  // The operator whose touches were delivered last has run: what it kept gathered may go now.
  operator_delivered_ = false;
  operator_units_.clear();
  std::vector<size_t> due = std::move(deferred_reshards_);
  deferred_reshards_.clear();
  for (size_t v : due) {
    const Unit::State state = units_[v]->state();
    if (state == Unit::State::FORWARD || state == Unit::State::PRE_BACKWARD) continue;  // in use again
    reshard(v, /*after_forward=*/phase_ == Phase::FORWARD);
  }
}

void Runtime::on_operator_entered(std::optional<size_t> unit) {
  ++detection_.operator_calls_in_passes;
  // A top-level operator (not one a composite calls, which RECORD_FUNCTION also sees) is about to
  // run with every unit it touched gathered.
  if (!touch::nested_operator()) operator_delivered_ = true;
  if (unit) units_[*unit]->count_operator();
  // Its touches are delivered; the operator runs next. What it writes is merged before the next.
  if (operator_wrote_) {
    operator_wrote_ = false;
    merge_due_ = true;
  }
}

void Runtime::touched(size_t u, const c10::TensorImpl* tensor, bool builds_graph, bool writes) {
  // The last operator wrote a gathered unit, and has returned (not while its own parts run).
  if (merge_due_ && !touch::nested_operator()) merge_pending_writes();
  if (operator_delivered_ && !touch::nested_operator()) operator_boundary();
  if (!touched_by_operator(u)) operator_units_.push_back(u);
  switch (phase_) {
    case Phase::FORWARD: {
      if (u != root_unit_) {
        // The previous unit's forward is over once another unit (not nested in it) starts; it is
        // freed then, unless this operator reads it too (then after the operator).
        if (current_unit_ && *current_unit_ != u && !units_[*current_unit_]->contains(*units_[u]) &&
            units_[*current_unit_]->state() == Unit::State::FORWARD) {
          forward_ends(*current_unit_);
          if (reshard_after_forward_[*current_unit_]) {
            if (touched_by_operator(*current_unit_)) {
              deferred_reshards_.push_back(*current_unit_);
            } else {
              reshard(*current_unit_, /*after_forward=*/true);
            }
          }
        }
        if (current_unit_ != u && units_[u]->state() != Unit::State::FORWARD) forward_begins(u);
        current_unit_ = u;
      } else if (units_[u]->state() != Unit::State::FORWARD) {
        forward_begins(u);  // the root, at its first operator of each forward
      }
      use(u);
      if (!tp_split_[u].empty()) check_split_use(u, tensor);
      if (writes) note_forward_write(u);
      // Whether backward will come is autograd's to say: an operator that records a graph node
      // (grad mode on and an input requiring grad) may save this unit's tensors for backward.
      if (builds_graph) backward_pending_ = true;
      if (c10::GradMode::is_enabled()) {
        touch::pin_for_operator(units_[u]->expect_grad(tensor));
      } else if (touch::checkpointed_forward()) {
        forward_checkpointed_ = true;
        // Checkpointed (activation_checkpoint.h): no graph now, but the recomputation will build
        // one through this parameter. Expect its gradient as a graph would, and keep the node
        // that will accumulate it alive with the checkpoint, as a graph would.
        touch::keep_alive_with_checkpoint(units_[u]->expect_grad(tensor));
      }
      break;
    }
    case Phase::FORWARD_DONE:
    case Phase::BACKWARD:
      backward_needs(u);
      // A checkpointed forward recomputed: the graph it builds accumulates into this parameter.
      if (touch::recomputing() && c10::GradMode::is_enabled()) touch::pin_for_operator(units_[u]->expect_grad(tensor));
      break;
    case Phase::IDLE:
      // A retained graph backwarded again (the callback stays armed for it): a backward of its own.
      if (retained_ && torch::autograd::get_current_graph_task_id() != -1) backward_needs(u);
      break;
  }
}

}  // namespace fsdp
