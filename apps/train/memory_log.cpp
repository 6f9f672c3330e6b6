#include "memory_log.h"

#include <chrono>
#include <fstream>
#include <stdexcept>

namespace train {

nlohmann::json to_json(const fsdp::ProcessMemory& m) {
  nlohmann::json j = {{"live_tensor_bytes", m.live_tensor_bytes},
                      {"anon_resident_bytes", m.anon_resident_bytes},
                      {"resident_bytes", m.resident_bytes}};
  if (m.cuda_reserved > 0) {
    j["cuda_allocated"] = m.cuda_allocated;
    j["cuda_active"] = m.cuda_active;
    j["cuda_reserved"] = m.cuda_reserved;
  }
  return j;
}

void MemoryTimeline::start() {
  if (running_.exchange(true)) return;
  samples_.clear();
  thread_ = std::thread([this] {
    const auto t0 = std::chrono::steady_clock::now();
    while (running_.load()) {
      const fsdp::ProcessMemory m = fsdp::process_memory(device_);
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      samples_.push_back({t, phase_.load(), m});
      std::this_thread::sleep_for(std::chrono::microseconds(period_us_));
    }
  });
}

void MemoryTimeline::stop() {
  if (!running_.exchange(false)) return;
  thread_.join();
}

void MemoryTimeline::write_csv(const std::string& path) const {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write the memory timeline to '" + path + "'");
  out << "t_ms,phase,live_tensor_bytes,anon_resident_bytes,cuda_allocated,cuda_reserved\n";
  for (const Sample& s : samples_) {
    out << s.t_ms << ',' << s.phase << ',' << s.m.live_tensor_bytes << ',' << s.m.anon_resident_bytes << ','
        << s.m.cuda_allocated << ',' << s.m.cuda_reserved << '\n';
  }
}

}  // namespace train
