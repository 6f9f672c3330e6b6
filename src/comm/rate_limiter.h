// The rate limiter (paper §3.4): at most `limit` all-gathers in flight. Without it, a CPU thread
// that runs ahead of the device issues all-gathers for many units, the caching allocator must
// hold all their buffers at once, and under memory pressure it falls into cudaFree/cudaMalloc
// retries that stall everything.
//
// When an all-gather leaves flight depends on the device:
//   CUDA  when the device has finished with its unsharded buffer: the unit was resharded and the
//         event recorded on the compute stream right after has completed (the allocator can then
//         really reuse the memory);
//   CPU   when the compute thread has waited for it (frees are immediate on CPU).
// Before issuing one more, the limiter blocks the calling thread on the oldest entry that can
// finish without this thread doing more work: a completed free event to wait for, or on CPU an
// issued collective. Entries whose buffer is still in use by computation this thread has not
// issued yet are never waited on (that would wait forever).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>

#include <c10/core/Event.h>

#include "comm/collective_log.h"
#include "comm/collectives.h"

namespace fsdp {

class RateLimiter {
 public:
  RateLimiter(int limit, bool device_frees);  // limit 0: off (still counts)

  // Before issuing an all-gather. Returns the nanoseconds the thread was blocked.
  int64_t before_issue();
  // `log`: the log of the group it went out on, which a long wait compares (collective_log.h).
  void issued(size_t unit, WorkPtr work, CollectiveLog* log = nullptr);
  void consumed(size_t unit);                   // the compute thread waited for unit's all-gather
  void freed(size_t unit, std::optional<c10::Event> event);  // unit resharded (event: device free)

  int64_t in_flight() const { return static_cast<int64_t>(entries_.size()); }

 private:
  struct Entry {
    size_t unit;
    WorkPtr work;
    CollectiveLog* log = nullptr;
    bool consumed = false;
    std::optional<c10::Event> free_event;
  };
  void retire();
  Entry* latest(size_t unit);

  int limit_;
  bool device_frees_;
  std::deque<Entry> entries_;
};

}  // namespace fsdp
