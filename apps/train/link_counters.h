// The bytes and packets this host's network links carried, read from the kernel (/proc/net/dev of
// this process's network namespace): what really crossed a link, next to fsdp's own comm_bytes,
// which count what the collectives were asked to move. Loopback is left out: ranks of one host
// talk over it, and it is not a link between hosts.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

namespace train {

struct LinkCounters {
  struct Link {
    int64_t rx_bytes = 0, rx_packets = 0, tx_bytes = 0, tx_packets = 0;
  };
  std::map<std::string, Link> links;  // by interface name, loopback excluded

  static LinkCounters read();  // empty where /proc/net/dev cannot be read
  // What each link carried since `before`, as {"eth0": {"tx_bytes": ..., ...}}.
  nlohmann::json since(const LinkCounters& before) const;
};

}  // namespace train
