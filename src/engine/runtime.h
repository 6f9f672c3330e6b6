// The iteration (paper §3.2.3, §3.3, §4.3): the state machine that decides, for the whole model,
// when each unit is gathered, freed and reduced. Per-unit state lives in Unit (unit.h); this file
// holds only what is about the iteration: the phase, the execution order, prefetch decisions,
// the rate limiter, the order of reductions and the end-of-backward callback.
//
//   IDLE ──forward──▶ FORWARD ──returns──▶ FORWARD_DONE ──first gradient──▶ BACKWARD ──end──▶ IDLE
//                        ▲                      │ (another forward: two forwards, one backward)
//                        └──────────────────────┘
//   IDLE ──a graph still alive is backwarded (again)──▶ BACKWARD
//
// What the iteration is follows autograd, not the C++ type of the forward's result: a forward
// expects a backward when one of its operators recorded an autograd node through a unit, and the
// forwards since the last backward are abandoned (the next forward starts afresh) once no graph
// references a parameter any more (their AccumulateGrad nodes are gone). A backward ends its
// iteration, but detection stays armed for as long as some graph through a unit lives: a second
// backward (another forward's loss, a second tower of the same forward, a retained graph) is a
// backward of its own, gathered and reduced like the first. Gradients are moved aside when
// backward reaches a unit, never at forward.
//
// Exceptions: a backward that throws (a user hook, an allocation) never reaches its end callback;
// the callback's owner notices when autograd drops it (BackwardEnd) and finishes that backward
// there, before the exception reaches the caller: what it accumulated is reduced as if it had
// ended (every rank threw at the same point: the same collectives), nothing stays gathered, and
// the next forward starts afresh. A forward that throws is ended by forward_with.
//
// FORWARD: the first operator touching a unit gathers it (waiting for its all-gather only then,
//   so a prefetched one has had time to arrive); with forward prefetch the units the previous
//   iteration ran next are issued right away. With reshard-after-forward the unit that ran
//   before is freed (the root unit stays gathered until after backward).
// BACKWARD: a unit needed again is gathered; with BACKWARD_PRE the next unit in reverse
//   post-forward order is issued as this one starts, with BACKWARD_POST as it ends. Once every
//   parameter of a unit that forward used has its gradient accumulated (post-accumulate-grad
//   hooks), its reduce-scatter is issued and the unit is freed, while backward goes on. The
//   end-of-backward callback (Engine::queue_callback) waits for the reductions, reduces what is
//   left, frees everything and hands the sharded gradients back to the parameters.
//
// Collectives are issued in an order that depends only on the model's execution (never on
// timing), so every rank issues the same sequence on each process group; at the end of every
// backward the ranks compare a hash of that sequence (one 16-byte all-reduce), so control flow that
// differs across ranks is an error before the optimizer can apply a wrong update.
//
// Failures: operator-touch detection runs inside an operator (the parameter key's fallback, or a
// RecordFunction callback, whose exceptions libtorch swallows). So a failure there (a collective that timed out, a peer that died) is
// recorded, the unit is completed harmlessly without communicating (NaN), and the error is thrown
// where it reaches the caller: at the end of the forward, from the next gradient hook or the
// end-of-backward callback (which backward() rethrows), and from every later call.
#pragma once

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/comm_context.h"
#include "engine/execution_order.h"
#include "fsdp/metrics.h"
#include "fsdp/options.h"
#include "engine/param_guard.h"
#include "engine/step_phases.h"
#include "comm/rate_limiter.h"
#include "engine/touch_detection.h"
#include "engine/unit.h"

namespace fsdp {

enum class Phase { IDLE, FORWARD, FORWARD_DONE, BACKWARD };

// A loop fsdp cannot make equal to local training, refused by name: thrown to the caller of the
// operator or call that reached it, and the wrapper stays usable (unlike a failure, which is final).
struct Refusal : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

class Runtime : public TouchSink, public guard::Sink, public std::enable_shared_from_this<Runtime> {
 public:
  // `units` outlive the runtime.
  // reshard_after_forward: per unit, whether its forward frees it to its shard (the strategy's rule
  // but for Options::keep_gathered_after_forward; the root never is).
  Runtime(std::vector<Unit*> units, CommContext& comm, const Options& options, std::vector<bool> reshard_after_forward);
  ~Runtime() override;
  void install_hooks();  // needs shared_from_this, so called right after construction

