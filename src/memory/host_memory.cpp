#include "memory/host_memory.h"

#include <sys/mman.h>

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace fsdp {
namespace {

// Every allocation carries a header, so that freeing needs no lookup and the raw deleter works
// from the data pointer alone (the allocator stays a "simple" one: data == context).
constexpr size_t kHeader = 64;  // keeps libtorch's 64-byte alignment of the data
struct Header {
  size_t bytes;   // what the tensor asked for (counted as live)
  size_t mapped;  // the cached block's mapped size; 0: from libtorch's allocator
};

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_live_peak{0};  // over the whole process: bounds the block cache
std::atomic<bool> g_counting{false};
constexpr int kSlots = 16;
std::atomic<bool> g_slot_used[kSlots];
std::atomic<int64_t> g_slot_peak[kSlots];

void raise(std::atomic<int64_t>& peak, int64_t live) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (live > seen && !peak.compare_exchange_weak(seen, live, std::memory_order_relaxed)) {
  }
}

void note_peak(int64_t live) {
  raise(g_live_peak, live);
  for (int i = 0; i < kSlots; ++i) {
    if (g_slot_used[i].load(std::memory_order_relaxed)) raise(g_slot_peak[i], live);
  }
}

// Large blocks (tensors of 1 MiB and more) are mapped directly and, when freed, kept for the next
// tensor of the same rounded size. Why: glibc serves them from its heap once its dynamic mmap
// threshold has risen (to 32 MiB after the first large free), and freed heap blocks fragment and
// stay resident: on the medium GPT at W = 4, anonymous resident memory grew to 2.5-3x the live
// tensor bytes (docs/performance.md). Mapping every block instead returns it on free but pays a
// page fault per page at every allocation (25-40% slower steps, measured). A training step asks
// for the same shapes every time, so a cache by exact rounded size reuses nearly every block:
// resident memory stays near the peak of live tensor bytes, without the faults. The cache holds
// at most as many bytes as the process's peak of live tensor bytes (beyond that, blocks are
// unmapped), and release_free_memory() empties it.
constexpr size_t kLargeBytes = size_t{1} << 20;
constexpr size_t kGranule = size_t{64} << 10;
constexpr size_t kHugePage = size_t{2} << 20;

struct BlockCache {
  std::mutex mutex;
  std::unordered_map<size_t, std::vector<void*>> free_blocks;  // mapped size -> blocks
  int64_t cached_bytes = 0;
};
BlockCache& cache() {
  static auto* c = new BlockCache();  // never destroyed: tensors may be freed during exit
  return *c;
}

void* map_block(size_t mapped) {
  {
    BlockCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.free_blocks.find(mapped);
    if (it != c.free_blocks.end() && !it->second.empty()) {
      void* base = it->second.back();
      it->second.pop_back();
      c.cached_bytes -= static_cast<int64_t>(mapped);
      return base;
    }
  }
  void* base = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  // Fewer page faults on first touch where the kernel allows transparent huge pages on request.
  if (mapped >= kHugePage) ::madvise(base, mapped, MADV_HUGEPAGE);
  return base;
}

void unmap_block(void* base, size_t mapped) {
  {
    BlockCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    if (c.cached_bytes + static_cast<int64_t>(mapped) <= g_live_peak.load(std::memory_order_relaxed)) {
      c.free_blocks[mapped].push_back(base);
      c.cached_bytes += static_cast<int64_t>(mapped);
      return;
    }
  }
  ::munmap(base, mapped);
}

void counted_delete(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  const Header h = *reinterpret_cast<Header*>(base);
  g_live.fetch_sub(static_cast<int64_t>(h.bytes), std::memory_order_relaxed);
  c10::profiledCPUMemoryReporter().Delete(data);
  if (h.mapped > 0) {
    unmap_block(base, h.mapped);
  } else {
    c10::free_cpu(base);
  }
}

struct CountingCPUAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* data = nullptr;
    if (n > 0) {
      char* base = nullptr;
      Header h{n, 0};
      if (n >= kLargeBytes) {
        h.mapped = (n + kHeader + kGranule - 1) / kGranule * kGranule;
        base = static_cast<char*>(map_block(h.mapped));
        if (base == nullptr) h.mapped = 0;  // fall back to libtorch's allocator (and its error)
      }
      if (base == nullptr) base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
      *reinterpret_cast<Header*>(base) = h;
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
    g_counting.store(true);
  });
}

}  // namespace

int64_t live_tensor_bytes() { return g_live.load(std::memory_order_relaxed); }
bool counting_tensor_memory() { return g_counting.load(std::memory_order_relaxed); }

int64_t release_cached_blocks() {
  BlockCache& c = cache();
  std::unordered_map<size_t, std::vector<void*>> blocks;
  int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    blocks.swap(c.free_blocks);
    bytes = c.cached_bytes;
    c.cached_bytes = 0;
  }
  for (auto& [mapped, list] : blocks) {
    for (void* base : list) ::munmap(base, mapped);
  }
  return bytes;
}
void install_host_allocator() { install_once(); }

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
