// The inside of a Mesh (include/fsdp/mesh.h): the store and the process groups. The library builds
// shard and replicate groups here for the sharding factor F of each wrapped model
// (mesh_info.h turns them into what a unit needs), and compares fingerprints across ranks.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include <c10/core/DeviceType.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/collective_log.h"
#include "comm/collectives.h"
#include "comm/replica_order.h"
#include "comm/ring_reduce_scatter.h"
#include "fsdp/mesh.h"
#include "comm/network_interface.h"

namespace fsdp {

// Gloo process groups run up to this many collectives at once, each on its own thread: an
// all-gather for the next unit need not queue behind this unit's reduce-scatter.
inline constexpr int kGlooThreadsPerGroup = 2;

namespace detail {

struct ShardGroups {
  GroupPtr shard;      // F consecutive ranks: all-gather and reduce-scatter
  GroupPtr replicate;  // the W/F ranks with the same place in their shard group: all-reduce
};

struct MeshState {
  LaunchEnv env;
  MeshOptions options;
  c10::intrusive_ptr<c10d::Store> store;
  GroupPtr world;
  GroupPtr nccl_world;
  GlooInterface gloo_interface;  // chosen once, when the mesh is made
  bool simulated = false;        // Mesh::simulated: every group is a SimulatedBackend
  // The GPU of this process (LOCAL_RANK's): a sub-mesh's env numbers its ranks in the sub-mesh, not
  // on the host, so it keeps its parent's.
  int device_rank = -1;
  // The processes on this host (its share of the host's memory): a sub-mesh's env counts only its
  // own ranks per host, its parent's process count is the host's. 0: env.local_world_size.
  int host_processes = 0;
  int processes_per_host() const { return host_processes > 0 ? host_processes : env.local_world_size; }
  std::map<std::pair<int, int>, ShardGroups> groups;  // (F, device type) -> groups
  std::map<std::pair<int, int>, GroupPtr> secondary_groups;  // (N, device type) -> hpZ group
  std::map<const c10d::Backend*, std::shared_ptr<RingReduceScatter>> rings;  // one per Gloo group
  std::map<const c10d::Backend*, std::shared_ptr<ReplicaAllReduceOrder>> replica_orders;  // one per replicate group
  std::map<const c10d::Backend*, std::shared_ptr<CollectiveLog>> logs;  // one per CPU group made here
  int checks = 0;
  int models_wrapped = 0;  // MeshInfo::model of the next model wrapped over this mesh

  static MeshState& of(Mesh& mesh) { return *mesh.state_; }
  static const MeshState& of(const Mesh& mesh) { return *mesh.state_; }

  // The groups for sharding factor F (which must divide W: mesh_info.cpp validates it) and tensors
  // of `device`: Gloo for CPU, NCCL for CUDA (one GPU per rank, LOCAL_RANK's). Built on first use,
  // collectively: every rank must ask for the same F values in the same order.
  const ShardGroups& groups_for(int shard_size, c10::DeviceType device);
  // The group of `size` consecutive ranks this rank is in (hpZ), built on first use, collectively.
  const GroupPtr& consecutive_group(int size, c10::DeviceType device);
  // The ring reduce-scatter of a Gloo group (ring_reduce_scatter.h), one per group.
  std::shared_ptr<RingReduceScatter> ring_for(const GroupPtr& group);
  // The all-reduce order of a replicate group (replica_order.h), one per group, whichever model
  // asks: the group is shared by every model wrapped over this mesh.
  std::shared_ptr<ReplicaAllReduceOrder> replica_order_for(const GroupPtr& group);

  // A clear error on every rank unless all ranks pass the same `fingerprint`. `what` names the
  // thing being compared and `describe` is this rank's readable version of it, used to point at
  // the first difference.
  void check_same_on_all_ranks(const std::string& what, uint64_t fingerprint, const std::string& describe);

  // process_group.cpp: a group of `group_size` ranks named `name` (unique in the store), with its
  // log when it is a CPU group.
  GroupPtr make_group(const std::string& name, int group_rank, int group_size, c10::DeviceType device);
  // The same, meeting in `on` rather than this mesh's store (the live replica groups of
  // fault_tolerance/, which the coordinator's store names per epoch).
  GroupPtr make_group_on(const c10::intrusive_ptr<c10d::Store>& on, const std::string& name, int group_rank,
                         int group_size, c10::DeviceType device);
  // What this rank issued on `group` (null for a group not made here, or not a CPU group).
  std::shared_ptr<CollectiveLog> log_for(const GroupPtr& group) const;
  GroupPtr build_group(const c10::intrusive_ptr<c10d::Store>& on, const std::string& name, int group_rank,
                       int group_size, c10::DeviceType device);

  // A mesh of `size` ranks of this one (this rank is `rank` of them, `local_world_size` of them per
  // node), with a world group of its own and a store under its own prefix, so every group built on
  // it is apart from this mesh's: the data-parallel mesh of tensor parallelism (tensor_parallel/).
  // Collective over the ranks of the sub-mesh; `name` is the same on them and unique in this mesh.
  std::shared_ptr<Mesh> sub_mesh(const std::string& name, int rank, int size, int local_world_size);

  // A mesh of the ranks that meet in `store` (`env` numbers them; its MASTER_ADDR is where the
  // store is, for the choice of network), built without the launch checks of Mesh::create: a live
  // replica group's mesh (fault_tolerance/), whose store is the coordinator's. `host_processes`:
  // the processes on this host. Collective over env.world_size ranks.
  static std::shared_ptr<Mesh> over_store(c10::intrusive_ptr<c10d::Store> store, const LaunchEnv& env,
                                          MeshOptions options, int host_processes);
};

}  // namespace detail
}  // namespace fsdp