  void begin_forward();
  void end_forward(bool ok);
  void on_touch(size_t unit, const c10::TensorImpl* tensor, bool builds_graph, bool writes) override;
  void on_operator_entered(std::optional<size_t> unit) override;
  std::string on_guarded_op(const c10::OperatorHandle& op, size_t unit, const at::Tensor& tensor, bool writes) override;
  void on_unreduced_grad_op(const c10::OperatorHandle& op, size_t unit, bool writes) override;
  // unshard() scopes (fsdp.h): the units stay gathered while pinned, through forward and backward;
  // their sharded gradients are handed back when the last pin goes. A collective (pin gathers).
  void pin(const std::vector<size_t>& units);
  void unpin(const std::vector<size_t>& units);
  // Throws, naming `what`, while a unit holds unreduced no_sync gradients (clip, step).
  void check_no_unreduced_gradients(const char* what) const;
  // A backward this runtime took part in ended without its end callback (it threw): finish it.
  void abort_backward() noexcept;
  void set_no_sync(bool on) { no_sync_ = on; }
  void set_summoned(bool on) { summoned_ = on; }
  Phase phase() const { return phase_; }
  // Throws the recorded failure, if any (public API entry points call it first).
  void check_not_failed() const;
  // Outside forward and backward (IDLE, or FORWARD_DONE with every graph gone): for calls that
  // need the parameters at rest. Ends an abandoned iteration first.
  bool at_rest();
  // Whether an unshard() scope holds some unit gathered now.
  bool any_pinned() const {
    for (int n : pins_) {
      if (n > 0) return true;
    }
    return false;
  }

  const MemoryBytes& memory() const { return memory_; }
  const OverlapStats& overlap() const { return overlap_; }
  const DetectionStats& detection() const { return detection_; }
  void reset_step();  // peaks and overlap counters start again

  // The step's phases (fsdp/metrics.h): fsdp opens FORWARD, BACKWARD and CLIP itself, the loop
  // others (FullyShardedDataParallelBase::record_phase). open_phase is true when it opened.
  bool open_phase(StepPhase phase) { return phases_.open(phase, overlap_); }
  void close_phase(StepPhase phase) { phases_.close(phase, overlap_); }
  // Closes `phase` if the root's pass opened it (`owned`), and forgets that it did.
  void close_owned_phase(bool& owned, StepPhase phase) {
    if (owned) close_phase(phase);
    owned = false;
  }
  const StepPhases& phases() const { return phases_.totals(); }

 private:
  void touched(size_t unit, const c10::TensorImpl* tensor, bool builds_graph, bool writes);
  // Hooks on parameters that require grad, installed when first seen requiring it: parameters
  // frozen at wrapping and unfrozen later (progressive unfreezing) get theirs at the next forward.
  void install_missing_hooks();
  // torch::autograd::grad with respect to parameters: its result would be this rank's unreduced
  // gradient of a whole parameter, not the reduced shard fsdp stands for. Returns the refusal
  // ("" when the backward does not capture parameters); finish_backward throws it, once the
  // backward is over and the wrapper is at rest again.
  std::string grad_of_parameters() const;
  // A unit's keyed no_sync gradients, registered with the guard while they are unreduced.
  void register_unreduced_gradients(size_t unit);
  // Backward has reached `starting`: units whose backward passed without bringing gradients
  // (frozen) are freed now instead of at the end of backward.
  void release_passed_frozen(size_t starting);
  // A forward wrote a unit's gathered parameters in place (Embedding's max_norm): every rank's
  // writes are merged, into the gathered copies and the shards, before the next operator touches
  // a unit (it may read them: a tied head reads every row), or the unit is freed.
  void note_forward_write(size_t unit);
  void merge_forward_writes(size_t unit);
  void merge_pending_writes();
  // Tensor parallelism (runtime_tensor_parallel.cpp). An operator of the forward reached `tensor`,
  // a parameter of `unit`: one split for TP is refused outside a tensor-parallel layer.
  void check_split_use(size_t unit, const c10::TensorImpl* tensor);
  // After a synchronized backward: every replicated parameter's gradient agrees across the TP group,
  // or a Refusal names those that differ.
  void check_replicated_gradients();
  std::vector<std::vector<bool>> tp_split_;  // per unit, per parameter: split for TP (empty: none is)
  bool operator_wrote_ = false;  // the operator being delivered writes a unit's parameter
  bool merge_due_ = false;       // an operator that wrote has run: merge before the next touch
  // Units the operator being delivered touched (one operator may read two units: a decoder
  // block's linear with its own bias and an encoder block's shared weight). None of them may be
  // freed before that operator has run: a unit another one would free (FULL_SHARD's switch to the
  // next unit, a frozen unit backward passed) waits in deferred_reshards_ until the next operator.
  bool touched_by_operator(size_t unit) const;
  void operator_boundary();
  std::vector<size_t> operator_units_;
  std::vector<size_t> deferred_reshards_;
  bool operator_delivered_ = false;  // the last top-level operator's touches are all delivered
  void on_grad_arriving(size_t unit);
  void on_grad_accumulated(size_t unit, size_t param);
  void on_backward_started();
  void finish_backward();
  void end_iteration(bool keep_graph = false);
  // Whether a graph still references a parameter that needs a gradient: a backward can come.
  bool graph_alive() const;
  // `tensor` views unit h's gathered buffer while h is back on its shard: a shallow copy of a
  // parameter (p.data()) taken while it was gathered.
  static bool points_at_freed_gathered(const FlatParamHandle& h, const at::Tensor& tensor);
  // Operators that make a new tensor in a parameter's shape (an optimizer's state, at its first step).
  static bool makes_a_tensor_like(const std::string& op_name);
  // FORWARD_DONE with every graph through the units gone: the forwards were abandoned, their
  // iteration ends (IDLE).
  void end_abandoned_forward();
  void check_parameters_intact() const;
  // Backward reaches unit `u`: its parameters still point where fsdp put them (throws a Refusal
  // naming one a user replaced with set_data() since the forward).
  void check_unit_intact_for_backward(size_t u) const;
  void check_sequence();
  void fail(const std::string& what, size_t unit);
  // Issue unit's all-gather if it is sharded (through the rate limiter).
  void gather(size_t unit);
  // Make unit's parameters usable now: gather if needed and wait.
  void use(size_t unit);
  // Frees a unit's gathered parameters. `after_forward`: its forward is over and backward will
  // want it again: with hpZ it keeps a secondary shard for that (flat_param_handle.h).
  void reshard(size_t unit, bool after_forward = false);
  bool pinned(size_t unit) const { return !pins_.empty() && pins_[unit] > 0; }
  void forward_begins(size_t unit);
  void forward_ends(size_t unit);
  void backward_needs(size_t unit);
  void prefetch_backward(size_t unit);
  void reduce(size_t unit);
  void advance_reductions();
  void finish_reductions();
  void note_memory();

