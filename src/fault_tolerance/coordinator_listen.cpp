// Where the coordinator listens (fsdp/fault_tolerance.h, run_coordinator): the store on one
// interface or every one, and its options from the environment.
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "fault_tolerance/coordinator.h"
#include "fault_tolerance/value_signing.h"

namespace fsdp {

CoordinatorOptions CoordinatorOptions::from_environment() {
  CoordinatorOptions o;
  o.secret = detail::live_secret_from_environment();
  o.dead_after = detail::seconds_from_environment("FSDP_LIVE_DEAD_AFTER_S", o.dead_after);
  o.ready_timeout = detail::seconds_from_environment("FSDP_LIVE_READY_TIMEOUT_S", o.ready_timeout);
  return o;
}

int run_coordinator(const CoordinatorOptions& options, const std::function<void(int)>& on_listening) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(options.port);
  if (!options.bind_address.empty()) {
    // The store binds every interface by itself; a socket bound here, listening, is handed to it.
    in_addr address{};
    if (::inet_pton(AF_INET, options.bind_address.c_str(), &address) != 1) {
      throw std::invalid_argument("fsdp-coordinator: cannot bind '" + options.bind_address +
                                  "': give an IPv4 address of this host (127.0.0.1 for this machine's ranks only)");
    }
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in at{};
    at.sin_family = AF_INET;
    at.sin_port = htons(static_cast<uint16_t>(options.port));
    at.sin_addr = address;
    socklen_t len = sizeof(at);
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof(at)) != 0 || ::listen(fd, 128) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&at), &len) != 0) {
      const std::string why = std::strerror(errno);
      if (fd >= 0) ::close(fd);
      throw std::runtime_error("fsdp-coordinator: cannot listen on " + options.bind_address + ":" +
                               std::to_string(options.port) + " (" + why + ")");
    }
    so.port = ntohs(at.sin_port);
    so.masterListenFd = fd;
  }
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = std::chrono::seconds(60);
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>("0.0.0.0", so);
  } catch (const std::exception& e) {
    throw std::runtime_error("fsdp-coordinator: cannot listen on port " + std::to_string(options.port) +
                             " (is it in use?): " + std::string(e.what()).substr(0, std::string(e.what()).find('\n')));
  }
  if (on_listening) on_listening(store->getPort());
  detail::Coordinator coordinator(options, store);
  return coordinator.run();
}

}  // namespace fsdp
