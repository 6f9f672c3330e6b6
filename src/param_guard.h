// Guarding parameters outside the root's forward and backward. A parameter that holds something
// other than its whole self — this rank's 1-D shard at rest, or a gathered copy left from a forward
// whose backward has not come — carries a dispatch key of this library's, so that any operator on
// it run outside the root's forward and backward reaches the runtime first (operators that touch
// no such parameter never pay for it). The runtime then
//   - ends an iteration whose forwards will never be backwarded (their graphs are gone), so that an
//     optimizer step after a forward without backward steps the shards, not gathered copies;
//   - refuses to let anything write a gathered copy that a pending backward still needs;
//   - says what happened, and what to call instead, when the model's own forward is called
//     directly on 1-D shards (model->forward(x) instead of the wrapper's forward).
// Reading a parameter at rest (printing it, saving it, the optimizer's updates) passes through and
// sees this rank's shard.
//
// The key is TESTING_ONLY_GenericWrapper: libtorch's functionality key reserved for out-of-tree
// wrapper tensors, which nothing else in a C++ process registers (deferred_init.cpp owns its mode
// sibling). Views of a guarded tensor inherit the key; set_data() to an unguarded tensor drops it.
#pragma once

#include <cstddef>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace fsdp::guard {

struct Sink {
  virtual ~Sink() = default;
  // An operator outside the root's forward and backward reads (or, `writes`, writes) `tensor`, a
  // parameter of unit `unit` (or a shallow copy of one: libtorch optimizers update p.data()). May
  // throw, which the operator's caller receives.
  virtual void on_guarded_op(const c10::OperatorHandle& op, size_t unit, const at::Tensor& tensor, bool writes) = 0;
};

// A tensor of `view`'s storage, sizes, strides and dtype that carries the guard key.
at::Tensor guarded(const at::Tensor& view);

// Guarded tensors are recognised by their storage: a unit's shard or its unsharded buffer.
void register_storage(Sink* sink, size_t unit, const c10::StorageImpl* storage);
void unregister_sink(Sink* sink);

// Operators that consume a parameter's shape as a module's forward does (linear, matmul,
// convolutions, embeddings, normalizations): meaningless on a 1-D shard.
bool consumes_module_shape(const c10::OperatorName& name);

}  // namespace fsdp::guard
