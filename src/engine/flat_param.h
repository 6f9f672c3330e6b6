// The FlatParameter layout (paper §3.2.1), as pure math with no tensors: flatten each original
// parameter, concatenate them, right-pad to a multiple of the sharding factor F, and chunk the
// result into F equal shards. Everything else (storage, collectives, autograd) builds on the
// offsets computed here, so this file has its own exhaustive unit test.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

// One original parameter's place in the unsharded flat tensor.
struct FlatParamEntry {
  std::string fqn;              // fully qualified name in the user's model
  std::vector<int64_t> shape;   // original shape
  int64_t numel = 0;
  int64_t offset = 0;           // first element in the unsharded flat tensor
};

// The part of one original parameter that a given shard holds: elements
// [param_begin, param_begin + length) of the flattened parameter, stored at
// [shard_offset, shard_offset + length) of that shard. length == 0 means the shard holds none of it.
struct ShardSlice {
  int64_t param_begin = 0;
  int64_t shard_offset = 0;
  int64_t length = 0;
};

class FlatParamLayout {
 public:
  // `shapes[i]` is parameter i's shape, in the order they are concatenated.
  FlatParamLayout(std::vector<std::string> fqns, const std::vector<std::vector<int64_t>>& shapes,
                  int64_t shard_factor);

  const std::vector<FlatParamEntry>& entries() const { return entries_; }
  int64_t shard_factor() const { return shard_factor_; }
  int64_t numel() const { return numel_; }                // Σ ψ over original parameters
  int64_t padded_numel() const { return padded_numel_; }  // numel rounded up to a multiple of F
  int64_t shard_numel() const { return padded_numel_ / shard_factor_; }  // = ceil(numel / F)
  int64_t padding() const { return padded_numel_ - numel_; }             // < F

  // Which slice of parameter `index` the shard `shard_rank` (0 <= shard_rank < F) holds.
  ShardSlice slice(size_t index, int64_t shard_rank) const;
  // All parameters' slices for one shard, in parameter order (empty slices included).
  std::vector<ShardSlice> slices(int64_t shard_rank) const;

 private:
  std::vector<FlatParamEntry> entries_;
  int64_t shard_factor_;
  int64_t numel_ = 0;
  int64_t padded_numel_ = 0;
};

}  // namespace fsdp
