#include "memory/device.h"

#include <ATen/native/Resize.h>
#ifdef USE_C10D_NCCL  // a CUDA build of libtorch
#include <ATen/native/cuda/Resize.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
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

namespace {
DeviceMemoryStats read_device_stats(const c10::Device& device, bool current) {
  DeviceMemoryStats out;
#ifdef USE_C10D_NCCL
  if (device.is_cuda()) {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    const auto stats = alloc::getDeviceStats(device.index());
    constexpr size_t all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    auto pick = [&](const c10::CachingAllocator::Stat& s) { return current ? s.current : s.peak; };
    out.allocated_peak = pick(stats.allocated_bytes[all]);
    out.active_peak = pick(stats.active_bytes[all]);
    out.reserved_peak = pick(stats.reserved_bytes[all]);
    out.num_alloc_retries = stats.num_alloc_retries;
  }
#else
  (void)device;
  (void)current;
#endif
  return out;
}
}  // namespace

DeviceMemoryStats device_memory_stats(const c10::Device& device) { return read_device_stats(device, false); }
DeviceMemoryStats device_memory_now(const c10::Device& device) { return read_device_stats(device, true); }

void reset_device_peaks(const c10::Device& device) {
#ifdef USE_C10D_NCCL
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
}

void enforce_device_budget(const c10::Device& device, int64_t bytes) {
#ifdef USE_C10D_NCCL
  if (device.is_cuda() && bytes > 0) {
    size_t free_bytes = 0, total_bytes = 0;
    c10::cuda::CUDAGuard guard(device.index());
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const double fraction = std::min(1.0, static_cast<double>(bytes) / static_cast<double>(total_bytes));
    c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, device.index());
  }
#else
  (void)device;
  (void)bytes;
#endif
}

}  // namespace fsdp
