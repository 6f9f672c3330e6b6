// What a rank holds, measured by the system and by the allocator rather than by fsdp's counters
// (issue 10): the memory plan against the measured peak of live tensor bytes, sharding against
// replication in anonymous resident memory, and the budget that refuses what cannot fit.
//
// Every case runs fsdp-train, as a user would, and reads the per-phase memory it logs.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;

using fsdp_test::read_jsonl;

struct TrainRun {
  fsdp_test::Run run;
  std::vector<json> rows;
};

TrainRun train(const std::string& name, const std::string& args, int timeout_s = 300) {
  const std::string metrics = fsdp_test::temp_prefix("memory-" + name) + ".jsonl";
  std::remove(metrics.c_str());
  TrainRun t;
  t.run = fsdp_test::sh(fsdp_test::fsdp_train() + " --log-every 100 --metrics-jsonl " + metrics + " " + args,
                        timeout_s);
  t.rows = read_jsonl(metrics);
  std::remove(metrics.c_str());
  return t;
}

struct PlanCase;
void PrintTo(const PlanCase& c, std::ostream* os);

struct PlanCase {
  std::string model, strategy;
  int world;
  std::string extra;  // more flags (--shard-size, --mixed-precision)
  std::string name() const {
    std::string n = model + "_" + strategy + "_W" + std::to_string(world);
    if (extra.find("--tp 2") != std::string::npos) n += "_tp2";
    if (extra.find("--sequence-parallel") != std::string::npos) n += "_sp";
    if (extra.find("--activation-checkpointing") != std::string::npos) n += "_ac";
    if (extra.find("bf16") != std::string::npos) n += "_bf16";
    return n;
  }
};

void PrintTo(const PlanCase& c, std::ostream* os) { *os << c.name(); }

// The plan (state, gathered units, reduction buffers, activations) against the peak of live tensor
// bytes the ranks measured through a step, above what they held before building the model. Steps
// from the second on: the first has no Adam state before its optimizer step.
void check_plan(const PlanCase& c) {
  const std::string launch = c.strategy == "local" ? "--local" : "--nproc-per-node " + std::to_string(c.world) +
                                                                     " --strategy " + c.strategy;
  // The medium preset in bf16 runs at a few hundred tokens per second on this 2-core machine.
  const int timeout_s = c.model == "medium" ? 850 : 300;
  const auto t = train(c.name(), "--model " + c.model + " --steps 3 --global-batch-size 8 " + launch + " " + c.extra,
                       timeout_s);
  ASSERT_EQ(t.run.exit_code, 0) << t.run.output;
  ASSERT_FALSE(t.rows.empty());
  // The highest peak of any rank in any step: what the plan must provide for (ranks differ by
  // the timing of their reductions in flight).
  double measured = 0, plan = 0;
  std::string where;
  for (const json& r : t.rows) {
    if (r["step"].get<int>() < 1) continue;
    const json& m = r["memory"];
    plan = m["plan_bytes"].get<double>();
    const double peak = m["peak_live_tensor_bytes"].get<double>() - m["live_before_model"].get<double>();
    if (peak > measured) {
      measured = peak;
      where = "rank " + r["rank"].dump() + " step " + r["step"].dump();
    }
  }
  EXPECT_NEAR(measured, plan, 0.10 * plan)
      << c.name() << ": measured peak " << measured / 1e6 << " MB (" << where << "), plan " << plan / 1e6 << " MB";
}

class PlanAgainstMeasured : public testing::TestWithParam<PlanCase> {};
TEST_P(PlanAgainstMeasured, WithinTenPercent) { check_plan(GetParam()); }