  std::vector<Unit*> units_;
  std::optional<size_t> root_unit_;
  CommContext& comm_;
  Options options_;
  std::vector<bool> reshard_after_forward_;  // per unit

  Phase phase_ = Phase::IDLE;
  bool no_sync_ = false;
  bool summoned_ = false;               // inside summon_full_params: no forward
  bool backward_pending_ = false;       // a forward of this iteration built a graph through a unit
  bool pending_before_forward_ = false;
  bool retained_ = false;               // a backward kept its graph and it lives: it may be backwarded again
  std::vector<std::weak_ptr<torch::autograd::Node>> retained_refs_;  // that graph's AccumulateGrad nodes
  // This iteration's forwards' nodes (touch::set_forward_nodes): whether a backward can still come.
  std::vector<std::weak_ptr<void>> forward_nodes_;
  std::vector<std::weak_ptr<void>>* outer_forward_nodes_ = nullptr;  // an outer root's, restored at the end
  bool forward_checkpointed_ = false;  // a checkpointed forward touched a unit: its nodes come in backward
  std::optional<size_t> current_unit_;  // the non-root unit that forward is in now
  std::vector<size_t> reduce_fifo_;     // units with a reduction in flight, in issue order
  ExecutionOrder order_;
  RateLimiter limiter_;

  std::vector<std::vector<bool>> hooked_;   // per unit, per parameter: its hooks are installed
  std::vector<int> pins_;                   // per unit: unshard() scopes holding it gathered
  std::vector<at::Tensor> write_snapshots_;  // per unit: its parameters before a forward wrote them
  std::vector<std::vector<const c10::StorageImpl*>> guarded_grads_;  // per unit: keyed no_sync grads
  // A backward that throws leaves the tasks it had queued in libtorch's thread-local ready queue,
  // holding their nodes (AccumulateGrad ones included: a graph would look alive) until the next
  // backward on the thread pops and drops them. drain_ready_queue() is that backward: through a
  // graph built at construction, whose node has a lower sequence number than any task a later
  // forward's graph queued, so that every stale task is popped before it completes.
  void drain_ready_queue();
  at::Tensor drain_leaf_, drain_out_;
  bool drain_pending_ = false;

  MemoryBytes memory_;
  OverlapStats overlap_;
  StepPhaseClock phases_{comm_.timeline()};
  bool owns_forward_phase_ = false, owns_backward_phase_ = false;  // opened by the root's passes
  DetectionStats detection_;
  std::string failure_;  // the first failure; everything throws it from then on
  std::string refuse_at_end_;  // a refusal the running pass's end throws (forward or backward)
};

}  // namespace fsdp
