// Knowing when a unit runs (docs/design.md: "Knowing when a unit runs"). libtorch modules have no
// forward hooks and parents call children through typed members, so we watch operators instead:
// while a root is inside forward or backward, the first operator given a tensor whose storage is a
// unit's shard or unsharded buffer tells the runtime that the unit is needed now (it unshards it
// before the operator reads anything), and whether the operator builds a graph through it.
//
// Two ways to see those operators (Options::unit_detection):
//   DISPATCH_KEY (default): the units' views carry fsdp's dispatch key (param_key.h), so only
//     operators that touch a parameter, or a view of one, enter fsdp; the others cost nothing.
//   RECORD_FUNCTION: a RecordFunction callback with inputs, enabled while a root is armed, looks
//     at every operator's inputs: about 1 us an operator, whatever it touches. It also sees a
//     parameter's storage reached through a tensor not made from the parameter by a view (a
//     TensorImpl built on its Storage, set_() onto it), which carries no key.
// Code outside forward/backward never triggers a collective through either.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>

namespace fsdp {

// Called by the callback with the unit index the runtime registered, the touching tensor, whether
// the operator records an autograd node (grad mode on and some input requires grad: then backward
// may come back for the unit's tensors; on the forward thread only, false elsewhere) and whether it
// writes the tensor in place (its schema says so).
struct TouchSink {
  virtual ~TouchSink() = default;
  virtual void on_touch(size_t unit, const c10::TensorImpl* tensor, bool builds_graph, bool writes) = 0;
  // One operator call entered fsdp's detection for this sink (once per call, however many of its
  // tensors are the sink's), after its touches: what the detection costs, counted
  // (Metrics::detection). `unit`: the first of the sink's units it touched, if any.
  virtual void on_operator_entered(std::optional<size_t> unit) = 0;
};

namespace touch {

void register_storage(TouchSink* sink, size_t unit, const c10::StorageImpl* storage);
void unregister_sink(TouchSink* sink);
// Arming delivers touches to the sink: of operators run by a thread marked as the forward thread,
// or by any thread executing an autograd graph task (backward). `record_function`: through the
// RecordFunction callback (enabled while such a sink is armed), else through the key.
void arm(TouchSink* sink, bool record_function);
void disarm(TouchSink* sink);

// An operator with a keyed argument (param_key.h) inside a root's pass: its units' tensors are
// delivered to armed DISPATCH_KEY sinks.
void on_keyed_op(const c10::OperatorHandle& op, const torch::jit::Stack& stack);

// Marks the calling thread as running a root's forward: a depth, so that a wrapped model called
// inside another's forward (a teacher inside a student) leaves the outer forward marked when it
// returns. Every enter is matched by one leave.
void enter_forward();
void leave_forward();
// Whether the calling thread is in a root's forward, in a backward (an autograd graph task), or in
// the runtime's own work.
bool in_root_pass();
// Through the RecordFunction callback: whether the operator being delivered runs inside another
// operator (a composite's parts; the key's fallback never delivers those).
bool nested_operator();

// Activation checkpointing (fsdp/activation_checkpoint.h) on this thread, which the runtime must
// know about: a checkpointed forward runs without grad mode, yet backward will come back for the
// units it touches (so its operators count as building a graph, and the units expect their
// gradients); a recomputation in backward touches units the way their forward did.
class CheckpointScope {
 public:
  enum Kind { NONE, FORWARD, RECOMPUTE };
  // `keep_alive`: for FORWARD, where the nodes that accumulate the touched parameters' gradients
  // are kept for as long as the checkpoint can be backwarded (a graph would hold them).
  CheckpointScope(Kind kind, std::vector<std::shared_ptr<void>>* keep_alive = nullptr);
  ~CheckpointScope();
  CheckpointScope(const CheckpointScope&) = delete;
  CheckpointScope& operator=(const CheckpointScope&) = delete;
 private:
  Kind previous_kind_;
  std::vector<std::shared_ptr<void>>* previous_keep_;
};
// In a checkpointed forward that will be backwarded (grad mode was on at the call).
bool checkpointed_forward();
// Recomputing a checkpointed forward in backward.
bool recomputing();
// In a checkpointed forward: keeps `node` alive with the checkpoint.
void keep_alive_with_checkpoint(std::shared_ptr<void> node);

// While alive (around one operator call the key's fallback delivers), keeps what pin_for_operator
// is given alive. An AccumulateGrad node made for an operator before autograd records it (the
// expected gradient, unit.h) exists only weakly until the operator's node holds it; without the pin
// it would die at once and autograd would make another, which the unit does not know.
class OperatorPins {
 public:
  OperatorPins();
  ~OperatorPins();
  OperatorPins(const OperatorPins&) = delete;
  OperatorPins& operator=(const OperatorPins&) = delete;
 private:
  std::vector<std::shared_ptr<void>> pins_;
  std::vector<std::shared_ptr<void>>* previous_;
};
void pin_for_operator(std::shared_ptr<void> node);

// The graph nodes of a root's forward: every node an operator taking a unit's parameter (or a view
// of one) recorded while the forward ran, noted by the key's fallback once the operator returned.
// While one lives, a backward can still reach the units; once all are gone (the outputs and all
// built from them dropped), none can, whatever older graphs already backwarded still hold (a loss
// kept in scope holds the parameters' AccumulateGrad nodes). The runtime points this thread at its
// list for the forward (set_forward_nodes returns the list it replaces, restored at its end).
std::vector<std::weak_ptr<void>>* set_forward_nodes(std::vector<std::weak_ptr<void>>* nodes);
// After a keyed operator returned inside a root's forward: notes the grad_fn of each of its outputs.
void note_forward_outputs(const c10::OperatorHandle& op, const torch::jit::Stack& stack);

// While alive, operators run by this thread are not inspected: the runtime's own work (collectives,
// copies into its buffers) must not be mistaken for the model touching a unit. suppressed(): one is.
class Suppress {
 public:
  Suppress();
  ~Suppress();
  Suppress(const Suppress&) = delete;
  Suppress& operator=(const Suppress&) = delete;
 private:
  bool previous_;
};
bool suppressed();

}  // namespace touch
}  // namespace fsdp
