#include "host_memory.h"

#include <algorithm>
#include <atomic>

#include <c10/core/Allocator.h>

namespace fsdp {

struct HostMemoryPeak::Reporter : c10::MemoryReportingInfoBase {
  void reportMemoryUsage(void*, int64_t alloc_size, size_t, size_t, c10::Device device) override {
    if (device.type() != c10::DeviceType::CPU) return;
    // Our own running total: the allocator's counts everything tracked while any reporter is on.
    const int64_t now = current.fetch_add(alloc_size) + alloc_size;
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
  }
  bool memoryProfilingEnabled() const override { return true; }
  std::atomic<int64_t> current{0}, peak{0};
};

HostMemoryPeak::HostMemoryPeak() : reporter_(std::make_shared<Reporter>()) {
  guard_ = std::make_unique<c10::DebugInfoGuard>(c10::DebugInfoKind::PROFILER_STATE, reporter_);
}

HostMemoryPeak::~HostMemoryPeak() = default;

int64_t HostMemoryPeak::peak_bytes() const { return reporter_->peak.load(); }
int64_t HostMemoryPeak::current_bytes() const { return reporter_->current.load(); }

}  // namespace fsdp
