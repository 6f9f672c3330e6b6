// The one place that knows how a device frees and regrows storage in place: CPU, and CUDA in
// builds against a CUDA libtorch; and what its allocator reports.
#pragma once

#include <cstddef>

#include <ATen/ATen.h>

#include "fsdp/metrics.h"

namespace fsdp {

// Resizes `t`'s StorageImpl to `bytes` in place (0 frees it). Views sharing the storage stay
// valid; growing does not preserve contents (callers refill it).
void resize_storage(const at::Tensor& t, size_t bytes);

// The caching allocator's statistics for `device` (all zero for CPU). num_alloc_retries is the
// allocator's running total; the peaks are since the last reset_device_peaks().
DeviceMemoryStats device_memory_stats(const c10::Device& device);
// The same figures as they stand now (the *_peak fields hold the current values).
DeviceMemoryStats device_memory_now(const c10::Device& device);
void reset_device_peaks(const c10::Device& device);

// CUDA, with a positive `bytes`: the caching allocator refuses to hold more than `bytes` for this
// process on `device` (its per-process memory fraction). Nothing on CPU.
void enforce_device_budget(const c10::Device& device, int64_t bytes);

}  // namespace fsdp
