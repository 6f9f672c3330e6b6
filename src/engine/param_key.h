// The dispatch key on parameters (docs/design.md, "Knowing when a unit runs"). Every tensor a unit
// points its parameters at — this rank's shard views, the unsharded views — carries one
// functionality key of fsdp's, and so does every view made of them (a view inherits its base's
// keys), the views autograd saves for backward included. An operator that has such a tensor among
// its arguments reaches fsdp's boxed fallback before autograd; an operator that touches no
// parameter never does, and runs at libtorch's own speed. The fallback hands the call
//   - inside a root's forward or backward, to touch detection (touch_detection.h): which unit is
//     needed now, gathered before the operator reads anything;
//   - outside them, to the guard (param_guard.h): what an operator on a shard or on a gathered
//     copy left for backward means there;
// then calls the operator below the key, with the key excluded on this thread for what it calls
// in turn (a composite such as linear, calling t() and addmm, has been seen whole at its top).
//
// The key is TESTING_ONLY_GenericWrapper: libtorch's functionality key reserved for out-of-tree
// wrapper tensors, which nothing else in a C++ process registers (deferred_init.cpp owns its mode
// sibling). It sits above autograd. set_data() to a tensor without it drops it.
#pragma once

#include <ATen/ATen.h>

namespace fsdp::param_key {

// A tensor of `view`'s storage, sizes, strides and dtype that carries the key.
at::Tensor keyed(const at::Tensor& view);
bool has_key(const at::Tensor& t);

}  // namespace fsdp::param_key
