// Peak CPU tensor memory of a region of code, from libtorch's own CPU allocator: while a
// HostMemoryPeak is alive, the allocator reports every allocation on this thread with the running
// total of what it has handed out (and not taken back) since, and the peak of that total is kept.
// It measures tensors only (not the heap of the program), which is what deferred initialization
// promises to bound. Allocations made on other threads are not seen.
#pragma once

#include <cstdint>
#include <memory>

#include <c10/util/ThreadLocalDebugInfo.h>

namespace fsdp {

class HostMemoryPeak {
 public:
  HostMemoryPeak();
  ~HostMemoryPeak();
  HostMemoryPeak(const HostMemoryPeak&) = delete;
  HostMemoryPeak& operator=(const HostMemoryPeak&) = delete;

  int64_t peak_bytes() const;     // the most held at once since construction
  int64_t current_bytes() const;  // held now (allocated since construction, not freed)

 private:
  struct Reporter;
  std::shared_ptr<Reporter> reporter_;
  std::unique_ptr<c10::DebugInfoGuard> guard_;
};

}  // namespace fsdp
