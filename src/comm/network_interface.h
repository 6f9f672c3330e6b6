// Which network interface a rank's Gloo process groups bind to, chosen as PyTorch users expect:
//   GLOO_SOCKET_IFNAME=eth0[,eth1]  those interfaces (one Gloo device each, traffic striped)
//   MASTER_ADDR on loopback         127.0.0.1: every rank is on this machine
//   otherwise                       the address of the interface that routes to MASTER_ADDR
// Gloo's own default resolves the machine's hostname, which is 127.0.0.1 (or Debian's 127.0.1.1)
// on most hosts: each rank would then advertise a loopback address to ranks on other hosts, and
// the job would hang in its first collective. Asking the kernel which source address it would use
// to reach the store host gives the interface a real cluster means.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <gloo/transport/device.h>

#include "fsdp/mesh.h"

namespace fsdp::detail {

struct GlooInterface {
  // What the ranks bind to: interface names (from GLOO_SOCKET_IFNAME) or one address.
  std::vector<std::string> interfaces;
  std::string address;
  std::string reason;  // why this choice, for logs and errors

  std::vector<std::shared_ptr<::gloo::transport::Device>> make_devices() const;
  std::string describe() const;
};

// Throws std::invalid_argument naming the problem (an interface that does not exist, with the
// ones that do; a MASTER_ADDR no route leads to).
GlooInterface choose_gloo_interface(const LaunchEnv& env);

}  // namespace fsdp::detail
