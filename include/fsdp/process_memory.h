// What a process holds, as the system and libtorch's allocators measure it, not as fsdp's own
// counters claim it: the figures fsdp-train logs per phase of an iteration, the memory benchmark
// plots over one iteration (the paper's Fig. 8), and the memory tests hold the plan against.
//
//   fsdp::install_host_allocator();           // first thing in main: count every CPU tensor
//   ...
//   fsdp::ProcessMemory m = fsdp::process_memory(device);
#pragma once

#include <cstdint>

#include <c10/core/Device.h>

namespace fsdp {

struct ProcessMemory {
  // CPU tensor storage alive now, process-wide (every thread), counted by fsdp's CPU allocator
  // since install_host_allocator(); -1 before.
  int64_t live_tensor_bytes = -1;
  // Resident memory not backed by files (RssAnon of /proc/self/status): tensors, heap, stacks;
  // not the pages of libtorch's shared libraries, which every process maps.
  int64_t anon_resident_bytes = 0;
  int64_t resident_bytes = 0;  // all resident memory (VmRSS)
  // The CUDA caching allocator's current figures for `device` (zeros on CPU): bytes handed to
  // tensors, in blocks that hold tensors, and reserved from the driver.
  int64_t cuda_allocated = 0, cuda_active = 0, cuda_reserved = 0;
};

// Makes fsdp's allocator libtorch's CPU allocator for the rest of the process (idempotent): it
// counts live tensor bytes (process_memory, HostMemoryPeak) and keeps large freed blocks for reuse
// by the next tensor of the same size, so that freed memory neither fragments glibc's heap nor
// costs page faults again (src/host_memory.cpp says why). FullyShardedDataParallel installs
// it when it wraps a model; call it first thing to count everything (tensors allocated before
// are never counted).
void install_host_allocator();

// The peak of live CPU tensor bytes (process-wide) over a region of code, relative to its start;
// switches counting on. Nests; several may be alive at once, on any threads (at most 16).
class HostMemoryPeak {
 public:
  HostMemoryPeak();
  ~HostMemoryPeak();
  HostMemoryPeak(const HostMemoryPeak&) = delete;
  HostMemoryPeak& operator=(const HostMemoryPeak&) = delete;

  int64_t peak_bytes() const;     // the most held at once since construction, above the start
  int64_t current_bytes() const;  // held now, above the start (negative when more was freed)
  int64_t start_bytes() const { return base_; }  // live tensor bytes at the start

 private:
  int slot_;
  int64_t base_;
};

// Samples the process now (reads /proc/self/status; a few microseconds).
ProcessMemory process_memory(const c10::Device& device = c10::Device(c10::kCPU));

// Returns freed memory to the system: the allocator's cached blocks, and glibc's free heap pages
// (malloc_trim); what it gave back, in bytes of anonymous resident memory. FullyShardedDataParallel
// calls it once after sharding, where a model built whole is freed.
int64_t release_free_memory();

}  // namespace fsdp
