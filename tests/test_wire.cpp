// Less on the wire (issue 26): fsdp's ring reduce-scatter on Gloo, hpZ (reshard after forward to a
// smaller group) and quantized all-gathers, through fsdp-train and the worker as users call them.
// Exact modes are held to local training (and hpZ to full_shard bit for bit: backward computes
// with the very values forward did); quantized modes to a stated bound. What crosses the hosts is
// measured on the emulated cluster (test_cluster.cpp).
#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

using fsdp_test::expect_same_losses;
using fsdp_test::main_job;

// The ring is the default on the CPU, so every parity test runs it; here it is held against local
// training and against Gloo's own reduce-scatter (an all-reduce of the whole input), which sums in
// another order: both within 1e-5 of local, each strategy that reduce-scatters.
TEST(Wire, RingReduceScatterTrainsLikeLocal) {
  for (const std::string model : {"tiny", "t5-tiny"}) {
    const std::string common = "--model " + model + " --global-batch-size 12";
    const auto local = main_job(common + " --local", 5).losses;
    for (const std::string launch : {"--nproc-per-node 2 --strategy full_shard", "--nproc-per-node 3 --strategy full_shard",
                                     "--nproc-per-node 4 --strategy shard_grad_op",
                                     "--nproc-per-node 4 --strategy hybrid_shard --shard-size 2"}) {
      const auto ring = main_job(common + " " + launch, 5);
      const auto gloo = main_job(common + " " + launch + " --gloo-reduce-scatter all_reduce", 5);
      expect_same_losses(ring.losses, local, 1e-5, model + " ring " + launch);
      expect_same_losses(gloo.losses, local, 1e-5, model + " all_reduce " + launch);
      // What fsdp counts is the ring convention either way; the wire differs (test_cluster.cpp).
      EXPECT_EQ(ring.last["comm_bytes"]["reduce_scatter"], gloo.last["comm_bytes"]["reduce_scatter"]) << launch;
    }
  }
}

// hpZ: backward gathers the secondary shards forward left, within groups of 2 of the 4 ranks. The
// values are the ones forward gathered, so the run equals full_shard's bit for bit (fp32 and bf16,
// with activation checkpointing, whose recomputation gathers in backward too), and local training
// within 1e-5; backward's all-gathers move half a unit per rank instead of three quarters.
TEST(Wire, HpzComputesExactlyWhatFullShardComputes) {
  for (const std::string model : {"tiny", "t5-tiny"}) {
    const std::string common = "--model " + model + " --global-batch-size 12 --nproc-per-node 4 --strategy full_shard";
    const auto local = main_job("--model " + model + " --global-batch-size 12 --local", 5).losses;
    for (const std::string extra : {"", " --mixed-precision bf16", " --activation-checkpointing"}) {
      const auto base = main_job(common + extra, 5);
      const auto hpz = main_job(common + extra + " --reshard-after-forward-to 2", 5);
      ASSERT_EQ(hpz.losses.size(), base.losses.size());
      for (size_t s = 0; s < base.losses.size(); ++s) {
        EXPECT_EQ(hpz.losses[s], base.losses[s]) << model << extra << " step " << s;
      }
      if (extra.find("bf16") == std::string::npos) expect_same_losses(hpz.losses, local, 1e-5, model + " hpz" + extra);
      const double ag_base = base.last["comm_bytes"]["all_gather"].get<double>();
      const double ag_hpz = hpz.last["comm_bytes"]["all_gather"].get<double>();
      EXPECT_LT(ag_hpz, 0.9 * ag_base) << model << extra;
      // The secondary shards are held from forward to backward: the gathered peak grows.
      EXPECT_GT(hpz.last["peak_unsharded_bytes"].get<double>(), base.last["peak_unsharded_bytes"].get<double>()) << model << extra;
    }
  }
}

