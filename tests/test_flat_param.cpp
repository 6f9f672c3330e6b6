// The FlatParameter layout math (paper §3.2.1) over random shapes and sharding factors up to 16.
#include <gtest/gtest.h>

#include <random>

#include "src/engine/flat_param.h"

namespace {

using fsdp::FlatParamLayout;

FlatParamLayout make(const std::vector<std::vector<int64_t>>& shapes, int64_t F) {
  std::vector<std::string> names;
  for (size_t i = 0; i < shapes.size(); ++i) names.push_back("p" + std::to_string(i));
  return FlatParamLayout(names, shapes, F);
}

TEST(FlatParamLayout, PaperFigure3LinearOn16Ranks) {
  // A 4x3 Linear (12 weight elements + 3 bias elements = 15) over 16 ranks: one element per rank,
  // the last rank holds only padding.
  auto l = make({{4, 3}, {3}}, 16);
  EXPECT_EQ(l.numel(), 15);
  EXPECT_EQ(l.padded_numel(), 16);
  EXPECT_EQ(l.shard_numel(), 1);
  EXPECT_EQ(l.padding(), 1);
  EXPECT_EQ(l.slice(0, 11).length, 1);
  EXPECT_EQ(l.slice(0, 12).length, 0);
  EXPECT_EQ(l.slice(1, 12).param_begin, 0);
  EXPECT_EQ(l.slice(1, 14).param_begin, 2);
  EXPECT_EQ(l.slice(0, 15).length, 0);
  EXPECT_EQ(l.slice(1, 15).length, 0);
}

TEST(FlatParamLayout, ParameterSpanningShardBoundary) {
  auto l = make({{3}, {5}, {2}}, 4);  // 10 elements -> padded 12, shards of 3
  EXPECT_EQ(l.shard_numel(), 3);
  // p1 occupies flat [3, 8): shard 1 holds [3,6) = p1[0,3), shard 2 holds [6,8) = p1[3,5).
  auto s1 = l.slice(1, 1), s2 = l.slice(1, 2);
  EXPECT_EQ(s1.param_begin, 0); EXPECT_EQ(s1.shard_offset, 0); EXPECT_EQ(s1.length, 3);
  EXPECT_EQ(s2.param_begin, 3); EXPECT_EQ(s2.shard_offset, 0); EXPECT_EQ(s2.length, 2);
  auto s3 = l.slice(2, 2);  // p2 at flat [8, 10): shard 2 offset 2..3, shard 3 offset 0
  EXPECT_EQ(s3.shard_offset, 2); EXPECT_EQ(s3.length, 1);
  EXPECT_EQ(l.slice(2, 3).param_begin, 1);
  EXPECT_EQ(l.slice(2, 3).length, 1);
}

TEST(FlatParamLayout, FewerElementsThanRanks) {
  auto l = make({{1}, {1}}, 8);
  EXPECT_EQ(l.padded_numel(), 8);
  EXPECT_EQ(l.shard_numel(), 1);
  int holders = 0;
  for (int r = 0; r < 8; ++r) holders += l.slice(0, r).length + l.slice(1, r).length;
  EXPECT_EQ(holders, 2);
}

TEST(FlatParamLayout, RejectsBadInput) {
  EXPECT_THROW(make({{2}}, 0), std::invalid_argument);
  EXPECT_THROW(make({{-1, 2}}, 2), std::invalid_argument);
  EXPECT_THROW(make({{2}}, 2).slice(0, 2), std::out_of_range);
}

// Random shapes, F = 1..16: every element of every parameter is held by exactly one shard, at
// the place the concatenated, padded layout puts it, and shards are equal and as small as possible.
TEST(FlatParamLayout, RandomShapesCoverEveryElementOnce) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t F = 1 + trial % 16;
    const int nparams = 1 + static_cast<int>(rng() % 7);
    std::vector<std::vector<int64_t>> shapes;
    for (int i = 0; i < nparams; ++i) {
      std::vector<int64_t> shape;
      const int dims = static_cast<int>(rng() % 4);  // 0-d scalars included
      for (int d = 0; d < dims; ++d) shape.push_back(static_cast<int64_t>(rng() % 6));  // zeros included
      shapes.push_back(shape);
    }
    auto l = make(shapes, F);
    int64_t total = 0;
    for (const auto& e : l.entries()) total += e.numel;
    ASSERT_EQ(l.numel(), total);
    ASSERT_EQ(l.padded_numel() % F, 0);
    if (total > 0) ASSERT_LT(l.padding(), F);  // an empty unit is one padding element per shard
    ASSERT_EQ(l.shard_numel(), std::max<int64_t>(1, (total + F - 1) / F));
    std::vector<int> seen(static_cast<size_t>(l.padded_numel()), 0);
    for (int64_t r = 0; r < F; ++r) {
      int64_t prev_end = 0;
      for (size_t i = 0; i < l.entries().size(); ++i) {
        auto s = l.slice(i, r);
        if (s.length == 0) continue;
        ASSERT_GE(s.shard_offset, prev_end);  // slices are in order and do not overlap
        ASSERT_LE(s.shard_offset + s.length, l.shard_numel());
        ASSERT_LE(s.param_begin + s.length, l.entries()[i].numel);
        for (int64_t k = 0; k < s.length; ++k) {
          // The slice's flat position computed two ways must agree.
          const int64_t flat = l.entries()[i].offset + s.param_begin + k;
          ASSERT_EQ(flat, r * l.shard_numel() + s.shard_offset + k);
          seen[static_cast<size_t>(flat)] += 1;
        }
        prev_end = s.shard_offset + s.length;
      }
    }
    for (int64_t k = 0; k < l.padded_numel(); ++k) {
      ASSERT_EQ(seen[static_cast<size_t>(k)], k < total ? 1 : 0) << "element " << k << " trial " << trial;
    }
  }
}

}  // namespace
