// fsdp's CPU tensor allocator and what it counts: once installed (install_host_allocator, or the
// first HostMemoryPeak), every CPU tensor allocation goes through it, on every thread (the compute
// thread, autograd's, Gloo's, a background writer's): small ones to libtorch's default allocator,
// large ones to a cache of mapped blocks (host_memory.cpp says why). It counts tensors only (not
// the program's other heap), which is what sharding and deferred initialization promise to bound.
//
// Tensors allocated before measuring was switched on are not counted, so measure from the start
// of the region of interest (construction, a training step).
#pragma once

#include <cstdint>

#include "fsdp/process_memory.h"  // install_host_allocator(), HostMemoryPeak

namespace fsdp {

// Bytes of CPU tensor storage allocated since measuring was switched on and not freed yet
// (0 before).
int64_t live_tensor_bytes();
bool counting_tensor_memory();
// Unmaps the large blocks kept for reuse (host_memory.cpp says why they are kept); their bytes.
int64_t release_cached_blocks();

// HostMemoryPeak is declared in fsdp/process_memory.h.

}  // namespace fsdp
