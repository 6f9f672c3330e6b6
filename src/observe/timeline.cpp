#include "observe/timeline.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <queue>


namespace fsdp {

std::string to_string(SpanKind kind) {
  switch (kind) {
    case SpanKind::FORWARD: return "forward";
    case SpanKind::BACKWARD: return "backward";
    case SpanKind::ALL_GATHER: return "all-gather";
    case SpanKind::REDUCE_SCATTER: return "reduce-scatter";
    case SpanKind::ALL_REDUCE: return "all-reduce";
    case SpanKind::WAIT: return "wait";
    case SpanKind::RATE_LIMIT: return "rate-limit";
    case SpanKind::SEQUENCE_CHECK: return "sequence-check";
    case SpanKind::PHASE: return "phase";
  }
  return "?";
}

Timeline::Timeline(int workers_per_group) : state_(std::make_shared<State>()), workers_(std::max(1, workers_per_group)) {}

int64_t Timeline::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

size_t Timeline::begin(SpanKind kind, int unit, bool backward_pass) {
  Span s;
  s.kind = kind;
  s.unit = unit;
  s.backward_pass = backward_pass;
  s.begin_ns = s.start_ns = now_ns();
  std::lock_guard<std::mutex> lock(state_->mutex);
  s.seq = ++state_->seq;
  // Without reset_step() calls the list would grow forever; past the cap, spans are dropped (an
  // index past the end is ignored by every other method).
  if (state_->spans.size() >= kMaxSpans) return kMaxSpans + 1;
  state_->spans.push_back(s);
  state_->groups.push_back(nullptr);
  return state_->spans.size() - 1;
}

void Timeline::end(size_t span, int64_t operator_calls) {
  const int64_t t = now_ns();
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (span >= state_->spans.size()) return;
  state_->spans[span].end_ns = t;
  state_->spans[span].operator_calls = operator_calls;
  state_->spans[span].end_seq = ++state_->seq;
}

void Timeline::add(Span s) {
  s.start_ns = s.begin_ns;
  std::lock_guard<std::mutex> lock(state_->mutex);
  s.seq = ++state_->seq;
  s.end_seq = ++state_->seq;
  if (state_->spans.size() >= kMaxSpans) return;
  state_->spans.push_back(s);
  state_->groups.push_back(nullptr);
}

void Timeline::add(SpanKind kind, int unit, bool backward_pass, int64_t begin_ns, int64_t end_ns, SpanKind waited_for) {
  Span s;
  s.kind = kind;
  s.unit = unit;
  s.backward_pass = backward_pass;
  s.begin_ns = begin_ns;
  s.end_ns = end_ns;
  s.waited_for = waited_for;
  add(s);
}

size_t Timeline::collective(Span proto, const void* group, const WorkPtr& work, bool stamp_completion) {
  const size_t index = begin(proto.kind, proto.unit, proto.backward_pass);
  int64_t generation;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (index >= state_->spans.size()) return index;
    state_->spans[index].bytes = proto.bytes;
    state_->spans[index].dtype = std::move(proto.dtype);
    state_->groups[index] = group;
    generation = state_->generation;
  }
  if (stamp_completion && work) {
    std::weak_ptr<State> weak = state_;
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      future = work->getFuture();
    } catch (const c10::Error&) {
      return index;  // some Gloo works have no future (its reduce-scatter): the wait stamps those
    }
    future->addCallback([weak, index, generation](c10::ivalue::Future&) {
      const int64_t t = now_ns();
      auto st = weak.lock();
      if (!st) return;
      std::lock_guard<std::mutex> lock(st->mutex);
      if (st->generation == generation && index < st->spans.size() && st->spans[index].end_ns == 0) {
        st->spans[index].end_ns = t;
      }
    });
  }
  return index;
}

void Timeline::completed(size_t span) {
  const int64_t t = now_ns();
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (span < state_->spans.size() && state_->spans[span].end_ns == 0) state_->spans[span].end_ns = t;
}

std::vector<Span> Timeline::spans() const {
  std::vector<Span> out;
  std::vector<const void*> groups;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    out = state_->spans;
    groups = state_->groups;
  }
  // A process group hands queued collectives, in issue order, to its first free worker. Replaying
  // that queue with the observed issue and end times gives each collective's start and worker.
  std::map<const void*, std::vector<int64_t>> free_at;  // per group: when each worker frees up
  for (size_t i = 0; i < out.size(); ++i) {
    Span& s = out[i];
    if (!s.is_collective()) continue;
    auto& workers = free_at[groups[i]];
    if (workers.empty()) workers.assign(static_cast<size_t>(workers_), 0);
    const auto slot = std::min_element(workers.begin(), workers.end());
    s.start_ns = std::max(s.begin_ns, *slot);
    if (s.end_ns != 0) s.start_ns = std::min(s.start_ns, s.end_ns);
    s.track = static_cast<int>(slot - workers.begin());
    *slot = s.end_ns != 0 ? s.end_ns : s.start_ns;
  }
  return out;
}

void Timeline::clear() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->spans.clear();
  state_->groups.clear();
  ++state_->generation;
}

}  // namespace fsdp
