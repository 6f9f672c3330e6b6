// Guarding parameters outside the root's forward and backward. A parameter that holds something
// other than its whole self — this rank's 1-D shard at rest, or a gathered copy left from a forward
// whose backward has not come — is guarded: an operator on it run outside the root's forward and
// backward reaches the runtime first (operators that touch no parameter never pay for it). The
// runtime then
//   - ends an iteration whose forwards will never be backwarded (their graphs are gone), so that an
//     optimizer step after a forward without backward steps the shards, not gathered copies;
//   - refuses to let anything write a gathered copy that a pending backward still needs;
//   - says what happened, and what to call instead, when the model's own forward is called
//     directly on 1-D shards (model->forward(x) instead of the wrapper's forward).
// Reading a parameter at rest (printing it, saving it, the optimizer's updates) passes through and
// sees this rank's shard.
//
// Operators reach the guard through the parameter key's fallback (param_key.h) when they run
// outside a root's forward and backward; every unit's views carry the key, and the runtime says
// which of them are guarded now (a shard with F > 1, a gathered copy left for backward).
#pragma once

#include <cstddef>
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace fsdp::guard {

struct Sink {
  virtual ~Sink() = default;
  // An operator outside the root's forward and backward reads (or, `writes`, writes) `tensor`, a
  // parameter of unit `unit` (or a shallow copy of one: libtorch optimizers update p.data()). May
  // throw, which the operator's caller receives. Called for every unit's parameters; the sink
  // returns at once for a unit that is not guarded now (F = 1 at rest: its parameters are whole).
  // Returns what to tell the caller if the operator itself then fails (empty: ATen's error as is):
  // a read of a gathered copy is legal (a look at the weights), but an optimizer's read of it
  // beside the gradient's shard fails in ATen with a bare size mismatch.
  virtual std::string on_guarded_op(const c10::OperatorHandle& op, size_t unit, const at::Tensor& tensor, bool writes) = 0;
  // An operator outside the root's passes on a gradient registered with register_grad_storage
  // (unit `unit`'s unreduced no_sync gradients, or the stand-ins of gradients an unshard() scope
  // holds): reading it means stepping or clipping with what no step may use. May throw.
  virtual void on_unreduced_grad_op(const c10::OperatorHandle& op, size_t unit, bool writes) = 0;
};

// An operator with a keyed argument (param_key.h), outside the root's passes: tells the sink of
// every registered parameter and gradient among its arguments, in argument order. Returns the
// first sink's explanation for the operator's failure, should it fail (on_guarded_op).
std::string on_keyed_op(const c10::OperatorHandle& op, const torch::jit::Stack& stack);

// Guarded tensors are recognised by their storage: a unit's shard or its unsharded buffer.
void register_storage(Sink* sink, size_t unit, const c10::StorageImpl* storage);
void unregister_sink(Sink* sink);
// A keyed gradient (param_key::keyed) that holds unit `unit`'s unreduced no_sync sum, until
// unregistered (the synchronized reduction took it, or zero_grad dropped it).
void register_grad_storage(Sink* sink, size_t unit, const c10::StorageImpl* storage);
void unregister_grad_storage(const c10::StorageImpl* storage);

// Operators that consume a parameter's shape as a module's forward does (linear, matmul,
// convolutions, embeddings, normalizations): meaningless on a 1-D shard.
bool consumes_module_shape(const c10::OperatorName& name);

}  // namespace fsdp::guard
