#include "link_counters.h"

#include <fstream>
#include <sstream>

namespace train {

LinkCounters LinkCounters::read() {
  LinkCounters c;
  std::ifstream in("/proc/net/dev");
  std::string line;
  // Two header lines, then "  eth0: rx_bytes rx_packets errs drop fifo frame compressed multicast
  // tx_bytes tx_packets ...".
  for (int i = 0; i < 2 && std::getline(in, line); ++i) {
  }
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name == "lo") continue;
    std::istringstream fields(line.substr(colon + 1));
    int64_t v[10] = {0};
    for (auto& x : v) fields >> x;
    if (!fields) continue;
    c.links[name] = Link{v[0], v[1], v[8], v[9]};
  }
  return c;
}

nlohmann::json LinkCounters::since(const LinkCounters& before) const {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, now] : links) {
    auto it = before.links.find(name);
    if (it == before.links.end()) continue;
    const Link& b = it->second;
    out[name] = {{"rx_bytes", now.rx_bytes - b.rx_bytes},
                 {"rx_packets", now.rx_packets - b.rx_packets},
                 {"tx_bytes", now.tx_bytes - b.tx_bytes},
                 {"tx_packets", now.tx_packets - b.tx_packets}};
  }
  return out;
}

}  // namespace train
