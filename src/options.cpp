#include "fsdp/options.h"

#include <stdexcept>

namespace fsdp {

ShardingStrategy parse_strategy(const std::string& name) {
  if (name == "full_shard") return ShardingStrategy::FULL_SHARD;
  if (name == "shard_grad_op") return ShardingStrategy::SHARD_GRAD_OP;
  if (name == "no_shard") return ShardingStrategy::NO_SHARD;
  if (name == "hybrid_shard") return ShardingStrategy::HYBRID_SHARD;
  if (name == "hybrid_shard_zero2") return ShardingStrategy::HYBRID_SHARD_ZERO2;
  throw std::invalid_argument("unknown sharding strategy '" + name +
                              "'; use full_shard, shard_grad_op, no_shard, hybrid_shard or hybrid_shard_zero2");
}

std::string to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FULL_SHARD: return "full_shard";
    case ShardingStrategy::SHARD_GRAD_OP: return "shard_grad_op";
    case ShardingStrategy::NO_SHARD: return "no_shard";
    case ShardingStrategy::HYBRID_SHARD: return "hybrid_shard";
    case ShardingStrategy::HYBRID_SHARD_ZERO2: return "hybrid_shard_zero2";
  }
  return "?";
}

WrapPolicy size_based_policy(int64_t min_numel) {
  return [min_numel](const std::string&, const torch::nn::Module&, int64_t unclaimed) {
    return unclaimed >= min_numel;
  };
}

}  // namespace fsdp
