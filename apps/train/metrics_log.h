// fsdp-train's per-step output: one JSON object per step per rank (--metrics-jsonl) and the
// progress line rank 0 prints.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "fsdp/metrics.h"

namespace train {

// Creates --metrics-jsonl's folder if it is missing; throws std::invalid_argument naming why it cannot.
void make_metrics_folder(const std::string& path);

// One JSON line per write() on an O_APPEND descriptor: ranks can share the file, and a second run
// to the same file adds to it.
class JsonlWriter {
 public:
  explicit JsonlWriter(const std::string& path);  // "" writes nothing
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  void write(const nlohmann::json& j);

 private:
  int fd_ = -1;
};

struct StepRecord {
  int rank = 0, step = 0;
  double time = 0;  // when the step ended (seconds since the Unix epoch): progress over wall time
  double loss = 0, step_ms = 0, tokens_per_s = 0;
  double grad_norm = -1;  // the global norm before clipping (-1: --clip 0)
  double lr = 0;          // the learning rate this step stepped at (--lr-schedule)
  fsdp::Metrics metrics;
  nlohmann::json memory;  // what the process held after each phase (memory_log.h)
  nlohmann::json links;   // what this host's network links carried through the step (link_counters.h)
  int local_rank = 0, node_rank = 0;
};

nlohmann::json to_json(const StepRecord& r);
// "step    3 | loss 5.5362 | ... " (with the device columns when `cuda`, exposed comm when `sharded`;
// the throughput in `unit`s per second: "tok", "samples").
std::string progress_line(const StepRecord& r, bool sharded, bool cuda, const char* unit = "tok");

}  // namespace train
