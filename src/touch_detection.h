// Knowing when a unit runs (docs/design.md: "Knowing when a unit runs"). libtorch modules have no forward
// hooks and parents call children through typed members, so we watch operators instead: while a
// root is inside forward or backward, a RecordFunction callback looks at each operator's input
// tensors, and the first one whose storage is a unit's shard or unsharded buffer tells the
// runtime that the unit is needed now (it unshards it before the operator reads anything).
//
// The callback is registered once per process and enabled only while some runtime is armed, so
// code outside forward/backward pays nothing and never triggers a collective.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>

namespace fsdp {

// Called by the callback with the unit index the runtime registered, the touching tensor, and
// whether the operator records an autograd node (grad mode on and some input requires grad): then
// backward may come back for the unit's tensors. On the forward thread only; false elsewhere.
struct TouchSink {
  virtual ~TouchSink() = default;
  virtual void on_touch(size_t unit, const c10::TensorImpl* tensor, bool builds_graph) = 0;
};

namespace touch {

void register_storage(TouchSink* sink, size_t unit, const c10::StorageImpl* storage);
void unregister_sink(TouchSink* sink);
// Arming enables the callback for the calling sink; operators run by this thread (forward) or by
// any thread executing an autograd graph task (backward) are then inspected.
void arm(TouchSink* sink);
void disarm(TouchSink* sink);

// Marks the calling thread as running a root's forward (until set back to false).
void set_forward_thread(bool on);
// Whether the calling thread is in a root's forward, in a backward (an autograd graph task), or in
// the runtime's own work.
bool in_root_pass();

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

// While alive, operators run by this thread are not inspected: the runtime's own work (collectives,
// copies into its buffers) must not be mistaken for the model touching a unit.
class Suppress {
 public:
  Suppress();
  ~Suppress();
  Suppress(const Suppress&) = delete;
  Suppress& operator=(const Suppress&) = delete;
 private:
  bool previous_;
};

}  // namespace touch
}  // namespace fsdp
