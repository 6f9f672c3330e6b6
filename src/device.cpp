#include "device.h"

#include <ATen/native/Resize.h>
#ifdef USE_C10D_NCCL  // a CUDA build of libtorch
#include <ATen/native/cuda/Resize.h>
#include <c10/cuda/CUDACachingAllocator.h>
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
    // The block comes from (and returns to) the current stream's pool: the all-gather stream's
    // when growing (comm_streams.h says why that is safe).
    at::native::resize_bytes_cuda(storage, bytes);
    return;
  }
#endif
  TORCH_CHECK(false, "fsdp: tensors on ", t.device(), " are not supported (CPU, and CUDA in CUDA builds)");
}

DeviceMemoryStats device_memory_stats(const c10::Device& device) {
  DeviceMemoryStats out;
#ifdef USE_C10D_NCCL
  if (device.is_cuda()) {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    const auto stats = alloc::getDeviceStats(device.index());
    constexpr size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out.allocated_peak = stats.allocated_bytes[all].peak;
    out.active_peak = stats.active_bytes[all].peak;
    out.reserved_peak = stats.reserved_bytes[all].peak;
    out.num_alloc_retries = stats.num_alloc_retries;
  }
#endif
  return out;
}

void reset_device_peaks(const c10::Device& device) {
#ifdef USE_C10D_NCCL
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
}

}  // namespace fsdp
