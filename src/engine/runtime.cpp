#include "engine/runtime.h"

#include <c10/util/ScopeExit.h>

#include "fsdp/tensor_parallel.h"

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

Runtime::Runtime(std::vector<Unit*> units, CommContext& comm, const Options& options, std::vector<bool> reshard_after_forward)
    : units_(std::move(units)),
      comm_(comm),
      options_(options),
      reshard_after_forward_(std::move(reshard_after_forward)),
      // On CUDA an all-gather stays in flight until the device has freed its buffer.
      limiter_(options.limit_all_gathers, /*device_frees=*/comm.streams().active()) {
  TORCH_CHECK(options_.prefetch_count >= 1, "fsdp: prefetch_count must be >= 1, got ", options_.prefetch_count);
  hooked_.resize(units_.size());
  write_snapshots_.resize(units_.size());
  guarded_grads_.resize(units_.size());
  {
    at::AutoGradMode on(true);
    drain_leaf_ = at::ones({1}).requires_grad_();
    drain_out_ = drain_leaf_ * 2;  // its node is numbered before any forward's
  }
  tp_split_.resize(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    // Which parameters are split for TP (checked at each forward touch) and which have partial
    // gradients (summed over TP before the data-parallel reduction).
    const auto& params = units_[u]->handle().params();
    std::vector<size_t> partial;
    for (size_t i = 0; i < params.size(); ++i) {
      if (tensor_parallel_partial_gradient(params[i])) partial.push_back(i);
      const auto placement = tensor_parallel_placement(params[i]);
      if (!placement || placement->tp->size() == 1) continue;
      tp_split_[u].resize(params.size(), false);
      tp_split_[u][i] = true;
    }
    if (!partial.empty() && options_.tensor_parallel) {
      units_[u]->reduction().set_tensor_parallel_sum(options_.tensor_parallel.get(), std::move(partial));
    }
    touch::register_storage(this, u, units_[u]->handle().shard_storage());
    if (units_[u]->handle().has_unsharded_buffer()) touch::register_storage(this, u, units_[u]->handle().unsharded_storage());
    if (units_[u]->is_root()) root_unit_ = u;
    memory_.sharded_params += units_[u]->handle().sharded_param_bytes();
    guard::register_storage(this, u, units_[u]->handle().shard_storage());
    if (units_[u]->handle().has_unsharded_buffer()) guard::register_storage(this, u, units_[u]->handle().unsharded_storage());
  }
}

Runtime::~Runtime() {
  touch::unregister_sink(this);
  guard::unregister_sink(this);
}

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

void Runtime::gather(size_t u) {
  FlatParamHandle& handle = units_[u]->handle();
  if (handle.state() != HandleState::SHARDED) return;
  touch::Suppress own_work;
  if (comm_.mesh().shard_size > 1) {
    const int64_t t0 = Timeline::now_ns();
    if (const int64_t blocked = limiter_.before_issue()) {
      comm_.timeline().add(SpanKind::RATE_LIMIT, static_cast<int>(u), comm_.backward_pass(), t0, t0 + blocked);
      overlap_.rate_limiter_wait_ns += blocked;
    }
  }
  if (WorkPtr work = handle.begin_unshard()) {
    limiter_.issued(u, std::move(work));
    overlap_.max_all_gathers_in_flight = std::max(overlap_.max_all_gathers_in_flight, limiter_.in_flight());
  }
  note_memory();
}

void Runtime::use(size_t u) {
  FlatParamHandle& handle = units_[u]->handle();
  if (handle.state() == HandleState::UNSHARDED) {  // the common case: one check per operator
    handle.unguard_gathered();
    return;
  }
  gather(u);
  if (handle.state() != HandleState::GATHERING) return;
  touch::Suppress own_work;
  overlap_.exposed_all_gather_ns += handle.finish_unshard();
  limiter_.consumed(u);
}

void Runtime::reshard(size_t u, bool after_forward) {
  FlatParamHandle& handle = units_[u]->handle();
  if (pinned(u)) return;  // an unshard() scope holds it gathered
  // A forward that wrote into the gathered copy (merged into the shards here) leaves no secondary
  // shard: this rank's copy is not the merged one; backward gathers the merged shards instead.
  const bool wrote = write_snapshots_[u].defined();
  if (wrote) merge_forward_writes(u);  // before its gathered copy goes
  if (handle.state() == HandleState::SHARDED) {
    if (handle.has_secondary() && !after_forward) {  // backward is past it, or will not come
      handle.reshard();
      note_memory();
    }
    return;
  }
  touch::Suppress own_work;
  if (handle.state() == HandleState::GATHERING) {
    // A prefetch nobody used: its buffer can only be freed once the collective is done with it.
    overlap_.exposed_all_gather_ns += handle.finish_unshard();
  }
  handle.reshard(after_forward && backward_pending_ && !wrote);
  if (comm_.mesh().shard_size > 1) limiter_.freed(u, comm_.streams().record_current());
  note_memory();
}

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

void Runtime::reset_step() {
  memory_.unsharded_peak = memory_.unsharded_current;
  memory_.unsharded_grads_peak = memory_.unsharded_grads_current;
  memory_.reducing_grads_peak = memory_.reducing_grads_current;
  overlap_ = OverlapStats{};
  detection_ = DetectionStats{};
  phases_.reset();
}

}  // namespace fsdp
