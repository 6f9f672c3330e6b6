// Rendezvous and process groups (DESIGN: c10d, launched the torchrun way). A Mesh is the world
// group plus, per sharding factor F, the shard groups of F consecutive ranks (one node's ranks
// when F = LOCAL_WORLD_SIZE) and the replicate groups of W/F ranks with the same shard rank.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace fsdp {

// Gloo process groups run up to this many collectives at once, each on its own thread: an
// all-gather for the next unit need not queue behind this unit's reduce-scatter.
inline constexpr int kGlooThreadsPerGroup = 2;

using GroupPtr = c10::intrusive_ptr<c10d::Backend>;

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
  std::chrono::milliseconds init_timeout{std::chrono::seconds(30)};
  // How long one collective may take before it fails instead of hanging.
  std::chrono::milliseconds collective_timeout{std::chrono::seconds(300)};
};

struct ShardingGroups {
  int shard_size = 1;          // F
  GroupPtr shard;              // F ranks: all-gather and reduce-scatter
  GroupPtr replicate;          // W/F ranks: all-reduce of gradient shards
};

class Mesh {
 public:
  // Connects to the TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 hosts it), checks that every rank
  // was launched with the same world size, and builds the world group (Gloo; CPU tensors).
  static std::shared_ptr<Mesh> create(const LaunchEnv& env, MeshOptions options = {});
  // A world of one process: no store, no sockets. Used by local training and by W = 1 runs.
  static std::shared_ptr<Mesh> single_process();

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  const LaunchEnv& env() const { return env_; }
  const GroupPtr& world() const { return world_; }

  // The shard and replicate groups for sharding factor F (built on first use, collectively: every
  // rank must ask for the same F values in the same order). Throws before any communication if F
  // does not divide the world size.
  const ShardingGroups& groups(int shard_size);
  // The same groups for tensors of `device`: Gloo for CPU tensors, NCCL for CUDA tensors (one GPU
  // per rank, LOCAL_RANK's). NCCL groups exist only in builds against a CUDA libtorch and run only
  // where a GPU is present; elsewhere this throws with that explanation.
  const ShardingGroups& groups(int shard_size, c10::DeviceType device);

  // A clear error on every rank unless all ranks pass the same `fingerprint` (e.g. a hash of the
  // model's parameter names, shapes and dtypes). `what` names the thing being compared and
  // `describe` is this rank's readable version of it, used to point at the first difference.
  void check_same_on_all_ranks(const std::string& what, uint64_t fingerprint, const std::string& describe);

 private:
  Mesh(LaunchEnv env, MeshOptions options) : env_(std::move(env)), options_(options) {}
  GroupPtr make_group(const std::string& name, int group_rank, int group_size,
                      c10::DeviceType device = c10::DeviceType::CPU);

  LaunchEnv env_;
  MeshOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;
  GroupPtr world_;
  std::map<std::pair<int, int>, ShardingGroups> groups_;  // (F, device type) -> groups
  GroupPtr nccl_world_;
  int checks_ = 0;
};

}  // namespace fsdp