// hpZ per unit (FSDP2's reshard_after_forward per fully_shard call): only blocks.0 keeps a
// secondary shard, or every unit but blocks.1: the same losses as full_shard bit for bit, and
// backward's all-gather bytes between none and all units' secondary gathers. A name that is no
// unit is refused with the units' names.
TEST(Wire, HpzPerUnitKeepsSecondaryShardsOnlyWhereAsked) {
  // Every unit resharded after forward, as hpZ's baseline (fsdp-train keeps the last block by default).
  const std::string common = "--model tiny --global-batch-size 12 --nproc-per-node 4 --strategy full_shard "
                             "--keep-gathered-after-forward none";
  const auto base = main_job(common, 4);
  const auto all = main_job(common + " --reshard-after-forward-to 2", 4);
  const auto first = main_job(common + " --reshard-after-forward-to-unit blocks.0=2", 4);
  const auto not_second = main_job(common + " --reshard-after-forward-to 2 --reshard-after-forward-to-unit blocks.1=0", 4);
  for (size_t s = 0; s < base.losses.size(); ++s) {
    EXPECT_EQ(first.losses[s], base.losses[s]) << "step " << s;
    EXPECT_EQ(not_second.losses[s], base.losses[s]) << "step " << s;
  }
  auto ag = [](const fsdp_test::MainJob& j) { return j.last["comm_bytes"]["all_gather"].get<double>(); };
  EXPECT_LT(ag(first), ag(base));
  EXPECT_GT(ag(first), ag(all));
  EXPECT_EQ(ag(first), ag(not_second));  // the two blocks have the same shapes
  const auto bad = fsdp_test::sh(fsdp_test::fsdp_train() + " " + common + " --steps 1 --reshard-after-forward-to-unit block.7=2");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("reshard_after_forward_to_by_unit names 'block.7', which is no unit of this model; its units "
                            "are"), std::string::npos) << bad.output;
}

