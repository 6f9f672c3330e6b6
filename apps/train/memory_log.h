// fsdp-train's memory record (issue 10), measured by the system and libtorch's allocators rather
// than by fsdp's counters: what the process holds after each phase of every step (in the JSONL),
// and, for one step, a time series sampled by a thread (--memory-timeline), the paper's Fig. 8.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/process_memory.h"

namespace train {

nlohmann::json to_json(const fsdp::ProcessMemory& m);

// Samples the process every `period_us` on its own thread between start() and stop(), labelling
// each sample with the phase the training loop last marked.
class MemoryTimeline {
 public:
  explicit MemoryTimeline(c10::Device device, int period_us = 1000) : device_(device), period_us_(period_us) {}
  ~MemoryTimeline() { stop(); }
  MemoryTimeline(const MemoryTimeline&) = delete;
  MemoryTimeline& operator=(const MemoryTimeline&) = delete;

  void start();
  void mark(const char* phase) { phase_.store(phase); }  // a string literal
  void stop();
  // CSV: t_ms,phase,live_tensor_bytes,anon_resident_bytes,cuda_allocated,cuda_reserved
  void write_csv(const std::string& path) const;

 private:
  struct Sample {
    double t_ms;
    const char* phase;
    fsdp::ProcessMemory m;
  };
  c10::Device device_;
  int period_us_;
  std::atomic<const char*> phase_{"idle"};
  std::atomic<bool> running_{false};
  std::thread thread_;
  std::vector<Sample> samples_;  // written by the thread until stop() joins it
};

}  // namespace train
