#include "device.h"

#include <ATen/native/Resize.h>

namespace fsdp {

void resize_storage(const at::Tensor& t, size_t bytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == bytes) return;
  TORCH_CHECK(t.device().is_cpu(), "fsdp: only CPU tensors are supported by this build's device layer (got ",
              t.device(), ")");
  // Shrinking to 0 drops the allocation; growing from 0 allocates without copying anything.
  at::native::resize_bytes_cpu(storage, bytes);
}

}  // namespace fsdp
