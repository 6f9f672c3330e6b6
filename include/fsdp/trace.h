// One rank's timeline of a step: when each unit computed and what each collective did. It is what
// makes overlap visible (paper Fig. 6/7): read it with FullyShardedDataParallel::timeline(), or
// write it as a Chrome trace with write_trace() and open it in Perfetto or chrome://tracing.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp {

enum class SpanKind {
  FORWARD,         // a unit's forward computation (from its parameters being ready to its end)
  BACKWARD,        // a unit's gradient computation (from being needed in backward to its last gradient)
  ALL_GATHER,      // collectives: begin = issue, start = when the backend began it, end = completion
  REDUCE_SCATTER,
  ALL_REDUCE,
  WAIT,            // the compute thread blocked on a collective: exposed communication
  RATE_LIMIT,      // the compute thread blocked by the rate limiter
  SEQUENCE_CHECK,  // the end-of-backward all-reduce that compares the ranks' collective sequences
  PHASE,           // a phase of the step (Metrics::phases): `phase` says which
};
std::string to_string(SpanKind kind);

struct Span {
  SpanKind kind = SpanKind::FORWARD;
  int unit = -1;               // index into units(); -1 when not about one unit
  bool backward_pass = false;  // recorded while the root was in backward
  int64_t begin_ns = 0;        // steady clock
  int64_t start_ns = 0;        // collectives: estimated from the backend's queue (see docs/design.md)
  int64_t end_ns = 0;          // 0 while not finished
  int64_t seq = 0;             // order in which the compute thread began (or issued) spans
  int64_t end_seq = 0;         // order in which the compute thread ended them (0: not ended there)
  int64_t bytes = 0;           // collectives: ring-convention bytes
  int track = 0;               // collectives: which backend worker ran it (for the trace layout)
  SpanKind waited_for = SpanKind::WAIT;  // WAIT spans: the kind of collective waited for
  std::string dtype;           // collectives: the dtype of the buffers handed to the backend
  int64_t operator_calls = 0;  // FORWARD/BACKWARD: operator calls that entered fsdp for the unit (Metrics::detection)
  int phase = -1;              // PHASE spans: the fsdp::StepPhase (metrics.h), as an int
  bool is_collective() const {
    return kind == SpanKind::ALL_GATHER || kind == SpanKind::REDUCE_SCATTER || kind == SpanKind::ALL_REDUCE ||
           kind == SpanKind::SEQUENCE_CHECK;
  }
};

}  // namespace fsdp
