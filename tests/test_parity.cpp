// Parity with local training (docs/design.md: the oracle for every feature): every strategy,
// world sizes 1-4 where the strategy allows, the tiny GPT (typed members, tied embedding/head),
// an uneven net (units of 4 to 656 elements, an unused parameter) and the tiny T5 (encoder and
// decoder blocks as units, position buckets shared across a stack's units, cross-attention, a
// tied embedding used by both stacks and the head), 5 steps of SGD+momentum
// and of AdamW with per-parameter groups, from the same init and the same global batch as one
// local process.
#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

struct ParityCase {
  std::string strategy;
  int world;
  int shard_size;
  bool all_variants;
};

std::string name_of(const testing::TestParamInfo<ParityCase>& info) {
  return info.param.strategy + "_W" + std::to_string(info.param.world) +
         (info.param.shard_size ? "_F" + std::to_string(info.param.shard_size) : "");
}

void PrintTo(const ParityCase& c, std::ostream* os) { *os << c.strategy << " W=" << c.world; }

class Parity : public testing::TestWithParam<ParityCase> {};

TEST_P(Parity, MatchesLocalTraining) {
  const auto& c = GetParam();
  const std::string out = fsdp_test::temp_prefix("parity-" + name_of({c, 0}));
  std::string cmd = fsdp_test::worker() + " parity --nproc-per-node " + std::to_string(c.world) +
                    " --strategy " + c.strategy + " --out " + out;
  if (c.shard_size) cmd += " --shard-size " + std::to_string(c.shard_size);
  if (c.all_variants) cmd += " --variants all";
  auto run = fsdp_test::sh(cmd);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (int r = 0; r < c.world; ++r) {
    auto j = fsdp_test::read_json(out + "." + std::to_string(r) + ".json");
    ASSERT_GE(j["cases"].size(), 4u);
    for (const auto& k : j["cases"]) {
      const std::string what = k.dump();
      const double tol = k["optim"] == "sgd" ? 1e-5 : 1e-4;
      EXPECT_LE(k["max_param_diff"].get<double>(), tol) << "rank " << r << ": " << what;
      EXPECT_LE(k["max_loss_diff"].get<double>(), 1e-5) << "rank " << r << ": " << what;
      EXPECT_LE(k["max_norm_diff"].get<double>(), 1e-5) << "rank " << r << ": " << what;
      EXPECT_TRUE(k["unused_grad_none"].get<bool>()) << "rank " << r << ": " << what;
    }
    std::remove((out + "." + std::to_string(r) + ".json").c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, Parity,
    testing::Values(ParityCase{"full_shard", 1, 0, false}, ParityCase{"full_shard", 2, 0, true},
                    ParityCase{"full_shard", 3, 0, false}, ParityCase{"full_shard", 4, 0, false},
                    ParityCase{"shard_grad_op", 1, 0, false}, ParityCase{"shard_grad_op", 2, 0, false},
                    ParityCase{"shard_grad_op", 3, 0, true}, ParityCase{"shard_grad_op", 4, 0, false},
                    ParityCase{"no_shard", 1, 0, false}, ParityCase{"no_shard", 2, 0, true},
                    ParityCase{"no_shard", 3, 0, false}, ParityCase{"no_shard", 4, 0, false},
                    ParityCase{"hybrid_shard", 1, 1, false}, ParityCase{"hybrid_shard", 4, 2, true},
                    ParityCase{"hybrid_shard_zero2", 1, 1, false}, ParityCase{"hybrid_shard_zero2", 4, 2, true}),
    name_of);

// The fused attention (at::scaled_dot_product_attention, fsdp-train's default) against the
// written-out reference it replaced, trained by fsdp-train as a user runs it: the same losses up to
// rounding (the fused kernel sums in another order), locally and sharded.
TEST(Attention, FusedTrainsLikeTheWrittenOutReference) {
  auto losses = [](const std::string& args) {
    const std::string metrics = fsdp_test::temp_prefix("attention") + ".jsonl";
    std::remove(metrics.c_str());
    const auto run = fsdp_test::sh(fsdp_test::bin_dir() + "/fsdp-train --model tiny --steps 4 --global-batch-size 8 "
                                   "--log-every 100 --metrics-jsonl " + metrics + " " + args);
    EXPECT_EQ(run.exit_code, 0) << run.output;
    std::vector<double> out(4, 0.0);
    for (const auto& j : fsdp_test::read_jsonl(metrics)) {
      if (j["rank"] == 0) out.at(j["step"].get<size_t>()) = j["loss"].get<double>();
    }
    std::remove(metrics.c_str());
    return out;
  };
  for (const std::string launch : {"--local", "--nproc-per-node 2 --strategy full_shard"}) {
    const auto fused = losses(launch + " --attention fused"), reference = losses(launch + " --attention reference");
    for (size_t s = 0; s < fused.size(); ++s) {
      EXPECT_NEAR(fused[s], reference[s], 1e-5 * std::abs(reference[s])) << launch << " step " << s;
      EXPECT_GT(fused[s], 0.0) << launch << " step " << s;
    }
  }
}

}  // namespace
