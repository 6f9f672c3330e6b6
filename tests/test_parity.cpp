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

using fsdp_test::expect_same_losses;
using fsdp_test::main_job;

struct ParityCase {
  std::string strategy;
  int world;
  int shard_size;
  bool all_variants;
  std::string unit_detection = "dispatch_key";  // Options::unit_detection
};

std::string name_of(const testing::TestParamInfo<ParityCase>& info) {
  return info.param.strategy + "_W" + std::to_string(info.param.world) +
         (info.param.shard_size ? "_F" + std::to_string(info.param.shard_size) : "") +
         (info.param.unit_detection == "dispatch_key" ? "" : "_" + info.param.unit_detection);
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
  cmd += " --unit-detection " + c.unit_detection;
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
                    ParityCase{"hybrid_shard_zero2", 1, 1, false}, ParityCase{"hybrid_shard_zero2", 4, 2, true},
                    // The RecordFunction callback, kept for code that reaches parameter storage without the key.
                    ParityCase{"full_shard", 2, 0, true, "record_function"},
                    ParityCase{"hybrid_shard", 4, 2, false, "record_function"}),
    name_of);

// The fused attention (at::scaled_dot_product_attention, fsdp-train's default) against the
// written-out reference it replaced, trained by fsdp-train as a user runs it: the same losses up to
// rounding (the fused kernel sums in another order), locally and sharded.
TEST(Attention, FusedTrainsLikeTheWrittenOutReference) {
  for (const std::string launch : {"--local", "--nproc-per-node 2 --strategy full_shard"}) {
    const std::string common = "--model tiny --global-batch-size 8 " + launch;
    expect_same_losses(main_job(common + " --attention fused", 4).losses,
                       main_job(common + " --attention reference", 4).losses, 1e-5, launch);
  }
}

// The paper's other two workloads through the main job: T5 (sequence to sequence) and the DHEN-like
// model (its embedding rows sharded across the ranks outside fsdp, exchanged with all-to-all, built
// deferred), sharded at W = 2 and 4 against --local; with activation checkpointing; and the
// DDP-style baseline of Fig. 6a, with and without gradient accumulation, against --local too.
TEST(MainJob, T5AndDHENTrainLikeLocal) {
  for (const std::string model : {"t5-tiny", "dhen-tiny"}) {
    const std::string common = "--model " + model + " --global-batch-size 16";
    const auto local = main_job(common + " --local", 4).losses;
    for (const std::string launch : {"--nproc-per-node 2 --strategy full_shard",
                                     "--nproc-per-node 4 --strategy hybrid_shard --shard-size 2",
                                     "--nproc-per-node 4 --strategy shard_grad_op",
                                     "--nproc-per-node 2 --strategy full_shard --activation-checkpointing",
                                     "--nproc-per-node 2 --ddp-baseline",
                                     "--nproc-per-node 2 --ddp-baseline --grad-accum 2"}) {
      expect_same_losses(main_job(common + " " + launch, 4).losses, local, 1e-5, model + " " + launch);
    }
  }
}

// Issue 24's tenth hole: the DHEN-like model through the main job at its default batch, where the
// gradient norm passes fsdp-train's --clip 1: the clip must count the embedding rows fsdp leaves
// alone (each rank's own, summed over the ranks: clip_grad_norm_'s model_parallel) and scale them,
// as local training's clip does. Before, step 2 was 1.9e-5 off (rows left out of the norm).
TEST(MainJob, DHENClipsLikeLocalTraining) {
  const std::string common = "--model dhen-small --seed 7";
  const auto local = main_job(common + " --local", 4).losses;
  for (const std::string launch : {"--nproc-per-node 2 --strategy full_shard", "--nproc-per-node 4 --strategy shard_grad_op"}) {
    expect_same_losses(main_job(common + " " + launch, 4).losses, local, 1e-6, launch);
  }
}

// The DHEN-like model's stated target (models/click_data.h), from the README's command: dhen-small
// at W = 2, the default global batch of 256 and AdamW, held-out loss <= 0.53 and AUC >= 0.76 within
// 1000 steps (predicting the base rate: 0.61 and 0.5; the Bayes-optimal model: 0.47 and 0.81).
TEST(MainJob, DHENReachesItsStatedTarget) {
  const auto run = main_job("--model dhen-small --nproc-per-node 2 --eval-every 1000", 1000, 600);
  ASSERT_TRUE(run.last.contains("eval")) << run.last.dump();
  EXPECT_LE(run.last["eval"]["loss"].get<double>(), 0.53) << run.last["eval"].dump();
  EXPECT_GE(run.last["eval"]["auc"].get<double>(), 0.76) << run.last["eval"].dump();
}

}  // namespace
