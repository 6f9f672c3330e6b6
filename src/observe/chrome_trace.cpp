// Chrome trace event format ("X" complete events, microseconds): the JSON both chrome://tracing
// and Perfetto open. One process per rank; track 0 is the compute thread, collectives get one
// track per kind and backend worker so that concurrent collectives do not overlap on a track.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "fsdp/metrics.h"
#include "observe/chrome_trace.h"

namespace fsdp {
namespace {

int track_of(const Span& s) {
  switch (s.kind) {
    case SpanKind::ALL_GATHER: return 10 + s.track;
    case SpanKind::REDUCE_SCATTER: return 20 + s.track;
    case SpanKind::ALL_REDUCE: return 30 + s.track;
    case SpanKind::SEQUENCE_CHECK: return 40 + s.track;
    case SpanKind::PHASE: return 0;
    default: return 1;
  }
}

std::string track_name(int track) {
  if (track == 0) return "step phases";
  if (track == 1) return "compute";
  const char* kind = track < 20 ? "all-gather" : track < 30 ? "reduce-scatter" : track < 40 ? "all-reduce" : "sequence check";
  return std::string(kind) + " (worker " + std::to_string(track % 10) + ")";
}

}  // namespace

void write_chrome_trace(const std::string& path, const std::vector<Span>& spans,
                        const std::vector<std::string>& unit_names, int rank) {
  int64_t t0 = 0;
  for (const Span& s : spans) {
    if (t0 == 0 || s.begin_ns < t0) t0 = s.begin_ns;
  }
  auto us = [t0](int64_t ns) { return static_cast<double>(ns - t0) / 1000.0; };
  auto unit_name = [&](int u) {
    if (u < 0 || u >= static_cast<int>(unit_names.size())) return std::string("(whole model)");  // e.g. the norm
    return unit_names[static_cast<size_t>(u)].empty() ? std::string("<root>") : unit_names[static_cast<size_t>(u)];
  };

  nlohmann::json events = nlohmann::json::array();
  std::set<int> tracks;
  for (const Span& s : spans) {
    if (s.end_ns == 0) continue;  // never finished (an exception mid-step): nothing to draw
    const int track = track_of(s);
    tracks.insert(track);
    if (s.kind == SpanKind::PHASE) {  // the step's phases: forward, backward, clip, optimizer
      events.push_back({{"ph", "X"}, {"pid", rank}, {"tid", track}, {"cat", "phase"},
                        {"name", to_string(static_cast<StepPhase>(s.phase))}, {"ts", us(s.begin_ns)},
                        {"dur", us(s.end_ns) - us(s.begin_ns)}, {"args", {{"unit", "(the step)"}}}});
      continue;
    }
    nlohmann::json e = {{"ph", "X"}, {"pid", rank}, {"tid", track}, {"cat", to_string(s.kind)},
                        {"name", (s.kind == SpanKind::WAIT ? "wait " + to_string(s.waited_for) : to_string(s.kind)) +
                                     " " + unit_name(s.unit)}};
    nlohmann::json args = {{"unit", unit_name(s.unit)}, {"pass", s.backward_pass ? "backward" : "forward"}};
    if (s.is_collective()) {
      // The span is when the collective ran; when it was issued and how long it queued are args.
      e["ts"] = us(s.start_ns);
      e["dur"] = us(s.end_ns) - us(s.start_ns);
      args["issued_at_us"] = us(s.begin_ns);
      args["queued_us"] = us(s.start_ns) - us(s.begin_ns);
      args["bytes"] = s.bytes;
      args["dtype"] = s.dtype;
      events.push_back({{"ph", "i"}, {"s", "t"}, {"pid", rank}, {"tid", 1}, {"ts", us(s.begin_ns)},
                        {"name", "issue " + to_string(s.kind) + " " + unit_name(s.unit)}});
    } else {
      if (s.kind == SpanKind::FORWARD || s.kind == SpanKind::BACKWARD) args["operator_calls_into_fsdp"] = s.operator_calls;
      e["ts"] = us(s.begin_ns);
      e["dur"] = us(s.end_ns) - us(s.begin_ns);
    }
    e["args"] = std::move(args);
    events.push_back(std::move(e));
  }
  events.push_back({{"ph", "M"}, {"pid", rank}, {"name", "process_name"}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  for (int track : tracks) {
    events.push_back({{"ph", "M"}, {"pid", rank}, {"tid", track}, {"name", "thread_name"}, {"args", {{"name", track_name(track)}}}});
    events.push_back({{"ph", "M"}, {"pid", rank}, {"tid", track}, {"name", "thread_sort_index"}, {"args", {{"sort_index", track}}}});
  }
  const nlohmann::json doc = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};

  const std::filesystem::path dst(path);
  if (dst.has_parent_path()) std::filesystem::create_directories(dst.parent_path());
  const std::filesystem::path tmp = dst.string() + ".tmp";
  {
    std::ofstream f(tmp);
    f << doc.dump() << "\n";
    if (!f.flush()) throw std::runtime_error("fsdp: writing the trace " + tmp.string() + " failed");
  }
  std::filesystem::rename(tmp, dst);
}

}  // namespace fsdp
