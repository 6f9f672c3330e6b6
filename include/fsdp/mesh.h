// Rendezvous and the world process group (docs/design.md: "Checks before anything can hang").
// A Mesh is what every rank of a job shares: created once per process from the torchrun
// environment, then handed to every FullyShardedDataParallel and ShardedGradScaler. The shard
// and replicate groups that a sharding factor F needs are built from it by the library.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace fsdp {

namespace detail {
struct MeshState;
}

// The torchrun environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT. from_environment() validates every variable and throws std::invalid_argument with
// the variable's name and how to set it.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  static LaunchEnv from_environment();
};

struct MeshOptions {
  // How long rendezvous waits for every rank to arrive before failing on every rank.
  // Default 30 s; environment: FSDP_INIT_TIMEOUT_S.
  std::chrono::milliseconds init_timeout{std::chrono::seconds(30)};
  // How long one collective may wait for its peers before it fails instead of hanging: what ends a
  // job whose peer hangs without exiting (a peer that exits is noticed at once). Default 300 s, for
  // slow first steps of big models; environment: FSDP_COLLECTIVE_TIMEOUT_S.
  std::chrono::milliseconds collective_timeout{std::chrono::seconds(300)};
  // When a collective on a CPU group has waited this long, its rank publishes (through the store)
  // the collectives it issued on the group and compares them with its peers': ranks that issued
  // different ones (a unit skipped on one rank, whose all-gather Gloo then paired with another
  // unit's of the same size) fail with the first collective where they differ, instead of waiting
  // out collective_timeout. It compares again after each further as long, until the wait ends. 0: never.
  // Default 10 s; environment: FSDP_COMPARE_COLLECTIVES_AFTER_S (0 turns it off).
  std::chrono::milliseconds compare_collectives_after{std::chrono::seconds(10)};
  // The defaults above with FSDP_INIT_TIMEOUT_S, FSDP_COLLECTIVE_TIMEOUT_S and
  // FSDP_COMPARE_COLLECTIVES_AFTER_S applied (seconds, may be fractional); throws
  // std::invalid_argument naming a variable that is not a positive number (or 0, for the last).
  static MeshOptions from_environment();
};

class Mesh {
 public:
  // Connects to the TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 hosts it), checks that every rank
  // was launched with the same world size, and builds the world group (Gloo; CPU tensors). Sets
  // Gloo binds to GLOO_SOCKET_IFNAME's interfaces if set, else to 127.0.0.1 when MASTER_ADDR is on
  // loopback, else to the address of the interface that routes to MASTER_ADDR (not the hostname's
  // address, which is loopback on most hosts). Sets
  // SIGPIPE to be ignored if it has its default action, so that a dead peer's closed socket makes
  // a collective fail with an error rather than kill this rank.
  static std::shared_ptr<Mesh> create(const LaunchEnv& env, MeshOptions options = MeshOptions::from_environment());
  // A world of one process: no store, no sockets. Used by local training and by W = 1 runs.
  static std::shared_ptr<Mesh> single_process();
  // Rank `rank` of a `world_size`-rank job (`local_world_size` ranks per node), alone in this
  // process: a pre-flight check of one rank's memory peaks and compute time for a job that needs
  // W devices, on one machine or one GPU. Every collective is a stand-in that writes outputs of
  // the right size and completes at once (src/simulated_backend.h); nothing is sent, so losses
  // are not trained results and communication time is not measured.
  static std::shared_ptr<Mesh> simulated(int world_size, int rank, int local_world_size);
  bool is_simulated() const;
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  int rank() const;
  int world_size() const;
  const LaunchEnv& env() const;
  // The group of all ranks (Gloo, CPU tensors), for the program's own collectives (e.g. averaging
  // the loss it logs).
  const c10::intrusive_ptr<c10d::Backend>& world() const;
  // Where this rank's Gloo groups communicate and why, e.g. "address 198.18.0.2 (the route to
  // MASTER_ADDR=198.18.0.1)": for the program's log.
  std::string network() const;

 private:
  explicit Mesh(std::unique_ptr<detail::MeshState> state);
  friend struct detail::MeshState;
  std::unique_ptr<detail::MeshState> state_;
};

}  // namespace fsdp
