// Activation checkpointing (fsdp/activation_checkpoint.h), on its own and under fsdp, with
// dropout on: exact (losses, gradients and parameters bitwise equal to the same training without
// checkpointing, for every strategy) and working (each unit's reduce-scatter is issued while
// backward goes on, and recomputation gathers no more than backward did without it).
#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;

struct Case {
  std::string strategy;
  int world, shard_size;
  std::string precision;
  std::string prefetch = "backward_pre";  // backward prefetch
  int forward_prefetch = 0;
  std::string name() const {
    return strategy + "_W" + std::to_string(world) + (precision == "none" ? "" : "_" + precision) +
           (prefetch == "backward_pre" ? "" : "_" + prefetch) + (forward_prefetch ? "_forward_prefetch" : "");
  }
};

// Gradient reductions (reduce-scatters, and no_shard's all-reduces) issued during backward: before
// the last unit's backward computation ends (on the timeline's sequence numbers).
int reductions_during_backward(const json& spans, const std::string& kind) {
  int64_t backward_end = -1;
  for (const json& s : spans) {
    if (s["kind"] == "backward") backward_end = std::max(backward_end, s["end_seq"].get<int64_t>());
  }
  int n = 0;
  for (const json& s : spans) {
    if (s["kind"] == kind && s["seq"].get<int64_t>() < backward_end) ++n;
  }
  return n;
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name(); }

class Recompute : public testing::TestWithParam<Case> {};

TEST_P(Recompute, BitwiseEqualWithDropoutAndReducedDuringBackward) {
  const Case& c = GetParam();
  const auto ranks = fsdp_test::expect_ranks(
      "recompute", c.world,
      "--strategy " + c.strategy + (c.shard_size ? " --shard-size " + std::to_string(c.shard_size) : "") +
          " --mixed-precision " + c.precision + " --backward-prefetch " + c.prefetch +
          " --forward-prefetch " + std::to_string(c.forward_prefetch));
  ASSERT_EQ(ranks.size(), static_cast<size_t>(c.world));
  for (const json& r : ranks) {
    const std::string who = c.name() + " rank " + std::to_string(&r - &ranks[0]);
    // Bitwise: the same floats, not merely close ones.
    EXPECT_EQ(r["losses"], r["losses_checkpointed"]) << who;
    EXPECT_EQ(r["max_grad_diff"].get<double>(), 0.0) << who;
    EXPECT_EQ(r["max_param_diff"].get<double>(), 0.0) << who;
    EXPECT_EQ(r["local_max_grad_diff"].get<double>(), 0.0) << who;
    EXPECT_EQ(r["local_loss_diff"].get<double>(), 0.0) << who;
    EXPECT_EQ(r["input_without_grad_diff"].get<double>(), 0.0) << who;
    // The trap: units whose forward ran without grad mode would wait, gathered, for the end of
    // backward. Recomputation must gather no more than backward did, and reduce as it goes.
    const auto peak = r["unsharded_peak"].get<std::vector<int64_t>>();
    const auto peak_ckpt = r["unsharded_peak_checkpointed"].get<std::vector<int64_t>>();
    for (size_t s = 0; s < peak.size(); ++s) EXPECT_LE(peak_ckpt[s], peak[s]) << who << " step " << s;
    // F = 1 reduces with an all-reduce; with F > 1 the reduce-scatter is what backward must not delay.
    const std::string kind = c.strategy == "no_shard" ? "all-reduce" : "reduce-scatter";
    const int plain = reductions_during_backward(r["spans"], kind);
    EXPECT_GE(plain, 3) << who;  // 5 units: all but the last ones reduce while backward goes on
    EXPECT_EQ(reductions_during_backward(r["spans_checkpointed"], kind), plain) << who;
  }
}

const Case kCases[] = {
    {"full_shard", 2, 0, "none"},         {"shard_grad_op", 2, 0, "none"}, {"no_shard", 2, 0, "none"},
    {"hybrid_shard", 4, 2, "none"},       {"hybrid_shard_zero2", 4, 2, "none"}, {"full_shard", 2, 0, "bf16"},
    {"full_shard", 3, 0, "none"},         {"full_shard", 2, 0, "none", "backward_post"},
    {"full_shard", 2, 0, "none", "none"}, {"full_shard", 2, 0, "none", "backward_pre", 1},
};
INSTANTIATE_TEST_SUITE_P(Strategies, Recompute, testing::ValuesIn(kCases),
                         [](const testing::TestParamInfo<Case>& i) { return i.param.name(); });

}  // namespace
