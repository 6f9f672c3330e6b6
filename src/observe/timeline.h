// Records the spans of include/fsdp/trace.h for the current step. The compute thread opens and
// closes spans; collectives complete on the backend's threads, which only stamp end times, so a
// mutex guards the list. The runtime clears it at reset_step().
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "fsdp/trace.h"

namespace fsdp {

// Below communication in the layering (docs/design.md): it knows a collective only as the c10d
// Work whose completion it stamps.
class Timeline {
 public:
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;
  // `workers_per_group`: how many collectives a process group runs at once (Gloo: its thread
  // count); used to estimate when a queued collective started.
  explicit Timeline(int workers_per_group = 1);
  void set_workers_per_group(int workers) { workers_ = workers < 1 ? 1 : workers; }

  static int64_t now_ns();

  size_t begin(SpanKind kind, int unit, bool backward_pass);
  // `operator_calls`: compute spans, how many operator calls entered fsdp for the unit meanwhile.
  void end(size_t span, int64_t operator_calls = 0);
  // A span already over (e.g. a wait measured by its caller).
  void add(SpanKind kind, int unit, bool backward_pass, int64_t begin_ns, int64_t end_ns,
           SpanKind waited_for = SpanKind::WAIT);
  // A span already over, as given (a phase of the step: kind PHASE with its `phase`).
  void add(Span span);
  // Records the issue of a collective on process group `group` (any stable id): `proto` gives its
  // kind, unit, pass, bytes and dtype. Its end is stamped by the backend's completion callback
  // when `stamp_completion`, else by completed().
  size_t collective(Span proto, const void* group, const WorkPtr& work, bool stamp_completion);
  // The compute thread saw the collective finish (after waiting for it).
  void completed(size_t span);

  std::vector<Span> spans() const;  // with start times estimated
  void clear();

 private:
  struct State {
    std::mutex mutex;
    std::vector<Span> spans;
    std::vector<const void*> groups;  // per span: the process group of a collective
    int64_t generation = 0;           // bumped by clear(): late callbacks of old steps are dropped
    int64_t seq = 0;
  };
  static constexpr size_t kMaxSpans = 1 << 18;
  std::shared_ptr<State> state_;
  int workers_;
};

}  // namespace fsdp
