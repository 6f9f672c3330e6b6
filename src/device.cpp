#include "device.h"

#include <ATen/native/Resize.h>
#ifdef USE_C10D_NCCL  // a CUDA build of libtorch
#include <ATen/native/cuda/Resize.h>
#endif

namespace fsdp {

void resize_storage(const at::Tensor& t, size_t bytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == bytes) return;
  // Shrinking to 0 drops the allocation; growing from 0 allocates without copying anything.
  if (t.device().is_cpu()) {
    at::native::resize_bytes_cpu(storage, bytes);
    return;
  }
#ifdef USE_C10D_NCCL
  if (t.device().is_cuda()) {
    // The CUDA caching allocator reuses the freed block stream-ordered on the current stream; all
    // work on it is on that stream in this build (collectives are waited for on it).
    at::native::resize_bytes_cuda(storage, bytes);
    return;
  }
#endif
  TORCH_CHECK(false, "fsdp: tensors on ", t.device(), " are not supported (CPU, and CUDA in CUDA builds)");
}

}  // namespace fsdp
