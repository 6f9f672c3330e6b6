#include "comm/rate_limiter.h"

#include "observe/timeline.h"

namespace fsdp {

RateLimiter::RateLimiter(int limit, bool device_frees) : limit_(limit), device_frees_(device_frees) {
  TORCH_CHECK(limit >= 0, "fsdp: limit_all_gathers must be >= 0 (0 switches the rate limiter off), got ", limit);
}

void RateLimiter::retire() {
  for (auto it = entries_.begin(); it != entries_.end();) {
    const bool done = device_frees_ ? (it->free_event && it->free_event->query()) : it->consumed;
    it = done ? entries_.erase(it) : std::next(it);
  }
}

RateLimiter::Entry* RateLimiter::latest(size_t unit) {
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
    if (it->unit == unit) return &*it;
  }
  return nullptr;
}

int64_t RateLimiter::before_issue() {
  retire();
  if (limit_ == 0 || static_cast<int>(entries_.size()) < limit_) return 0;
  const int64_t t0 = Timeline::now_ns();
  while (static_cast<int>(entries_.size()) >= limit_) {
    auto oldest = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (device_frees_ ? it->free_event.has_value() : !it->consumed) {
        oldest = it;
        break;
      }
    }
    if (oldest == entries_.end()) break;  // everything in flight is in use by work not issued yet
    if (device_frees_) {
      oldest->free_event->synchronize();
    } else {
      wait_for(oldest->work, "all-gather of parameters (held by the rate limiter)", compare_when_slow(oldest->log));
    }
    entries_.erase(oldest);
  }
  return Timeline::now_ns() - t0;
}

void RateLimiter::issued(size_t unit, WorkPtr work, CollectiveLog* log) {
  entries_.push_back(Entry{unit, std::move(work), log, false, std::nullopt});
}

void RateLimiter::consumed(size_t unit) {
  if (Entry* e = latest(unit)) e->consumed = true;
  if (!device_frees_) retire();
}

void RateLimiter::freed(size_t unit, std::optional<c10::Event> event) {
  Entry* e = latest(unit);
  if (!e) return;
  e->consumed = true;
  if (device_frees_ && event) {
    e->free_event.emplace(std::move(*event));
  }
  retire();
}

}  // namespace fsdp
