// The sharding factor F and everything that travels with it (paper §3.2): how many ranks share a
// unit's shards, this rank's place among them, and the process groups of its shard group and of
// its replicas. Computed once per wrapped model from the options and the mesh (the one place
// that validates F), then handed to every unit, like FSDP2's FSDPMeshInfo.
#pragma once

#include <c10/core/DeviceType.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/collective_log.h"
#include "comm/collectives.h"
#include "comm/replica_order.h"
#include "comm/ring_reduce_scatter.h"
#include "fsdp/mesh.h"
#include "fsdp/options.h"

namespace fsdp {

struct MeshInfo {
  int rank = 0;         // this rank in the world
  int world_size = 1;   // W: data-parallel ranks; gradients are averaged over them
  int shard_size = 1;   // F: ranks that share one unit's shards
  int shard_rank = 0;   // this rank's place in its shard group, 0 <= shard_rank < F
  int replicas = 1;     // W / F: shard groups holding copies of the same shards
  int model = 0;        // which model wrapped over this mesh, in wrap order (0, 1, ...): named in the collective logs
  GroupPtr shard_group;      // F ranks: all-gather and reduce-scatter
  GroupPtr replicate_group;  // W / F ranks: all-reduce of gradient shards
  GroupPtr world_group;      // all W ranks, CPU tensors: cross-rank checks
  // The shard group's ring reduce-scatter (Gloo with GlooReduceScatter::RING; null otherwise).
  std::shared_ptr<RingReduceScatter> shard_ring;
  // The order all-reduces go out on replicate_group (replica_order.h), shared by every wrapped model
  // of the mesh; null without replicas.
  std::shared_ptr<ReplicaAllReduceOrder> replica_order;
  // hpZ (Options::reshard_after_forward_to and its per-unit choices): for each N in use, the N
  // consecutive ranks (a subgroup of the shard group) over which backward gathers a unit from the
  // secondary shards forward left. This rank keeps part shard_rank % N of such a unit.
  std::map<int, GroupPtr> secondary_groups;
  // What this rank issued on each of the groups above that has a log (CPU groups; collective_log.h).
  std::map<const c10d::Backend*, std::shared_ptr<CollectiveLog>> logs;
  CollectiveLog* log_of(const GroupPtr& group) const {
    const auto it = logs.find(group.get());
    return it == logs.end() ? nullptr : it->second.get();
  }
};

// F for `options` on W ranks with `local_world_size` ranks per node: W for FULL_SHARD and
// SHARD_GRAD_OP, 1 for NO_SHARD, shard_size (default: ranks per node) for the hybrid strategies.
// Throws std::invalid_argument, naming the strategy, when F does not divide W.
int sharding_factor(const Options& options, int world_size, int local_world_size);

// FULL_SHARD and HYBRID_SHARD free parameters after forward; the ZeRO-2 strategies keep them.
bool reshards_after_forward(ShardingStrategy strategy);

// The hpZ group size `options` ask for unit `unit` (its module path; Options::
// reshard_after_forward_to_by_unit, else reshard_after_forward_to) with F-way sharding and
// `local_world_size` ranks per node: 0 (off) or N, 1 <= N < F, N | F. Throws
// std::invalid_argument naming what is wrong and what would work.
int secondary_shard_size(const Options& options, const std::string& unit, int F, int local_world_size);

// Whether unit `unit` is freed to its shard after its forward: the strategy's rule, but for the
// units Options::keep_gathered_after_forward names.
bool reshards_unit_after_forward(const Options& options, const std::string& unit);

// Refuses (std::invalid_argument) names in Options::reshard_after_forward_to_by_unit and
// Options::keep_gathered_after_forward that are not among `units` (listing them), and units kept
// gathered under a strategy that keeps every unit anyway or with hpZ for the same unit.
void check_per_unit_options(const Options& options, const std::vector<std::string>& units);

// Builds (collectively) the groups for the options' F on `mesh`, for tensors of `device`.
MeshInfo make_mesh_info(Mesh& mesh, const Options& options, c10::DeviceType device);

}  // namespace fsdp
