// Live tensor bytes (fsdp/process_memory.h) read for the memory scenarios of summon_full_params.cpp,
// lifecycle.cpp and activation_checkpoint.cpp. The count is process-wide: Gloo's worker threads let
// go of a finished collective's tensors (a shard's cast copy, a reduction's input, a loss's
// all-reduce) a moment after its wait returned, on their own time, so a reading is taken once it
// is near what the scenario expects or has settled.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>

#include "fsdp/process_memory.h"

namespace conformance::live {

// What a few finished collectives' tensors may still add or take: scenarios use models of tens of
// kilobytes, so that what they measure stands well out of it.
constexpr int64_t kNoise = 1024;

inline int64_t bytes() { return fsdp::process_memory().live_tensor_bytes; }

// Live bytes once within kNoise of `want`, or after half a second.
inline int64_t near(int64_t want) {
  int64_t now = bytes();
  for (int i = 0; i < 500 && std::abs(now - want) > kNoise; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    now = bytes();
  }
  return now;
}

// Live bytes once unchanged for 5 ms (at most half a second).
inline int64_t settled() {
  int64_t now = bytes();
  for (int i = 0; i < 100; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const int64_t later = bytes();
    if (later == now) break;
    now = later;
  }
  return now;
}

inline std::string str(int64_t b) { return std::to_string(b) + " bytes"; }

}  // namespace conformance::live
