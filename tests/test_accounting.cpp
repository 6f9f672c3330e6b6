// The library's own accounting (issue: instrumentation) against the paper's analytic numbers, on
// the tiny GPT (2 block units + a root unit holding the tied embedding/head, ln_f, pos_emb).
//
// Per rank, with unit sizes ψ_i, padded sizes P_i (bytes S_i = 4·P_i), F the sharding factor,
// R = W/F replicas, and the ring convention (all-gather/reduce-scatter (G-1)/G·S, all-reduce
// 2(G-1)/G·S over a group of G ranks), one training step moves:
//   FULL_SHARD / HYBRID_SHARD (reshard after forward; the root stays gathered until after backward)
//     all-gather     (F-1)/F · (Σ_i S_i + Σ_{i not root} S_i)     forward, then backward again
//     reduce-scatter (F-1)/F · Σ_i S_i
//     all-reduce     2(R-1)/R · Σ_i S_i/F                           gradient shards across replicas
//   SHARD_GRAD_OP / HYBRID_SHARD_ZERO2: all-gather (F-1)/F · Σ_i S_i (once), the rest as above
//   NO_SHARD (F = 1): all-reduce 2(W-1)/W · Σ_i S_i, nothing else
// Resident sharded parameters = Σ_i ceil(ψ_i/F)·4 bytes. Peak unsharded parameter bytes, with
// resharding after forward, stay within the two largest units (the root is kept, plus the one
// computing) without backward prefetch, and within the three largest with BACKWARD_PRE (one more
// unit gathered ahead, §3.3.2); without resharding they equal Σ_i S_i (all gathered until backward).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "dist_test_util.h"

