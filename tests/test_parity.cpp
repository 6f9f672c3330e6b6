// Parity with local training (docs/design.md: the oracle for every feature): every strategy,
// world sizes 1-4 where the strategy allows, the tiny GPT (typed members, tied embedding/head)
// and an uneven net (units of 4 to 656 elements, an unused parameter), 5 steps of SGD+momentum
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

}  // namespace
