#include "host_memory.h"

#include <atomic>
#include <mutex>
#include <stdexcept>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace fsdp {
namespace {

// Every allocation carries its size in a header, so that freeing needs no lookup and the raw
// deleter works from the data pointer alone (the allocator stays a "simple" one: data == context).
constexpr size_t kHeader = 64;  // keeps libtorch's 64-byte alignment of the data

std::atomic<int64_t> g_live{0};
constexpr int kSlots = 16;
std::atomic<bool> g_slot_used[kSlots];
std::atomic<int64_t> g_slot_peak[kSlots];

void note_peak(int64_t live) {
  for (int i = 0; i < kSlots; ++i) {
    if (!g_slot_used[i].load(std::memory_order_relaxed)) continue;
    int64_t seen = g_slot_peak[i].load(std::memory_order_relaxed);
    while (live > seen && !g_slot_peak[i].compare_exchange_weak(seen, live, std::memory_order_relaxed)) {
    }
  }
}

void counted_delete(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  const auto bytes = *reinterpret_cast<size_t*>(base);
  g_live.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  c10::profiledCPUMemoryReporter().Delete(data);
  c10::free_cpu(base);
}

struct CountingCPUAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* data = nullptr;
    if (n > 0) {
      char* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
      *reinterpret_cast<size_t*>(base) = n;
      data = base + kHeader;
      c10::profiledCPUMemoryReporter().New(data, n);
      note_peak(g_live.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) + static_cast<int64_t>(n));
    }
    return {data, data, &counted_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

void install_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    static CountingCPUAllocator allocator;
    // Priority above the default allocator's (0), so libtorch's own registration cannot undo it.
    c10::SetCPUAllocator(&allocator, /*priority=*/1);
    if (c10::GetCPUAllocator() != &allocator) {
      throw std::runtime_error("fsdp: cannot measure CPU tensor memory: another CPU allocator with a higher "
                               "priority is installed in this process");
    }
  });
}

}  // namespace

int64_t live_tensor_bytes() { return g_live.load(std::memory_order_relaxed); }

HostMemoryPeak::HostMemoryPeak() : slot_(-1) {
  install_once();
  for (int i = 0; i < kSlots; ++i) {
    bool expected = false;
    if (g_slot_used[i].compare_exchange_strong(expected, true)) {
      slot_ = i;
      break;
    }
  }
  if (slot_ < 0) throw std::runtime_error("fsdp: more than 16 HostMemoryPeak regions at once");
  base_ = g_live.load();
  g_slot_peak[slot_].store(base_);
}

HostMemoryPeak::~HostMemoryPeak() { g_slot_used[slot_].store(false); }

int64_t HostMemoryPeak::peak_bytes() const { return g_slot_peak[slot_].load() - base_; }
int64_t HostMemoryPeak::current_bytes() const { return g_live.load() - base_; }

}  // namespace fsdp
