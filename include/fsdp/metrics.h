// What fsdp counts, per rank and per step (issue: instrumentation). Read it with
// FullyShardedDataParallel::metrics(); a step is what lies between two reset_step() calls.
#pragma once

#include <cstdint>

namespace fsdp {

// Bytes a collective moves per rank in the bandwidth-optimal ring convention, where S is the
// unsharded buffer's bytes and G the group's size: all-gather and reduce-scatter (G-1)/G·S,
// all-reduce 2(G-1)/G·S. These are the paper's analytic volumes, not what a backend's particular
// algorithm puts on the wire (Gloo, for one, emulates reduce-scatter with an all-reduce).
struct CommBytes {
  int64_t all_gather = 0;
  int64_t reduce_scatter = 0;
  int64_t all_reduce = 0;
  int64_t all_gather_calls = 0;
  int64_t reduce_scatter_calls = 0;
  int64_t all_reduce_calls = 0;
  int64_t total() const { return all_gather + reduce_scatter + all_reduce; }
};

struct MemoryBytes {
  int64_t sharded_params = 0;          // this rank's FlatParameter shards (always resident)
  int64_t sharded_grads = 0;           // this rank's sharded gradients, now
  int64_t unsharded_current = 0;       // unsharded FlatParameter buffers allocated now
  int64_t unsharded_peak = 0;          // their peak since the last reset_step()
  int64_t unsharded_grads_current = 0; // unsharded gradients held now (no_sync accumulation)
  int64_t unsharded_grads_peak = 0;
};

struct Metrics {
  int64_t step = 0;  // number of reset_step() calls so far
  CommBytes comm;    // since the last reset_step()
  MemoryBytes memory;
};

}  // namespace fsdp