// Issue 38: the unit backward needs first (the last block) kept gathered after forward
// (Options::keep_gathered_after_forward, FSDP2's reshard_after_forward=False on one module, as
// torchtitan does): the same losses as full_shard bit for bit, with and without activation
// checkpointing and under hybrid sharding; one block's all-gather fewer per step, the same gathered
// peak (backward holds that block and the next anyway), and none of backward's exposed all-gather
// wait is for it. Names that are no unit, a strategy that keeps every unit, and hpZ on the same
// unit are refused by name. fsdp-train does it by default ("last"): its default run is the kept one,
// and "none" is FSDP1's schedule.
TEST(Wire, KeepingTheLastBlockGatheredSavesBackwardsFirstAllGather) {
  for (const std::string extra : {" --strategy full_shard", " --strategy full_shard --activation-checkpointing",
                                  " --strategy hybrid_shard --shard-size 2"}) {
    const std::string common = "--model tiny --global-batch-size 12 --nproc-per-node 4" + extra;
    const auto base = main_job(common + " --keep-gathered-after-forward none", 4);
    const auto kept = main_job(common + " --keep-gathered-after-forward blocks.1", 4);  // tiny: blocks.0, blocks.1
    const auto by_default = main_job(common, 4);
    EXPECT_EQ(by_default.last["comm_calls"], kept.last["comm_calls"]) << extra << ": the default keeps the last block";
    EXPECT_EQ(by_default.last["comm_bytes"], kept.last["comm_bytes"]) << extra;
    EXPECT_EQ(by_default.losses, kept.losses) << extra;
    for (size_t s = 0; s < base.losses.size(); ++s) EXPECT_EQ(kept.losses[s], base.losses[s]) << extra << " step " << s;
    auto ag = [](const fsdp_test::MainJob& j) { return j.last["comm_bytes"]["all_gather"].get<double>(); };
    auto calls = [](const fsdp_test::MainJob& j) { return j.last["comm_calls"]["all_gather"].get<double>(); };
    EXPECT_LT(ag(kept), ag(base)) << extra;
    EXPECT_EQ(calls(kept), calls(base) - 1) << extra << ": one gather fewer (blocks.1's in backward)";
    EXPECT_EQ(kept.last["peak_unsharded_bytes"], base.last["peak_unsharded_bytes"]) << extra;
  }
  const std::string tiny = fsdp_test::fsdp_train() + " --model tiny --steps 1 --nproc-per-node 2";
  const auto bad = fsdp_test::sh(tiny + " --keep-gathered-after-forward block.1");
  EXPECT_NE(bad.output.find("keep_gathered_after_forward names 'block.1', which is no unit of this model; its units are"),
            std::string::npos) << bad.output;
  const auto zero2 = fsdp_test::sh(tiny + " --strategy shard_grad_op --keep-gathered-after-forward blocks.1");
  EXPECT_NE(zero2.output.find("which keeps every unit gathered after forward already"), std::string::npos) << zero2.output;
  const auto hpz = fsdp_test::sh(tiny + " --reshard-after-forward-to-unit blocks.1=1 --keep-gathered-after-forward blocks.1");
  EXPECT_NE(hpz.output.find("a unit kept whole needs no secondary shard"), std::string::npos) << hpz.output;
  const auto none_and_more = fsdp_test::sh(tiny + " --keep-gathered-after-forward none,blocks.1");
  EXPECT_NE(none_and_more.output.find("--keep-gathered-after-forward none keeps no unit gathered: give it alone"),
            std::string::npos) << none_and_more.output;
  const auto empty = fsdp_test::sh(tiny + " --keep-gathered-after-forward \"\"");
  EXPECT_NE(empty.output.find("--keep-gathered-after-forward was given an empty value"), std::string::npos)
      << empty.output;  // not the root unit ''
  EXPECT_NE(bad.output.find("'blocks.1', '' (the root unit)"), std::string::npos) << bad.output;
  // "--flag=" with nothing after the '=': the command-line library took the next flag as its value
  // ("keep_gathered_after_forward names '--steps'").
  const auto swallowed = fsdp_test::sh(fsdp_test::fsdp_train() + " --model tiny --keep-gathered-after-forward= --steps 1");
  EXPECT_NE(swallowed.exit_code, 0) << swallowed.output;
  EXPECT_NE(swallowed.output.find("--keep-gathered-after-forward= has an empty value: give one"), std::string::npos)
      << swallowed.output;
  EXPECT_EQ(swallowed.output.find("names '--steps'"), std::string::npos) << swallowed.output;
  const auto no_value = fsdp_test::sh(fsdp_test::fsdp_train() + " --model tiny --hpz= --steps 1");
  EXPECT_NE(no_value.output.find("--hpz= takes no value: write --hpz"), std::string::npos) << no_value.output;
  // --save-dir "$DIR" with DIR unset: it saved nothing, silently.
  const auto unset = fsdp_test::sh(fsdp_test::fsdp_train() + " --model tiny --steps 1 --save-every 1 --save-dir \"\"");
  EXPECT_NE(unset.exit_code, 0) << unset.output;
  EXPECT_NE(unset.output.find("--save-dir was given an empty value"), std::string::npos) << unset.output;
  // --plan plans fsdp's units: with --local it printed an fsdp plan that kept blocks.1.
  const auto plan_local = fsdp_test::sh(fsdp_test::fsdp_train() + " --plan --local --keep-gathered-after-forward blocks.1");
  EXPECT_NE(plan_local.output.find("--plan plans fsdp's sharding; --local trains without it"), std::string::npos)
      << plan_local.output;
  for (const auto* r : {&bad, &zero2, &hpz, &none_and_more, &empty, &plan_local}) EXPECT_NE(r->exit_code, 0);
  const auto twice = fsdp_test::sh(tiny + " --keep-gathered-after-forward last,last");  // "last" once
  EXPECT_EQ(twice.exit_code, 0) << twice.output;
  // Where keeping means nothing (a strategy that keeps every unit, hpZ on the last block, local
  // training), the default steps aside: these runs train.
  const std::string tiny_local = fsdp_test::fsdp_train() + " --model tiny --steps 1 --local";
  for (const std::string ok : {tiny + " --strategy shard_grad_op", tiny + " --reshard-after-forward-to-unit blocks.1=1",
                               tiny_local, tiny_local + " --keep-gathered-after-forward none"}) {
    const auto run = fsdp_test::sh(ok);
    EXPECT_EQ(run.exit_code, 0) << ok << "\n" << run.output;
  }
}

