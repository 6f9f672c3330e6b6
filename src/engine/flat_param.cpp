#include "engine/flat_param.h"

#include <algorithm>
#include <stdexcept>

namespace fsdp {

FlatParamLayout::FlatParamLayout(std::vector<std::string> fqns,
                                 const std::vector<std::vector<int64_t>>& shapes,
                                 int64_t shard_factor)
    : shard_factor_(shard_factor) {
  if (shard_factor < 1) throw std::invalid_argument("FlatParamLayout: sharding factor must be >= 1");
  if (fqns.size() != shapes.size())
    throw std::invalid_argument("FlatParamLayout: one name per shape is required");
  entries_.reserve(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    FlatParamEntry e;
    e.fqn = std::move(fqns[i]);
    e.shape = shapes[i];
    e.numel = 1;
    for (int64_t d : e.shape) {
      if (d < 0) throw std::invalid_argument("FlatParamLayout: negative dimension in " + e.fqn);
      e.numel *= d;
    }
    e.offset = numel_;
    numel_ += e.numel;
    entries_.push_back(std::move(e));
  }
  // Right-pad to a multiple of F so every shard has the same size: the collectives then need no
  // copies (all-gather base / reduce-scatter base want equal chunks). An empty unit still gets one
  // element per shard so that its collectives have a non-empty, equal chunk on every rank.
  padded_numel_ = std::max<int64_t>(1, (numel_ + shard_factor_ - 1) / shard_factor_) * shard_factor_;
}

ShardSlice FlatParamLayout::slice(size_t index, int64_t shard_rank) const {
  if (shard_rank < 0 || shard_rank >= shard_factor_)
    throw std::out_of_range("FlatParamLayout::slice: shard rank out of range");
  const FlatParamEntry& e = entries_.at(index);
  const int64_t shard_begin = shard_rank * shard_numel();
  const int64_t shard_end = shard_begin + shard_numel();
  const int64_t begin = std::max(e.offset, shard_begin);
  const int64_t end = std::min(e.offset + e.numel, shard_end);
  ShardSlice s;
  if (end > begin) {
    s.param_begin = begin - e.offset;
    s.shard_offset = begin - shard_begin;
    s.length = end - begin;
  }
  return s;
}

std::vector<ShardSlice> FlatParamLayout::slices(int64_t shard_rank) const {
  std::vector<ShardSlice> out;
  out.reserve(entries_.size());
  for (size_t i = 0; i < entries_.size(); ++i) out.push_back(slice(i, shard_rank));
  return out;
}

}  // namespace fsdp