namespace {

struct AccountingCase {
  std::string strategy;
  int world;
  int shard_size;
  std::string backward_prefetch = "backward_pre";
};

void PrintTo(const AccountingCase& c, std::ostream* os) {
  *os << c.strategy << " W=" << c.world << " " << c.backward_prefetch;
}

class Accounting : public testing::TestWithParam<AccountingCase> {};

TEST_P(Accounting, MatchesAnalyticVolumesAndMemory) {
  const auto& c = GetParam();
  const std::string out = fsdp_test::temp_prefix("acct-" + c.strategy + std::to_string(c.world));
  std::string cmd = fsdp_test::worker() + " accounting --nproc-per-node " + std::to_string(c.world) +
                    " --strategy " + c.strategy + " --backward-prefetch " + c.backward_prefetch + " --out " + out;
  if (c.shard_size) cmd += " --shard-size " + std::to_string(c.shard_size);
  auto run = fsdp_test::sh(cmd);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (int r = 0; r < c.world; ++r) {
    auto j = fsdp_test::read_json(out + "." + std::to_string(r) + ".json");
    const int64_t W = c.world, F = j["shard_size"].get<int64_t>(), R = W / F;
    const bool reshard_after_forward = c.strategy == "full_shard" || c.strategy == "hybrid_shard";
    int64_t sum_s = 0, sum_nonroot = 0, resident = 0;
    std::vector<int64_t> sizes;
    for (const auto& u : j["units"]) {
      const int64_t numel = u["numel"], padded = u["padded_numel"];
      ASSERT_EQ(padded % F, 0);
      ASSERT_EQ(padded, (numel + F - 1) / F * F);
      sum_s += 4 * padded;
      if (!u["is_root"].get<bool>()) sum_nonroot += 4 * padded;
      resident += 4 * ((numel + F - 1) / F);
      sizes.push_back(4 * padded);
    }
    std::sort(sizes.rbegin(), sizes.rend());
    int64_t ag = 0, rs = 0, ar = 0;
    if (F > 1) {
      ag = (F - 1) * (reshard_after_forward ? sum_s + sum_nonroot : sum_s) / F;
      rs = (F - 1) * sum_s / F;
    }
    if (R > 1) ar = 2 * (R - 1) * (sum_s / F) / R;
    // Step 0 and step 1 (after an optimizer step) must both match.
    for (const auto& step : j["steps"]) {
      const std::string what = "rank " + std::to_string(r) + " " + step.dump();
      EXPECT_EQ(step["all_gather"].get<int64_t>(), ag) << what;
      EXPECT_EQ(step["reduce_scatter"].get<int64_t>(), rs) << what;
      EXPECT_EQ(step["all_reduce"].get<int64_t>(), ar) << what;
      EXPECT_EQ(step["sharded_params"].get<int64_t>(), resident) << what;
      EXPECT_EQ(step["sharded_grads"].get<int64_t>(), resident) << what;
      EXPECT_EQ(step["unsharded_current"].get<int64_t>(), 0) << what;  // everything freed after the step
      if (F == 1) {
        EXPECT_EQ(step["unsharded_peak"].get<int64_t>(), 0) << what;  // replication allocates nothing extra
      } else if (reshard_after_forward) {
        const int64_t ahead = c.backward_prefetch == "none" ? 0 : sizes[2];
        EXPECT_LE(step["unsharded_peak"].get<int64_t>(), sizes[0] + sizes[1] + ahead) << what;
        EXPECT_GE(step["unsharded_peak"].get<int64_t>(), sizes[0]) << what;
      } else {
        EXPECT_EQ(step["unsharded_peak"].get<int64_t>(), sum_s) << what;
      }
    }
    // fsdp::plan_memory, computed from the shapes alone, predicts what the run holds.
    const auto& plan = j["plan"];
    EXPECT_EQ(plan["shard_size"].get<int64_t>(), F);
    EXPECT_EQ(plan["sharded_params"].get<int64_t>(), resident);
    EXPECT_EQ(plan["sharded_grads"].get<int64_t>(), resident);
    for (const auto& step : j["steps"]) {
      EXPECT_LE(step["unsharded_peak"].get<int64_t>(), plan["peak_unsharded_params"].get<int64_t>()) << step.dump();
    }
    std::remove((out + "." + std::to_string(r) + ".json").c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, Accounting,
                         testing::Values(AccountingCase{"full_shard", 3, 0}, AccountingCase{"full_shard", 4, 0},
                                         AccountingCase{"full_shard", 4, 0, "none"},
                                         AccountingCase{"shard_grad_op", 3, 0}, AccountingCase{"no_shard", 2, 0},
                                         AccountingCase{"hybrid_shard", 4, 2},
                                         AccountingCase{"hybrid_shard_zero2", 4, 2}),
                         [](const testing::TestParamInfo<AccountingCase>& i) {
                           return i.param.strategy + "_W" + std::to_string(i.param.world) +
                                  (i.param.backward_prefetch == "none" ? "_no_prefetch" : "");
                         });

}  // namespace

namespace {

// What knowing when units run costs, counted (Metrics::detection, `operator_calls_into_fsdp` in the
// JSONL, `operator_calls_into_fsdp` on each unit's forward and backward span of the trace), run as a
// user runs fsdp-train: with the dispatch key only operators on parameters enter fsdp, a fraction
// of what the RecordFunction callback sees (every operator of the passes), and the math is the same.
TEST(Detection, OnlyOperatorsOnParametersEnterFsdp) {
  for (const std::string launch : {"--nproc-per-node 1", "--nproc-per-node 2 --strategy full_shard",
                                   "--nproc-per-node 2 --strategy shard_grad_op --mixed-precision bf16"}) {
    struct Run {
      std::vector<double> losses;
      double in_passes = 0, at_rest = 0, in_spans = 0;
    };
    auto run = [&](const std::string& mode) {
      const std::string prefix = fsdp_test::temp_prefix("detection-" + mode);
      const std::string metrics = prefix + ".jsonl", trace = prefix + "-trace";
      std::remove(metrics.c_str());
      const auto r = fsdp_test::sh(fsdp_test::fsdp_train() + " --model tiny --steps 4 --global-batch-size 8 " +
                                   "--log-every 100 --unit-detection " + mode + " --trace " + trace +
                                   " --trace-step 2 --metrics-jsonl " + metrics + " " + launch);
      EXPECT_EQ(r.exit_code, 0) << r.output;
      Run out;
      for (const auto& j : fsdp_test::read_jsonl(metrics)) {
        if (j["rank"] != 0) continue;
        out.losses.push_back(j["loss"].get<double>());
        if (j["step"] == 2) {
          out.in_passes = j["operator_calls_into_fsdp"]["in_passes"].get<double>();
          out.at_rest = j["operator_calls_into_fsdp"]["at_rest"].get<double>();
        }
      }
      const nlohmann::json doc = fsdp_test::read_json(trace + "/trace-rank0.json");
      for (const auto& e : doc["traceEvents"]) {
        if (e.contains("args") && e["args"].contains("operator_calls_into_fsdp")) {
          out.in_spans += e["args"]["operator_calls_into_fsdp"].get<double>();
        }
      }
      std::remove(metrics.c_str());
      std::filesystem::remove_all(trace);
      return out;
    };
    const Run key = run("dispatch_key"), callback = run("record_function");
    EXPECT_EQ(key.losses, callback.losses) << launch;
    EXPECT_GT(key.in_passes, 0) << launch;
    EXPECT_LT(key.in_passes * 5, callback.in_passes) << launch << ": " << key.in_passes << " vs " << callback.in_passes;
    // The optimizer's updates of this rank's parameters (the same in both modes).
    EXPECT_GT(key.at_rest, 0) << launch;
    // The trace attributes the step's calls to the units' spans (the root's: every operator on its
    // parameters, e.g. the embedding, the head and ln_f).
    EXPECT_GT(key.in_spans, 0) << launch;
    EXPECT_LE(key.in_spans, key.in_passes) << launch;
  }
}

}  // namespace
