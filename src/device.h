// The one place that knows how a device frees and regrows storage in place: CPU, and CUDA in
// builds against a CUDA libtorch (streams and events land with the overlap work).
#pragma once

#include <cstddef>

#include <ATen/ATen.h>

namespace fsdp {

// Resizes `t`'s StorageImpl to `bytes` in place (0 frees it). Views sharing the storage stay
// valid; growing does not preserve contents (callers refill it).
void resize_storage(const at::Tensor& t, size_t bytes);

}  // namespace fsdp