// A group that is not a divisor of F, or a strategy that keeps parameters after forward, is refused
// by name before anything runs.
TEST(Wire, HpzThatCannotWorkIsRefusedByName) {
  const auto bad = fsdp_test::sh(fsdp_test::fsdp_train() + " --model tiny --steps 1 --nproc-per-node 4 --reshard-after-forward-to 3");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("reshard_after_forward_to=3 must divide the sharding factor F=4"), std::string::npos) << bad.output;
  const auto zero2 = fsdp_test::sh(fsdp_test::fsdp_train() +
                                   " --model tiny --steps 1 --nproc-per-node 2 --strategy shard_grad_op --reshard-after-forward-to 1");
  EXPECT_NE(zero2.exit_code, 0);
  EXPECT_NE(zero2.output.find("keeps parameters gathered after forward"), std::string::npos) << zero2.output;
}

// hpZ's price is memory, and the memory plan knows it: the 1B GPT at W = 4 fits 7.5 GiB per rank
// (plan: 6.51 GiB) but not with secondary shards of 2 ranks (plan: 8.23 GiB, 1.72 GiB of them); the
// refusal comes before anything is built and says that dropping hpZ would fit.
TEST(Wire, HpzOverTheBudgetIsRefusedWithTheWayOut) {
  const std::string common = " --model 1b --nproc-per-node 4 --global-batch-size 4 --block-size 128 --steps 1 "
                             "--max-memory-per-rank 7.5GiB --reshard-after-forward-to 2";
  const auto run = fsdp_test::sh(fsdp_test::fsdp_train() + common, 120);
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("of which hpZ secondary shards"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("Would fit: without hpZ (reshard_after_forward_to = 0)"), std::string::npos) << run.output;
}

// The quantizer on its own: blocks inside parameters, every element within its bound, zero blocks
// exact, deterministic; inf and NaN kept, the finite values beside them bounded.
TEST(Wire, QuantizerStaysWithinItsBound) {
  for (const std::string q : {"int8", "fp8"}) {
    const auto ranks = fsdp_test::expect_ranks("wire", 1, "--variants quantize --quantize " + q);
    ASSERT_EQ(ranks.size(), 1u);
    const auto& r = ranks[0];
    EXPECT_GT(r["elements"].get<int64_t>(), 10000) << r.dump();
    EXPECT_LE(r["worst_error_over_bound"].get<double>(), 1.0) << q << ": " << r.dump();
    EXPECT_GT(r["worst_error_over_bound"].get<double>(), 0.05) << q << ": a bound never approached is no check: " << r.dump();
    EXPECT_TRUE(r["zero_blocks_exact"].get<bool>()) << r.dump();
    EXPECT_TRUE(r["deterministic"].get<bool>()) << r.dump();
    EXPECT_TRUE(r["blocks_inside_runs"].get<bool>()) << r.dump();
    // Issue 36: a block holding +-inf came back all NaN, and FP8 turned the zeros of a block below
    // ~1.5e-36 into NaN.
    EXPECT_TRUE(r["nonfinite_kept"].get<bool>()) << q << ": " << r.dump();
    EXPECT_TRUE(r["tiny_blocks_finite"].get<bool>()) << q << ": " << r.dump();
    EXPECT_LE(r["nonfinite_blocks_worst_error_over_bound"].get<double>(), 1.0) << q << ": " << r.dump();
  }
}

