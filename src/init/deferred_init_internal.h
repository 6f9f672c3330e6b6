// What the runtime needs of deferred initialization (include/fsdp/deferred_init.h) to materialize a
// deferred model unit by unit.
#pragma once

#include <ATen/ATen.h>

namespace fsdp {

// Fills `out` (a real tensor of t's shape and dtype) with the values t's recorded construction
// gives; a view of a bigger deferred tensor gets its part of the whole's values (the whole is
// replayed into a scratch tensor first). Throws for meta_init tensors.
void materialize_into(const at::Tensor& t, at::Tensor out);
// Materializes `t` in place, keeping its identity (the TensorImpl and its autograd state): after
// this it is an ordinary tensor holding `value`'s storage on value's device.
void adopt(at::Tensor& t, const at::Tensor& value);

}  // namespace fsdp
