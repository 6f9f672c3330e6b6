#include "fsdp/process_memory.h"

#include <malloc.h>

#include <fstream>
#include <string>

#include "memory/device.h"
#include "memory/host_memory.h"

namespace fsdp {
namespace {
// "RssAnon:   123456 kB" -> bytes.
void read_status(int64_t& anon, int64_t& rss) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    const bool is_anon = line.rfind("RssAnon:", 0) == 0, is_rss = line.rfind("VmRSS:", 0) == 0;
    if (!is_anon && !is_rss) continue;
    const int64_t kb = std::stoll(line.substr(line.find(':') + 1));
    (is_anon ? anon : rss) = kb * 1024;
  }
}
}  // namespace

ProcessMemory process_memory(const c10::Device& device) {
  ProcessMemory m;
  if (counting_tensor_memory()) m.live_tensor_bytes = live_tensor_bytes();
  read_status(m.anon_resident_bytes, m.resident_bytes);
  const DeviceMemoryStats d = device_memory_now(device);
  m.cuda_allocated = d.allocated_peak;
  m.cuda_active = d.active_peak;
  m.cuda_reserved = d.reserved_peak;
  return m;
}

int64_t release_free_memory() {
  int64_t before = 0, after = 0, rss = 0;
  read_status(before, rss);
  release_cached_blocks();
  ::malloc_trim(0);
  read_status(after, rss);
  return before - after;
}

}  // namespace fsdp
