// Mixed precision (paper §4.4) and the sharded gradient scaler.
//
// The reference replays fsdp's casts on a local model: each rank's slice runs forward and
// backward in param_dtype, gradients are cast to reduce_dtype, divided by W and summed, then cast
// to fp32 for the fp32 master step. The only difference left is the order of the sum across ranks,
// so at W = 2 (a + b = b + a) the result is bit-identical and at W = 3 within a few ulps of the
// dtype; the tolerances below are about 16x what was measured (bf16 6.1e-5, fp16 7.6e-6 at W = 3).
#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;


struct PrecisionCase {
  std::string param, reduce;
  int world;
  double tol;
  bool keep_low_grads = false;
  std::string flags;  // e.g. a hybrid strategy, or --variants accum (no_sync micro-batches)
};

void PrintTo(const PrecisionCase& c, std::ostream* os) { *os << c.param << "/" << c.reduce << " W=" << c.world; }

class Precision : public testing::TestWithParam<PrecisionCase> {};

TEST_P(Precision, MatchesReplayedCastsAndCarriesTheDtypes) {
  const auto& c = GetParam();
  const auto ranks = fsdp_test::expect_ranks("precision", c.world, "--param-dtype " + c.param + " --reduce-dtype " + c.reduce +
                                                         " --keep-low-grads " + (c.keep_low_grads ? "1" : "0") + " " + c.flags);
  ASSERT_EQ(ranks.size(), static_cast<size_t>(c.world));
  for (int r = 0; r < c.world; ++r) {
    const json& j = ranks[static_cast<size_t>(r)];
    const std::string what = "rank " + std::to_string(r) + " " + j.dump();
    EXPECT_LE(j["max_param_diff"].get<double>(), c.tol) << what;
    EXPECT_EQ(j["logits_dtype"], c.param) << "forward must run in param_dtype; " << what;
    EXPECT_EQ(j["all_gather_dtypes"], json::array({c.param})) << what;
    EXPECT_EQ(j["reduce_scatter_dtypes"], json::array({c.reduce})) << what;
    // The optimizer steps the fp32 master, with fp32 gradients unless asked to keep them low.
    EXPECT_EQ(j["param_dtypes"], json::array({"fp32"})) << what;
    EXPECT_EQ(j["grad_dtypes"], json::array({c.keep_low_grads ? c.param : std::string("fp32")})) << what;
    EXPECT_EQ(j["running_mean_dtype"], c.param) << "floating buffers are cast to buffer_dtype; " << what;
    EXPECT_EQ(j["num_batches_tracked_dtype"], "Long") << "integer buffers stay; " << what;
    // Half the bytes of fp32 for every 2-byte dtype, to the byte. The fp32 baseline is one forward
    // and one backward, so the accumulation case (two micro-batches) is left out of this check.
    if (c.flags.find("accum") != std::string::npos) continue;
    EXPECT_EQ(2 * j["all_gather_bytes"].get<int64_t>(), j["fp32_all_gather_bytes"].get<int64_t>()) << what;
    const int64_t rs_factor = c.reduce == "fp32" ? 1 : 2;
    EXPECT_EQ(rs_factor * j["reduce_scatter_bytes"].get<int64_t>(), j["fp32_reduce_scatter_bytes"].get<int64_t>()) << what;
    EXPECT_EQ(rs_factor * j["all_reduce_bytes"].get<int64_t>(), j["fp32_all_reduce_bytes"].get<int64_t>()) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Precision,
                         testing::Values(PrecisionCase{"bf16", "bf16", 2, 1e-3}, PrecisionCase{"bf16", "bf16", 3, 1e-3},
                                         PrecisionCase{"fp16", "fp16", 3, 1e-4}, PrecisionCase{"bf16", "fp32", 2, 1e-3},
                                         PrecisionCase{"bf16", "bf16", 2, 1e-3, true},
                                         PrecisionCase{"bf16", "bf16", 3, 1e-3, false, "--variants accum"},
                                         PrecisionCase{"bf16", "bf16", 4, 1e-3, false, "--strategy hybrid_shard --shard-size 2"}),
                         [](const testing::TestParamInfo<PrecisionCase>& i) {
                           return i.param.param + "_" + i.param.reduce + "_W" + std::to_string(i.param.world) +
                                  (i.param.keep_low_grads ? "_keep_low_grads" : "") +
                                  (i.param.flags.find("accum") != std::string::npos ? "_no_sync_accum" : "") +
                                  (i.param.flags.find("hybrid") != std::string::npos ? "_hybrid_F2" : "");
                         });

// An inf in one rank's gradient shard skips the step on every rank and backs the scale off; the
// scale grows again after growth_interval (2) good steps; a tied weight is unscaled once.
TEST(ShardedGradScaler, InfOnOneRankSkipsTheStepEverywhere) {
  const int world = 3;
  const auto ranks = fsdp_test::expect_ranks("scaler", world, "--inf-rank 1");
  ASSERT_EQ(ranks.size(), static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const auto& steps = ranks[static_cast<size_t>(r)]["steps"];
    ASSERT_EQ(steps.size(), 5u);
    const std::string what = "rank " + std::to_string(r) + " " + steps.dump();
    for (int s = 0; s < 5; ++s) {
      const bool overflow_step = s == 2;
      EXPECT_EQ(steps[s]["stepped"].get<bool>(), !overflow_step) << "step " << s << " " << what;
      EXPECT_EQ(steps[s]["params_changed"].get<bool>(), !overflow_step) << "step " << s << " " << what;
    }
    EXPECT_EQ(steps[0]["scale_after"].get<double>(), 1024.0) << what;
    EXPECT_EQ(steps[1]["scale_after"].get<double>(), 2048.0) << what;  // grew after 2 good steps
    EXPECT_EQ(steps[2]["scale_after"].get<double>(), 1024.0) << what;  // backed off
    EXPECT_EQ(steps[4]["scale_after"].get<double>(), 2048.0) << what;
    // The optimizer was built from libtorch's parameters(), which lists the tied weight twice:
    // unscale_ still divides every gradient by the scale exactly once.
    EXPECT_TRUE(ranks[static_cast<size_t>(r)]["unscaled_once"].get<bool>()) << what;
  }
}

}  // namespace