// Issue 36: an Embedding with max_norm (an in-place write in forward) under the quantized
// all-gather. Seen before the fix: the rows the batch never looked up moved by 0.0106 in three
// forwards (the dequantized copy merged into the fp32 master); now they keep every bit, and the
// rows looked up are renormalized to max_norm (within int8's grid: the write is of what the unit
// computed with).
TEST(Wire, QuantizedAllGatherKeepsTheMasterExactUnderForwardWrites) {
  for (const std::string q : {"int8", "fp8"}) {
    const auto ranks = fsdp_test::expect_ranks("wire", 2, "--variants max_norm --quantize " + q);
    ASSERT_EQ(ranks.size(), 2u);
    for (const auto& r : ranks) {
      EXPECT_EQ(r["untouched_rows_max_change"].get<double>(), 0.0) << q << ": " << r.dump();
      EXPECT_EQ(r["rows_over_max_norm_before"].get<int64_t>(), 32) << r.dump();  // the write is not a no-op
      EXPECT_LE(r["looked_rows_max_norm"].get<double>(), 1.0 + 1e-4) << q << ": " << r.dump();
    }
  }
}

// What the units compute with under an int8 (fp8) all-gather, against the master weights: within
// max|w| / 254 (/ 16) of each parameter's own largest value (blocks never mix parameters: a
// LayerNorm's ones do not swamp the biases beside them), nonzero, and equal to what fsdp reports
// in its metrics.
TEST(Wire, QuantizedAllGatherComputesWithinTheBoundAndSaysHowFar) {
  for (const std::string q : {"int8", "fp8"}) {
    for (int world : {2, 4}) {
      const auto ranks = fsdp_test::expect_ranks("wire", world, "--variants gather --quantize " + q);
      ASSERT_EQ(ranks.size(), static_cast<size_t>(world));
      const double divisor = q == "int8" ? 254.0 : 16.0;
      double metric = 0.0;
      for (const auto& r : ranks) {
        for (const auto& [name, p] : r["params"].items()) {
          EXPECT_LE(p["max_abs_error"].get<double>(), p["max_abs_weight"].get<double>() / divisor * (1 + 1e-5))
              << q << " W=" << world << " " << name;
        }
        EXPECT_GT(r["max_abs_error"].get<double>(), 0.0) << "quantization changed nothing: " << r.dump();
        EXPECT_GT(r["metric_gathers"].get<int64_t>(), 0) << r.dump();
        metric = std::max(metric, r["metric_max_abs_error"].get<double>());
      }
      // Every rank measured its own shards; together they cover every element.
      EXPECT_NEAR(metric, ranks[0]["max_abs_error"].get<double>(), 1e-6 * ranks[0]["max_abs_error"].get<double>())
          << q << " W=" << world;
    }
  }
}

// Training with int8 (fp8) all-gathers: the tiny GPT and T5, 20 steps at W = 4, against fp32
// all-gathers: every loss within 1 % (2 % for fp8); with hpZ on top the same losses as without (backward
// gathers what forward computed with).
TEST(Wire, QuantizedAllGatherTrainsCloseToExact) {
  for (const std::string model : {"tiny", "t5-tiny"}) {
    const std::string common = "--model " + model + " --global-batch-size 12 --nproc-per-node 4 --strategy full_shard";
    const auto exact = main_job(common, 20).losses;
    const auto int8 = main_job(common + " --quantize-all-gather int8", 20).losses;
    const auto fp8 = main_job(common + " --quantize-all-gather fp8", 20).losses;
    expect_same_losses(int8, exact, 1e-2, model + " int8");
    expect_same_losses(fp8, exact, 2e-2, model + " fp8");
    double differs = 0.0;
    for (size_t s = 1; s < exact.size(); ++s) differs = std::max(differs, std::abs(int8[s] - exact[s]));
    EXPECT_GT(differs, 0.0) << model << ": int8 all-gathers changed no loss";
    const auto both = main_job(common + " --quantize-all-gather int8 --reshard-after-forward-to 2", 20).losses;
    for (size_t s = 0; s < both.size(); ++s) EXPECT_EQ(both[s], int8[s]) << model << " step " << s;
  }
}

}  // namespace
