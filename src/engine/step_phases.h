// The phases of a step (fsdp/metrics.h, StepPhase): when each began and ended, and how much of the
// exposed communication OverlapStats counts fell inside it. A small state machine: at most one
// phase is open; a phase opened while another is open is not counted (the loop's BACKWARD around
// loss.backward() contains the root's own). Each closed phase is also a PHASE span of the timeline.
#pragma once

#include <optional>

#include "fsdp/metrics.h"
#include "observe/timeline.h"

namespace fsdp {

class StepPhaseClock {
 public:
  explicit StepPhaseClock(Timeline& timeline) : timeline_(timeline) {}
  // Opens `phase` unless one is open; true when it opened (the caller closes it).
  bool open(StepPhase phase, const OverlapStats& now);
  // Closes the open phase if it is `phase`.
  void close(StepPhase phase, const OverlapStats& now);
  const StepPhases& totals() const { return totals_; }
  // reset_step(): totals start again; an open phase counts from now and the (reset) counters on.
  void reset();

 private:
  struct Open {
    StepPhase phase;
    int64_t begin_ns;
    OverlapStats at_begin;
  };
  Timeline& timeline_;
  std::optional<Open> open_;
  StepPhases totals_;
};

}  // namespace fsdp
