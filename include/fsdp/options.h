// What a user chooses when sharding a model: the strategy (paper §3.2: the sharding factor F and
// whether to reshard after forward) and how the model is cut into FSDP units.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <torch/nn/module.h>

namespace fsdp {

enum class ShardingStrategy {
  FULL_SHARD,          // F = W, reshard after forward (ZeRO-3)
  SHARD_GRAD_OP,       // F = W, keep unsharded from forward until after backward (ZeRO-2)
  NO_SHARD,            // F = 1: replication with all-reduce, like DDP
  HYBRID_SHARD,        // 1 <= F <= W: shard within groups of F ranks, replicate across them
  HYBRID_SHARD_ZERO2,  // hybrid sharding that keeps parameters unsharded until after backward
};

// "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2".
ShardingStrategy parse_strategy(const std::string& name);
std::string to_string(ShardingStrategy strategy);

// Decides whether a module becomes its own FSDP unit. Called bottom-up (children before parents)
// with the module's fully qualified name and the number of parameter elements in its subtree
// that no deeper unit has claimed yet.
using WrapPolicy = std::function<bool(const std::string& fqn, const torch::nn::Module& module,
                                      int64_t unclaimed_numel)>;

// Every module whose type is one of Ts becomes a unit (e.g. the transformer block type).
template <typename... Ts>
WrapPolicy module_type_policy() {
  return [](const std::string&, const torch::nn::Module& m, int64_t) {
    return ((dynamic_cast<const Ts*>(&m) != nullptr) || ...);
  };
}

// A module becomes a unit once its subtree holds at least `min_numel` unclaimed elements
// (like PyTorch's size_based_auto_wrap_policy).
WrapPolicy size_based_policy(int64_t min_numel);

struct Options {
  ShardingStrategy strategy = ShardingStrategy::FULL_SHARD;
  // F for the hybrid strategies; 0 means LOCAL_WORLD_SIZE (shard within a node). Ignored by the
  // others (FULL_SHARD and SHARD_GRAD_OP use F = W, NO_SHARD uses F = 1).
  int shard_size = 0;
  // Modules that become units besides those marked with fully_shard(). Empty: no automatic units.
  WrapPolicy auto_wrap_policy;
};

}  // namespace fsdp
