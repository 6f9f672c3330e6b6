// Live CPU tensor bytes of the whole process, from libtorch's own allocator: once measuring is
// switched on (the first HostMemoryPeak), every CPU tensor allocation goes through a counting
// allocator that wraps libtorch's default one, on every thread (the compute thread, autograd's,
// Gloo's, a background writer's). It counts tensors only (not the program's other heap), which
// is what sharding and deferred initialization promise to bound.
//
// Tensors allocated before measuring was switched on are not counted, so measure from the start
// of the region of interest (construction, a training step).
#pragma once

#include <cstdint>

namespace fsdp {

// Bytes of CPU tensor storage allocated since measuring was switched on and not freed yet
// (0 before).
int64_t live_tensor_bytes();

// The peak of live tensor bytes over a region of code, relative to its start. Nests; several may
// be alive at once on any threads.
class HostMemoryPeak {
 public:
  HostMemoryPeak();
  ~HostMemoryPeak();
  HostMemoryPeak(const HostMemoryPeak&) = delete;
  HostMemoryPeak& operator=(const HostMemoryPeak&) = delete;

  int64_t peak_bytes() const;     // the most held at once since construction, above the start
  int64_t current_bytes() const;  // held now, above the start (negative when more was freed)

 private:
  int slot_;
  int64_t base_;
};

}  // namespace fsdp
