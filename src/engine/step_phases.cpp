#include "engine/step_phases.h"

namespace fsdp {

const char* to_string(StepPhase phase) {
  switch (phase) {
    case StepPhase::FORWARD: return "forward";
    case StepPhase::BACKWARD: return "backward";
    case StepPhase::CLIP: return "clip";
    case StepPhase::OPTIMIZER: return "optimizer";
  }
  return "?";
}

bool StepPhaseClock::open(StepPhase phase, const OverlapStats& now) {
  if (open_) return false;
  open_ = Open{phase, Timeline::now_ns(), now};
  return true;
}

void StepPhaseClock::close(StepPhase phase, const OverlapStats& now) {
  if (!open_ || open_->phase != phase) return;
  const int64_t end_ns = Timeline::now_ns();
  PhaseTime& t = totals_[phase];
  t.wall_ns += end_ns - open_->begin_ns;
  t.exposed_all_gather_ns += now.exposed_all_gather_ns - open_->at_begin.exposed_all_gather_ns;
  t.exposed_reduce_ns += now.exposed_reduce_ns - open_->at_begin.exposed_reduce_ns;
  t.rate_limiter_wait_ns += now.rate_limiter_wait_ns - open_->at_begin.rate_limiter_wait_ns;
  ++t.count;
  Span s;
  s.kind = SpanKind::PHASE;
  s.phase = static_cast<int>(phase);
  s.backward_pass = phase == StepPhase::BACKWARD;
  s.begin_ns = open_->begin_ns;
  s.end_ns = end_ns;
  timeline_.add(s);
  open_.reset();
}

void StepPhaseClock::reset() {
  totals_ = StepPhases{};
  // A phase open across reset_step() counts in the new step from the reset on: what ran before
  // belongs to the step that ended (the counters and the timeline start again too).
  if (open_) {
    open_->begin_ns = Timeline::now_ns();
    open_->at_begin = OverlapStats{};
  }
}

}  // namespace fsdp
