#include "comm/mesh_info.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "comm/mesh_state.h"

namespace fsdp {

int sharding_factor(const Options& options, int W, int local_world_size) {
  const bool hybrid = options.strategy == ShardingStrategy::HYBRID_SHARD || options.strategy == ShardingStrategy::HYBRID_SHARD_ZERO2;
  if (options.shard_size < 0) {
    throw std::invalid_argument("fsdp: shard_size=" + std::to_string(options.shard_size) +
                                " is negative; pass the sharding factor F of a hybrid strategy, or 0 for the ranks "
                                "per node (LOCAL_WORLD_SIZE)");
  }
  int F = W;
  switch (options.strategy) {
    case ShardingStrategy::FULL_SHARD:
    case ShardingStrategy::SHARD_GRAD_OP: F = W; break;
    case ShardingStrategy::NO_SHARD: F = 1; break;
    case ShardingStrategy::HYBRID_SHARD:
    case ShardingStrategy::HYBRID_SHARD_ZERO2: F = options.shard_size > 0 ? options.shard_size : local_world_size; break;
  }
  if (!hybrid && options.shard_size != 0 && options.shard_size != F) {
    throw std::invalid_argument("fsdp: shard_size=" + std::to_string(options.shard_size) + " is for the hybrid strategies; " +
                                to_string(options.strategy) + " shards over F=" + std::to_string(F) +
                                " ranks. Use hybrid_shard (or hybrid_shard_zero2) to choose F, or drop shard_size.");
  }
  if (F < 1 || W % F != 0) {
    throw std::invalid_argument("fsdp: sharding factor F=" + std::to_string(F) + " (" + to_string(options.strategy) +
                                ") does not divide the world size W=" + std::to_string(W) +
                                ". Choose F among the divisors of W (F=W: full sharding, F=1: replication, "
                                "1<F<W: hybrid sharding within groups of F ranks).");
  }
  return F;
}

bool reshards_after_forward(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::FULL_SHARD || strategy == ShardingStrategy::HYBRID_SHARD;
}

namespace {
int resolve_secondary_size(int requested, const Options& options, int F, int local_world_size, const std::string& where) {
  if (requested == 0) return 0;
  const int N = requested == Options::kRanksPerNode ? local_world_size : requested;
  if (!reshards_after_forward(options.strategy)) {
    throw std::invalid_argument("fsdp: " + where + "=" + std::to_string(N) + " with " + to_string(options.strategy) +
                                ", which keeps parameters gathered after forward: use full_shard or hybrid_shard, or "
                                "drop " + where);
  }
  if (N < 1 || N >= F || F % N != 0) {
    throw std::invalid_argument("fsdp: " + where + "=" + std::to_string(N) + " must divide the sharding factor F=" +
                                std::to_string(F) +
                                " and be smaller (typically the ranks per host, so that backward's all-gather stays "
                                "inside a host; a hybrid strategy sharding within a host gathers inside it already); "
                                "0 turns it off");
  }
  return N;
}
}  // namespace

int secondary_shard_size(const Options& options, const std::string& unit, int F, int local_world_size) {
  const auto it = options.reshard_after_forward_to_by_unit.find(unit);
  if (it != options.reshard_after_forward_to_by_unit.end()) {
    return resolve_secondary_size(it->second, options, F, local_world_size,
                                  "reshard_after_forward_to_by_unit['" + unit + "']");
  }
  return resolve_secondary_size(options.reshard_after_forward_to, options, F, local_world_size, "reshard_after_forward_to");
}

bool reshards_unit_after_forward(const Options& options, const std::string& unit) {
  const auto& kept = options.keep_gathered_after_forward;
  return reshards_after_forward(options.strategy) && std::find(kept.begin(), kept.end(), unit) == kept.end();
}

void check_per_unit_options(const Options& options, const std::vector<std::string>& units) {
  auto check_name = [&](const std::string& option, const std::string& name) {
    if (std::find(units.begin(), units.end(), name) != units.end()) return;
    std::string known;
    for (const auto& u : units) known += (known.empty() ? "'" : ", '") + u + (u.empty() ? "' (the root unit)" : "'");
    throw std::invalid_argument("fsdp: " + option + " names '" + name + "', which is no unit of this model; its units are " +
                                known);
  };
  for (const auto& [name, n] : options.reshard_after_forward_to_by_unit) check_name("reshard_after_forward_to_by_unit", name);
  for (const auto& name : options.keep_gathered_after_forward) {
    check_name("keep_gathered_after_forward", name);
    if (!reshards_after_forward(options.strategy)) {
      throw std::invalid_argument("fsdp: keep_gathered_after_forward names '" + name + "' under " +
                                  to_string(options.strategy) + ", which keeps every unit gathered after forward "
                                  "already: drop it, or use full_shard or hybrid_shard");
    }
    const auto hpz = options.reshard_after_forward_to_by_unit.find(name);
    const int n = hpz != options.reshard_after_forward_to_by_unit.end() ? hpz->second : options.reshard_after_forward_to;
    if (n != 0) {
      const std::string groups = n == Options::kRanksPerNode ? "the ranks per node" : std::to_string(n) + " ranks";
      throw std::invalid_argument("fsdp: keep_gathered_after_forward names '" + name + "', which hpZ also reshards "
                                  "(to groups of " + groups + "): a unit kept whole needs no secondary shard; set "
                                  "reshard_after_forward_to_by_unit['" + name + "'] = 0 (fsdp-train: "
                                  "--reshard-after-forward-to-unit " + name + "=0) or drop it from "
                                  "keep_gathered_after_forward");
    }
  }
}

MeshInfo make_mesh_info(Mesh& mesh, const Options& options, c10::DeviceType device) {
  MeshInfo info;
  info.rank = mesh.rank();
  info.world_size = mesh.world_size();
  info.shard_size = sharding_factor(options, info.world_size, mesh.env().local_world_size);
  info.shard_rank = mesh.rank() % info.shard_size;
  info.replicas = info.world_size / info.shard_size;
  const auto& groups = detail::MeshState::of(mesh).groups_for(info.shard_size, device);
  info.shard_group = groups.shard;
  info.replicate_group = groups.replicate;
  info.world_group = mesh.world();
  auto& state = detail::MeshState::of(mesh);
  info.model = state.models_wrapped++;
  if (info.replicas > 1) info.replica_order = state.replica_order_for(info.replicate_group);
  if (info.shard_size > 1 && options.gloo_reduce_scatter == GlooReduceScatter::RING &&
      RingReduceScatter::supports(info.shard_group)) {
    info.shard_ring = state.ring_for(info.shard_group);
  }
  // Every N the options may use, in increasing order on every rank (groups are built collectively).
  std::vector<int> sizes{resolve_secondary_size(options.reshard_after_forward_to, options, info.shard_size,
                                                mesh.env().local_world_size, "reshard_after_forward_to")};
  for (const auto& [unit, n] : options.reshard_after_forward_to_by_unit) {
    sizes.push_back(secondary_shard_size(options, unit, info.shard_size, mesh.env().local_world_size));
  }
  std::sort(sizes.begin(), sizes.end());
  for (int N : sizes) {
    if (N > 0 && !info.secondary_groups.count(N)) info.secondary_groups.emplace(N, state.consecutive_group(N, device));
  }
  std::vector<GroupPtr> all{info.shard_group, info.replicate_group, info.world_group};
  for (const auto& [N, group] : info.secondary_groups) all.push_back(group);
  for (const GroupPtr& group : all) {
    if (auto log = state.log_for(group)) info.logs[group.get()] = std::move(log);
  }
  return info;
}

}  // namespace fsdp
