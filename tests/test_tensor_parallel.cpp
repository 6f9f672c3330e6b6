// Two-dimensional parallelism (issue 27): tensor parallelism inside a host, fsdp over the
// data-parallel ranks, through fsdp-train as users run it. The oracle is local training: the TP
// all-reduces sum partial products in another order, so runs agree within 1e-5 relative, not bit
// for bit; the clipping norm (over both dimensions) is held to local training's too.
#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

using fsdp_test::expect_same_losses;
using fsdp_test::main_job;

constexpr int kSteps = 20;

void expect_same_norms(const fsdp_test::MainJob& got, const fsdp_test::MainJob& want, const std::string& what) {
  const double g = got.last["grad_norm"].get<double>(), w = want.last["grad_norm"].get<double>();
  EXPECT_GT(w, 0.1) << what;  // --clip 0.1 below: every step clips
  EXPECT_NEAR(g, w, 1e-4 * w) << what << ": the last step's gradient norm";
}

// Every strategy at TP 2 x DP 2, and TP 4 x DP 1, for the GPT (4 heads) and T5: 20 steps of
// AdamW with clipping at 0.1 (every step clips, so a norm that missed the other TP rank's parts
// or counted the replicated ones twice would change every step's update).
TEST(TensorParallel, EveryStrategyTrainsLikeLocal) {
  for (const std::string model : {"small", "t5-tiny"}) {
    const std::string common = "--model " + model + " --global-batch-size 12 --clip 0.1";
    const auto local = main_job(common + " --local", kSteps);
    for (const std::string launch :
         {"--nproc-per-node 4 --tp 2 --strategy full_shard", "--nproc-per-node 4 --tp 2 --strategy shard_grad_op",
          "--nproc-per-node 4 --tp 2 --strategy no_shard", "--nproc-per-node 4 --tp 2 --strategy hybrid_shard --shard-size 1",
          "--nproc-per-node 4 --tp 2 --strategy hybrid_shard_zero2", "--nproc-per-node 4 --tp 4",
          "--nproc-per-node 2 --tp 2"}) {
      const auto run = main_job(common + " " + launch, kSteps);
      expect_same_losses(run.losses, local.losses, 1e-5, model + " " + launch);
      expect_same_norms(run, local, model + " " + launch);
    }
  }
}

// With activation checkpointing (recomputation repeats forward's TP all-reduces inside backward)
// and with gradient accumulation under no_sync (--grad-accum 3: the first micro-batches' backward
// reduces nothing).
TEST(TensorParallel, CheckpointingAndNoSyncTrainLikeLocal) {
  for (const std::string model : {"small", "t5-tiny"}) {
    const std::string common = "--model " + model + " --global-batch-size 12 --clip 0.1";
    const auto local = main_job(common + " --local", kSteps);
    for (const std::string extra : {" --activation-checkpointing", " --grad-accum 3"}) {
      const std::string launch = " --nproc-per-node 4 --tp 2" + extra;
      const auto run = main_job(common + launch, kSteps);
      expect_same_losses(run.losses, local.losses, 1e-5, model + launch);
      expect_same_norms(run, local, model + launch);
    }
  }
}

// bf16 (parameters and reduction): TP 2 x DP 2 against its own fp32 run, and against fsdp alone in
// bf16 at the same W: the TP all-reduces of bf16 activations add their rounding to fsdp's. Stated
// tolerance: within 1 % of fp32 over 20 steps (measured: docs/performance.md, "Two dimensions").
TEST(TensorParallel, Bf16StaysCloseToFp32) {
  for (const std::string model : {"small", "t5-tiny"}) {
    const std::string common = "--model " + model + " --global-batch-size 12 --nproc-per-node 4";
    const auto fp32 = main_job(common + " --tp 2", kSteps);
    const auto bf16 = main_job(common + " --tp 2 --mixed-precision bf16", kSteps);
    const auto fsdp_bf16 = main_job(common + " --mixed-precision bf16", kSteps);
    expect_same_losses(bf16.losses, fp32.losses, 1e-2, model + " TP bf16 vs fp32");
    expect_same_losses(fsdp_bf16.losses, fp32.losses, 1e-2, model + " fsdp bf16 vs fp32");
    // The computation really was in bf16 (the two differ from fp32 at all).
    double diff = 0;
    for (size_t s = 0; s < fp32.losses.size(); ++s) diff = std::max(diff, std::abs(bf16.losses[s] - fp32.losses[s]));
    EXPECT_GT(diff, 1e-6) << model;
  }
}

// Each TP rank holds its parts: a quarter (TP 2 of DP 2 shards) of the sharded state fsdp alone at
// W = 2 would hold per rank; the split layers' weights are half on every rank.
TEST(TensorParallel, ParametersPerRankShrinkWithTp) {
  const std::string common = "--model small --global-batch-size 12";
  const auto dp2 = main_job(common + " --nproc-per-node 2", 2);
  const auto tp2 = main_job(common + " --nproc-per-node 4 --tp 2", 2);
  const double a = dp2.last["param_bytes_resident"].get<double>(), b = tp2.last["param_bytes_resident"].get<double>();
  // Replicated parts (norms, position embedding, row-parallel biases) do not shrink with TP.
  EXPECT_LT(b, 0.6 * a);
  EXPECT_GT(b, 0.45 * a);
}

// What cannot work is refused before anything trains, on every rank, saying why.
TEST(TensorParallel, WhatCannotWorkIsRefused) {
  struct Case {
    std::string args, says;
  } cases[] = {
      {"--model small --nproc-per-node 4 --tp 3", "must divide the world size"},
      {"--model tiny --nproc-per-node 4 --tp 4", "the TP size must divide n_head"},
      {"--model small --nproc-per-node 2 --tp 2 --dropout 0.1", "drop --dropout"},
      {"--model dhen-tiny --nproc-per-node 2 --tp 2", "has no tensor-parallel plan"},
      {"--model small --local --tp 2", "--tp needs fsdp"},
  };
  for (const auto& c : cases) {
    const auto run = fsdp_test::sh(fsdp_test::fsdp_train() + " --steps 2 --global-batch-size 12 " + c.args, 120);
    EXPECT_NE(run.exit_code, 0) << c.args;
    EXPECT_NE(run.output.find(c.says), std::string::npos) << c.args << "\n" << run.output;
  }
}

}  // namespace
