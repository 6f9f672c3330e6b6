#include "comm/network_interface.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace fsdp::detail {
namespace {

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const std::string part = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!part.empty()) out.push_back(part);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// "lo (127.0.0.1), eth0 (198.18.0.1)": the interfaces with an IPv4 or IPv6 address, for errors.
std::string list_interfaces() {
  ifaddrs* head = nullptr;
  if (getifaddrs(&head) != 0) return "(getifaddrs failed)";
  std::string out;
  for (ifaddrs* a = head; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6)) continue;
    char host[NI_MAXHOST] = {0};
    const socklen_t len = a->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (getnameinfo(a->ifa_addr, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) continue;
    out += (out.empty() ? "" : ", ") + std::string(a->ifa_name) + " (" + host + ")";
  }
  freeifaddrs(head);
  return out.empty() ? "none" : out;
}

bool is_loopback_name(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}

// The local address the kernel would send from to reach addr:port. A UDP connect() sends nothing:
// it only looks the route up and binds the socket to the route's source address.
std::string source_address_towards(const std::string& addr, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0) {
    throw std::invalid_argument("fsdp: MASTER_ADDR='" + addr + "' does not resolve (" + gai_strerror(rc) +
                                "); set it to the address of the host that runs rank 0");
  }
  std::string error = "no address";
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      ::close(fd);
      char host[NI_MAXHOST] = {0};
      if (getnameinfo(reinterpret_cast<sockaddr*>(&local), len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) == 0) {
        freeaddrinfo(found);
        return host;
      }
    } else {
      error = std::strerror(errno);
      ::close(fd);
    }
  }
  freeaddrinfo(found);
  throw std::invalid_argument("fsdp: no route from this host to MASTER_ADDR=" + addr + " (" + error +
                              "). Interfaces here: " + list_interfaces() +
                              ". Set GLOO_SOCKET_IFNAME to the interface that reaches the other hosts.");
}

}  // namespace

GlooInterface choose_gloo_interface(const LaunchEnv& env) {
  GlooInterface g;
  const char* names = std::getenv("GLOO_SOCKET_IFNAME");
  if (names != nullptr && *names != '\0') {
    g.interfaces = split_commas(names);
    for (const auto& name : g.interfaces) {
      if (if_nametoindex(name.c_str()) == 0) {
        throw std::invalid_argument("fsdp: GLOO_SOCKET_IFNAME names '" + name +
                                    "', which is not an interface of this host. Interfaces here: " + list_interfaces());
      }
    }
    if (g.interfaces.empty()) throw std::invalid_argument("fsdp: GLOO_SOCKET_IFNAME='" + std::string(names) + "' names no interface");
    g.reason = "GLOO_SOCKET_IFNAME";
    return g;
  }
  if (env.world_size == 1 || env.master_addr.empty() || is_loopback_name(env.master_addr)) {
    g.address = "127.0.0.1";
    g.reason = "MASTER_ADDR is on loopback";
    return g;
  }
  g.address = source_address_towards(env.master_addr, env.master_port);
  g.reason = "the route to MASTER_ADDR=" + env.master_addr;
  return g;
}

std::vector<std::shared_ptr<::gloo::transport::Device>> GlooInterface::make_devices() const {
  std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
  if (!interfaces.empty()) {
    for (const auto& name : interfaces) devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
  } else {
    devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(address));
  }
  return devices;
}

std::string GlooInterface::describe() const {
  std::string what;
  if (!interfaces.empty()) {
    for (const auto& n : interfaces) what += (what.empty() ? "" : ",") + n;
    what = "interface " + what;
  } else {
    what = "address " + address;
  }
  return what + " (" + reason + ")";
}

}  // namespace fsdp::detail
