#include "fsdp/options.h"

#include <stdexcept>

#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

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

BackwardPrefetch parse_backward_prefetch(const std::string& name) {
  if (name == "none") return BackwardPrefetch::NONE;
  if (name == "backward_pre") return BackwardPrefetch::BACKWARD_PRE;
  if (name == "backward_post") return BackwardPrefetch::BACKWARD_POST;
  throw std::invalid_argument("unknown backward prefetch mode '" + name + "'; use none, backward_pre or backward_post");
}

std::string to_string(BackwardPrefetch mode) {
  switch (mode) {
    case BackwardPrefetch::NONE: return "none";
    case BackwardPrefetch::BACKWARD_PRE: return "backward_pre";
    case BackwardPrefetch::BACKWARD_POST: return "backward_post";
  }
  return "?";
}

UnitDetection parse_unit_detection(const std::string& name) {
  if (name == "dispatch_key") return UnitDetection::DISPATCH_KEY;
  if (name == "record_function") return UnitDetection::RECORD_FUNCTION;
  throw std::invalid_argument("unknown unit detection '" + name + "'; use dispatch_key or record_function");
}

std::string to_string(UnitDetection mode) {
  return mode == UnitDetection::DISPATCH_KEY ? "dispatch_key" : "record_function";
}

GlooReduceScatter parse_gloo_reduce_scatter(const std::string& name) {
  if (name == "ring") return GlooReduceScatter::RING;
  if (name == "all_reduce") return GlooReduceScatter::ALL_REDUCE;
  throw std::invalid_argument("unknown Gloo reduce-scatter '" + name + "'; use ring or all_reduce");
}

std::string to_string(GlooReduceScatter mode) { return mode == GlooReduceScatter::RING ? "ring" : "all_reduce"; }

AllGatherQuantization parse_all_gather_quantization(const std::string& name) {
  if (name == "none") return AllGatherQuantization::NONE;
  if (name == "int8") return AllGatherQuantization::INT8;
  if (name == "fp8" || name == "fp8_e4m3") return AllGatherQuantization::FP8_E4M3;
  throw std::invalid_argument("unknown all-gather quantization '" + name + "'; use none, int8 or fp8");
}

std::string to_string(AllGatherQuantization mode) {
  switch (mode) {
    case AllGatherQuantization::NONE: return "none";
    case AllGatherQuantization::INT8: return "int8";
    case AllGatherQuantization::FP8_E4M3: return "fp8";
  }
  return "?";
}

c10::ScalarType parse_dtype(const std::string& name) {
  if (name == "fp32" || name == "float32") return c10::kFloat;
  if (name == "bf16" || name == "bfloat16") return c10::kBFloat16;
  if (name == "fp16" || name == "float16") return c10::kHalf;
  throw std::invalid_argument("unknown dtype '" + name + "'; use fp32, bf16 or fp16");
}

std::string dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat: return "fp32";
    case c10::kBFloat16: return "bf16";
    case c10::kHalf: return "fp16";
    default: return c10::toString(dtype);
  }
}

WrapPolicy size_based_policy(int64_t min_numel) {
  return [min_numel](const std::string&, const torch::nn::Module& m, int64_t unclaimed) {
    // As PyTorch's exclude_wrap_modules: a container is a list of modules, not one that runs; its
    // children may be units, and what they leave goes up to the module that calls them.
    if (dynamic_cast<const torch::nn::ModuleListImpl*>(&m) || dynamic_cast<const torch::nn::ModuleDictImpl*>(&m)) {
      return false;
    }
    return unclaimed >= min_numel;
  };
}

}  // namespace fsdp