std::vector<PlanCase> plan_cases(bool long_run) {
  std::vector<PlanCase> out;
  const std::vector<std::string> models = long_run ? std::vector<std::string>{"tiny", "small", "default", "medium"}
                                                   : std::vector<std::string>{"small", "default"};
  for (const auto& model : models) {
    for (const std::string mp : {"", "--mixed-precision bf16"}) {
      if (mp.empty()) out.push_back({model, "local", 1, ""});
      for (int W : long_run ? std::vector<int>{1, 2, 4} : std::vector<int>{2, 4}) {
        for (const std::string s : {"full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"}) {
          const bool hybrid = s.rfind("hybrid", 0) == 0;
          if (hybrid && W != 4) continue;  // the real hybrid path: F = 2 of W = 4
          if (!long_run && !hybrid && W == 4 && s != "full_shard") continue;
          out.push_back({model, s, W, (hybrid ? "--shard-size 2 " : "") + mp});
        }
      }
      // Tensor parallelism: TP 2 x DP 2, against fsdp alone at the same W (the case above).
      out.push_back({model, "full_shard", 4, "--tp 2 " + mp});
      // With sequence parallelism: the activations between the split layers a chunk of the sequence.
      if (mp.empty() || long_run) out.push_back({model, "full_shard", 4, "--tp 2 --sequence-parallel " + mp});
      // And with activation checkpointing: the long run only, from 'small' up. Its measured peak
      // moves by a block's gathered parameters with the timing of the reductions in flight
      // (default, fp32: 24.4 to 27.4 MB over repeated runs against a plan of 24.8), and tiny's
      // checkpointed activations are below that noise.
      if (long_run && model != "tiny") {
        out.push_back({model, "full_shard", 4, "--tp 2 --sequence-parallel --activation-checkpointing " + mp});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Presets, PlanAgainstMeasured, testing::ValuesIn(plan_cases(false)),
                         [](const testing::TestParamInfo<PlanCase>& i) { return i.param.name(); });

// The whole matrix (tiny to medium, W = 1, 2, 4, every strategy, fp32 and bf16): label "long".
class PlanAgainstMeasuredLong : public testing::TestWithParam<PlanCase> {};
TEST_P(PlanAgainstMeasuredLong, WithinTenPercent) { check_plan(GetParam()); }
INSTANTIATE_TEST_SUITE_P(AllPresets, PlanAgainstMeasuredLong, testing::ValuesIn(plan_cases(true)),
                         [](const testing::TestParamInfo<PlanCase>& i) { return i.param.name(); });

// The paper's promise, measured by the kernel: a full_shard rank holds less than a no_shard rank
// by most of the state that sharding removes, and at the end of backward only the reductions in
// flight hold unsharded gradients.
TEST(Memory, ShardedRankHoldsLessThanReplicatedRank) {
  const std::string common = "--model medium --nproc-per-node 4 --global-batch-size 8 --steps 3";
  auto peak_anon = [](const std::vector<json>& rows) {
    int64_t peak = 0;
    for (const json& r : rows) {
      for (const char* phase : {"after_construction", "after_forward", "after_backward", "after_step"}) {
        peak = std::max(peak, r["memory"][phase]["anon_resident_bytes"].get<int64_t>());
      }
    }
    return peak;
  };
  const auto full = train("full", common + " --strategy full_shard");
  ASSERT_EQ(full.run.exit_code, 0) << full.run.output;
  const auto none = train("none", common + " --strategy no_shard");
  ASSERT_EQ(none.run.exit_code, 0) << none.run.output;
  const int64_t plan_full = full.rows.at(0)["memory"]["plan_bytes"].get<int64_t>();
  const int64_t plan_none = none.rows.at(0)["memory"]["plan_bytes"].get<int64_t>();
  const int64_t saved = peak_anon(none.rows) - peak_anon(full.rows);
  EXPECT_GE(saved, 0.7 * static_cast<double>(plan_none - plan_full))
      << "full_shard peak anonymous resident " << peak_anon(full.rows) / 1e6 << " MB, no_shard "
      << peak_anon(none.rows) / 1e6 << " MB; the plans differ by " << (plan_none - plan_full) / 1e6 << " MB";
  for (const json& r : full.rows) {
    EXPECT_LE(r["reductions_in_flight_at_backward_end"].get<int64_t>(), 2) << r.dump();
    // A medium unit's padded gradients are 12.6 MB (3.15 M fp32 elements): at most two in flight.
    EXPECT_LE(r["reducing_grads_at_backward_end"].get<int64_t>(), 2 * 13'000'000) << r.dump();
  }
}

// A configuration that cannot fit is refused on every rank before anything is built, in seconds,
// with the plan's rows and a configuration that would fit.
TEST(Memory, BudgetRefusesTheBillionParameterModelInSeconds) {
  const auto t = train("1b", "--model 1b --nproc-per-node 4 --global-batch-size 4 --block-size 128 --steps 1 "
                             "--max-memory-per-rank 4GiB",
                       120);
  EXPECT_NE(t.run.exit_code, 0) << t.run.output;
  EXPECT_LT(t.run.seconds, 60.0) << t.run.output;
  EXPECT_NE(t.run.output.find("over the budget of 4.00 GiB per rank"), std::string::npos) << t.run.output;
  EXPECT_NE(t.run.output.find("Adam state"), std::string::npos) << t.run.output;
  EXPECT_NE(t.run.output.find("Would fit: "), std::string::npos) << t.run.output;
  EXPECT_TRUE(t.rows.empty());  // no step ran
}

TEST(Memory, BudgetRefusesLocalTrainingThatShardingFits) {
  const auto local = train("local-cap", "--model medium --local --global-batch-size 2 --steps 1 "
                                        "--max-memory-per-rank 400MiB");
  EXPECT_NE(local.run.exit_code, 0) << local.run.output;
  EXPECT_NE(local.run.output.find("Would fit: sharding over at least"), std::string::npos) << local.run.output;
  const auto sharded = train("sharded-cap", "--model medium --nproc-per-node 4 --strategy full_shard "
                                            "--global-batch-size 8 --steps 1 --max-memory-per-rank 400MiB");
  EXPECT_EQ(sharded.run.exit_code, 0) << sharded.run.output;
}

TEST(Memory, BadBudgetIsExplained) {
  const auto u = train("bad2", "--model tiny --local --steps 1 --max-memory-per-rank lots");
  EXPECT_NE(u.run.exit_code, 0);
  EXPECT_NE(u.run.output.find("is not a size"), std::string::npos) << u.run.output;
}

}  // namespace

namespace {

// The paper's promise under a real cap: each rank in its own memory cgroup of 1100 MiB (emulating
// four devices of that size), the 50 M-parameter GPT trains with full_shard (about 780 MiB
// charged), while no_shard, whose unsharded state does not fit (about 1140 MiB charged at its peak),
// is refused by the budget in seconds (bench/capped_ranks; without
// the check the kernel kills every rank, docs/performance.md).
TEST(Memory, UnderAPerRankCapShardingTrainsAndReplicationIsRefused) {
  const std::string capped = std::string(FSDP_SOURCE_DIR) + "/bench/capped_ranks 1100M 4 " + fsdp_test::fsdp_train() +
                             " --model large --global-batch-size 4 --steps 3 --log-every 1 ";
  const auto probe = fsdp_test::sh(std::string(FSDP_SOURCE_DIR) + "/bench/capped_ranks 64M 1 true", 30);
  if (probe.exit_code != 0) GTEST_SKIP() << "no writable memory cgroup here: " << probe.output;
  const auto full = fsdp_test::sh(capped + "--strategy full_shard", 300);
  EXPECT_EQ(full.exit_code, 0) << full.output;
  EXPECT_NE(full.output.find("step    2"), std::string::npos) << full.output;
  const auto none = fsdp_test::sh(capped + "--strategy no_shard", 120);
  EXPECT_NE(none.exit_code, 0) << none.output;
  EXPECT_EQ(none.output.find("killed"), std::string::npos) << "refused, not killed: " << none.output;
  EXPECT_NE(none.output.find("over the budget"), std::string::npos) << none.output;
  EXPECT_NE(none.output.find("Would fit: strategy full_shard"), std::string::npos) << none.output;
  EXPECT_LT(none.seconds, 60.0) << none.output;
}

}  // namespace

namespace {

// One rank of a bigger job, alone in this process (fsdp-train --simulate-rank): the pre-flight
// check a user runs before booking W devices. Against the same rank of a real 4-rank run: the
// same shards, the same collectives issued, and a measured peak no higher than the real one
// (stand-in collectives complete at once, so no reduction stays in flight) and not far below it.
TEST(Memory, SimulatedRankHoldsWhatTheRealRankHolds) {
  const std::string args = "--model small --steps 3 --global-batch-size 8 --strategy full_shard ";
  const auto real = train("sim-real", args + "--nproc-per-node 4");
  ASSERT_EQ(real.run.exit_code, 0) << real.run.output;
  const auto sim = train("sim", args + "--simulate-rank 2 --world-size 4");
  ASSERT_EQ(sim.run.exit_code, 0) << sim.run.output;
  EXPECT_NE(sim.run.output.find("SIMULATED rank 2 of 4"), std::string::npos) << sim.run.output;
  EXPECT_NE(sim.run.output.find("NOT trained results"), std::string::npos) << sim.run.output;
  EXPECT_NE(sim.run.output.find("[SIMULATED] step"), std::string::npos) << sim.run.output;
  auto row_of = [](const std::vector<json>& rows, int rank, int step) {
    for (const auto& r : rows) {
      if (r["rank"] == rank && r["step"] == step) return r;
    }
    return json();
  };
  const json a = row_of(real.rows, 2, 2), b = row_of(sim.rows, 2, 2);
  ASSERT_FALSE(a.is_null());
  ASSERT_FALSE(b.is_null()) << sim.run.output;
  EXPECT_TRUE(b.value("simulated", false));
  EXPECT_EQ(a["param_bytes_resident"], b["param_bytes_resident"]);
  EXPECT_EQ(a["grad_bytes_resident"], b["grad_bytes_resident"]);
  EXPECT_EQ(a["comm_calls"], b["comm_calls"]);
  EXPECT_EQ(a["comm_bytes"], b["comm_bytes"]);
  EXPECT_EQ(a["memory"]["plan_bytes"], b["memory"]["plan_bytes"]);
  const double real_peak = a["memory"]["peak_live_tensor_bytes"].get<double>() - a["memory"]["live_before_model"].get<double>();
  const double sim_peak = b["memory"]["peak_live_tensor_bytes"].get<double>() - b["memory"]["live_before_model"].get<double>();
  EXPECT_LE(sim_peak, real_peak * 1.02) << "simulated " << sim_peak << " real " << real_peak;
  EXPECT_GE(sim_peak, real_peak * 0.75) << "simulated " << sim_peak << " real " << real_peak;
  // A job that cannot exist is refused clearly.
  const auto bad = train("sim-bad", args + "--simulate-rank 4 --world-size 4");
  EXPECT_NE(bad.run.exit_code, 0);
  EXPECT_NE(bad.run.output.find("the rank must be in [0, world size)"), std::string::npos) << bad.run.output;
}

// A 64-rank job's rank on this machine: the 200m GPT's shard and a step's real peak, in seconds.
TEST(Memory, SimulatedRankOfASixtyFourRankJob) {
  const auto sim = train("sim64", "--model 200m --block-size 64 --steps 2 --global-batch-size 64 --strategy full_shard "
                                  "--simulate-rank 63 --world-size 64 --ranks-per-node 8",
                         600);
  ASSERT_EQ(sim.run.exit_code, 0) << sim.run.output;
  ASSERT_FALSE(sim.rows.empty());
  const json& r = sim.rows.back();
  // 203 M parameters over 64 ranks: about 3.2 M fp32 elements of shard, 12.7 MB.
  EXPECT_LT(r["param_bytes_resident"].get<double>(), 14e6) << r.dump();
  EXPECT_GT(r["param_bytes_resident"].get<double>(), 12e6) << r.dump();
  // Gathered at once: the root unit (the 51 M-parameter embedding, 205 MB) and two blocks (50 MB
  // each: the one computing and the one prefetched), nothing more.
  EXPECT_NEAR(r["peak_unsharded_bytes"].get<double>(), 306e6, 2e6) << r.dump();
  // The plan bounds the measured peak: it also counts the reductions a real rank has in flight
  // (up to two reduce buffers of the largest unit, the root's), which a simulated rank's
  // collectives, over at once, never hold.
  const double peak = r["memory"]["peak_live_tensor_bytes"].get<double>() - r["memory"]["live_before_model"].get<double>();
  EXPECT_LT(peak, r["memory"]["plan_bytes"].get<double>()) << r.dump();
  EXPECT_GT(peak, r["peak_unsharded_bytes"].get<double>()) << r.dump();

  // Where a whole step would take too long: time 2 of the 12 blocks, keep the whole model's plan,
  // and estimate the step's compute from the sample.
  const auto sample = train("sim64-sample", "--model 200m --block-size 64 --steps 3 --global-batch-size 64 "
                                            "--strategy full_shard --simulate-rank 63 --world-size 64 --ranks-per-node 8 "
                                            "--simulate-layers 2",
                            600);
  ASSERT_EQ(sample.run.exit_code, 0) << sample.run.output;
  EXPECT_NE(sample.run.output.find("SIMULATED: timed 2 of 12 blocks: median step"), std::string::npos) << sample.run.output;
  EXPECT_NE(sample.run.output.find("would compute for about"), std::string::npos) << sample.run.output;
  const json& s = sample.rows.back();
  EXPECT_EQ(s["memory"]["plan_bytes"], r["memory"]["plan_bytes"]) << "the plan is the whole model's";
  EXPECT_LT(s["param_bytes_resident"].get<double>(), r["param_bytes_resident"].get<double>());
  EXPECT_EQ(s["simulated_layers"]["of"], 12);
}

}  // namespace
