// Overlap of communication with computation (paper §3.3, §3.4), checked on the order of events
// each rank records, never on timings (this machine is shared and noisy).
//
// The model is the tiny GPT with 4 block units b0..b3 and the root unit. Forward runs
// root, b0, b1, b2, b3; backward runs root, b3, b2, b1, b0 (reverse post-forward order).
//   BACKWARD_PRE   b_{i-1}'s all-gather is issued before b_i's backward computation ends and
//                  before b_i's reduce-scatter
//   BACKWARD_POST  it is issued after b_i's backward computation, before b_i's reduce-scatter
//   NONE           it is issued only after b_i's reduce-scatter (when b_{i-1} is reached)
//   forward prefetch   b_{i+1}'s all-gather is issued before b_i's forward computation starts
#include <gtest/gtest.h>

#include <map>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;

struct Events {
  std::map<int, int64_t> fwd_ag, bwd_ag, rs, fwd_begin, bwd_end;  // per unit: the seq of the event
  std::map<std::string, int> unit;                                 // name -> index
  json raw;
};

Events run_overlap(const std::string& flags, int world, int rank = 0) {
  const std::string out = fsdp_test::temp_prefix("overlap");
  auto run = fsdp_test::sh(fsdp_test::worker() + " overlap --nproc-per-node " + std::to_string(world) + " " + flags +
                           " --out " + out);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  Events e;
  if (run.exit_code != 0) return e;
  e.raw = fsdp_test::read_json(out + "." + std::to_string(rank) + ".json");
  for (int r = 0; r < world; ++r) std::remove((out + "." + std::to_string(r) + ".json").c_str());
  for (size_t i = 0; i < e.raw["units"].size(); ++i) e.unit[e.raw["units"][i].get<std::string>()] = static_cast<int>(i);
  for (const auto& s : e.raw["spans"]) {
    const std::string kind = s["kind"];
    const int u = s["unit"];
    const bool bwd = s["backward"];
    const int64_t seq = s["seq"];
    // The first event of each kind per unit and pass (each happens once per step here).
    if (kind == "all-gather") (bwd ? e.bwd_ag : e.fwd_ag).emplace(u, seq);
    if (kind == "reduce-scatter") e.rs.emplace(u, seq);
    if (kind == "forward") e.fwd_begin.emplace(u, seq);
    if (kind == "backward") e.bwd_end.emplace(u, s["end_seq"].get<int64_t>());
  }
  return e;
}

int block(const Events& e, int i) { return e.unit.at("blocks." + std::to_string(i)); }

TEST(Overlap, BackwardPreIssuesNextAllGatherBeforeCurrentReduceScatter) {
  Events e = run_overlap("--backward-prefetch backward_pre", 2);
  ASSERT_EQ(e.unit.size(), 5u);
  for (int i = 3; i >= 1; --i) {
    const int cur = block(e, i), next = block(e, i - 1);
    ASSERT_TRUE(e.bwd_ag.count(next) && e.rs.count(cur) && e.bwd_end.count(cur)) << e.raw.dump();
    EXPECT_LT(e.bwd_ag[next], e.bwd_end[cur]) << "b" << i - 1 << " gathered while b" << i << " computes";
    EXPECT_LT(e.bwd_ag[next], e.rs[cur]) << "b" << i - 1 << "'s all-gather ahead of b" << i << "'s reduce-scatter";
    EXPECT_GT(e.bwd_ag[next], e.bwd_ag[cur]);
  }
}

TEST(Overlap, BackwardPostIssuesNextAllGatherAfterComputeBeforeReduceScatter) {
  Events e = run_overlap("--backward-prefetch backward_post", 2);
  ASSERT_EQ(e.unit.size(), 5u);
  for (int i = 3; i >= 1; --i) {
    const int cur = block(e, i), next = block(e, i - 1);
    ASSERT_TRUE(e.bwd_ag.count(next) && e.rs.count(cur) && e.bwd_end.count(cur)) << e.raw.dump();
    EXPECT_GT(e.bwd_ag[next], e.bwd_end[cur]);
    EXPECT_LT(e.bwd_ag[next], e.rs[cur]);
  }
}

TEST(Overlap, NoPrefetchGathersOnlyWhenReached) {
  Events e = run_overlap("--backward-prefetch none", 2);
  ASSERT_EQ(e.unit.size(), 5u);
  for (int i = 3; i >= 1; --i) {
    const int cur = block(e, i), next = block(e, i - 1);
    ASSERT_TRUE(e.bwd_ag.count(next) && e.rs.count(cur)) << e.raw.dump();
    EXPECT_GT(e.bwd_ag[next], e.rs[cur]);
  }
  for (int i = 0; i < 3; ++i) EXPECT_GT(e.fwd_ag[block(e, i + 1)], e.fwd_begin[block(e, i)]);
}

TEST(Overlap, ForwardPrefetchIssuesNextAllGatherBeforeCurrentComputes) {
  Events e = run_overlap("--forward-prefetch 1", 2);
  ASSERT_EQ(e.unit.size(), 5u);
  for (int i = 0; i < 3; ++i) {
    const int cur = block(e, i), next = block(e, i + 1);
    ASSERT_TRUE(e.fwd_ag.count(next) && e.fwd_begin.count(cur)) << e.raw.dump();
    EXPECT_LT(e.fwd_ag[next], e.fwd_begin[cur]) << "b" << i + 1 << " gathered before b" << i << " computes";
  }
  // Every collective ran after it was issued and finished.
  for (const auto& s : e.raw["spans"]) {
    const std::string kind = s["kind"];
    if (kind != "all-gather" && kind != "reduce-scatter" && kind != "all-reduce") continue;
    EXPECT_GT(s["end_ns"].get<int64_t>(), 0) << s.dump();
    EXPECT_LE(s["begin_ns"].get<int64_t>(), s["start_ns"].get<int64_t>()) << s.dump();
    EXPECT_LE(s["start_ns"].get<int64_t>(), s["end_ns"].get<int64_t>()) << s.dump();
  }
}

TEST(Overlap, RateLimiterBoundsAllGathersInFlight) {
  // Prefetching 3 units ahead in both passes would put 4 all-gathers in flight.
  const std::string deep = "--forward-prefetch 1 --prefetch-count 3 ";
  for (int limit : {1, 2}) {
    Events e = run_overlap(deep + "--limit-all-gathers " + std::to_string(limit), 2);
    EXPECT_EQ(e.raw["max_all_gathers_in_flight"].get<int>(), limit) << "limit " << limit;
  }
  Events off = run_overlap(deep + "--limit-all-gathers 0", 2);
  EXPECT_GE(off.raw["max_all_gathers_in_flight"].get<int>(), 3) << "without the limiter the prefetches pile up";
}

// A model whose unit order changes every iteration (and skips a unit on some) trains with every
// prefetch on and stays equal to local training.
TEST(Overlap, ChangingUnitOrderStaysEqualToLocalTraining) {
  for (std::string flags : {"--backward-prefetch backward_pre --forward-prefetch 1 --prefetch-count 2",
                            "--backward-prefetch backward_post --forward-prefetch 1 --strategy hybrid_shard --shard-size 2"}) {
    const int world = flags.find("hybrid") != std::string::npos ? 4 : 3;
    const std::string out = fsdp_test::temp_prefix("dynamic");
    auto run = fsdp_test::sh(fsdp_test::worker() + " dynamic --nproc-per-node " + std::to_string(world) + " " + flags +
                             " --out " + out);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    for (int r = 0; r < world; ++r) {
      auto j = fsdp_test::read_json(out + "." + std::to_string(r) + ".json");
      EXPECT_LE(j["max_param_diff"].get<double>(), 1e-5) << flags << " rank " << r << " " << j.dump();
      EXPECT_LE(j["max_loss_diff"].get<double>(), 1e-5) << flags << " rank " << r << " " << j.dump();
      std::remove((out + "." + std::to_string(r) + ".json").c_str());
    }
  }
}

// Every prefetch mode keeps the full parity suite's guarantees (tiny GPT and the uneven net,
// SGD and AdamW, two forwards, accumulation, no_sync, clipping).
TEST(Overlap, EveryPrefetchModeMatchesLocalTraining) {
  for (std::string flags : {"--backward-prefetch backward_post --forward-prefetch 1",
                            "--backward-prefetch none --limit-all-gathers 0",
                            "--backward-prefetch backward_pre --forward-prefetch 1 --prefetch-count 2 --limit-all-gathers 1"}) {
    const std::string out = fsdp_test::temp_prefix("overlap-parity");
    auto run = fsdp_test::sh(fsdp_test::worker() + " parity --nproc-per-node 3 --variants all " + flags + " --out " + out);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    for (int r = 0; r < 3; ++r) {
      auto j = fsdp_test::read_json(out + "." + std::to_string(r) + ".json");
      for (const auto& k : j["cases"]) {
        const double tol = k["optim"] == "sgd" ? 1e-5 : 1e-4;
        EXPECT_LE(k["max_param_diff"].get<double>(), tol) << flags << " rank " << r << ": " << k.dump();
        EXPECT_LE(k["max_loss_diff"].get<double>(), 1e-5) << flags << " rank " << r << ": " << k.dump();
        EXPECT_TRUE(k["unused_grad_none"].get<bool>()) << flags << " rank " << r << ": " << k.dump();
      }
      std::remove((out + "." + std::to_string(r) + ".json").c_str());
    }
  }
}

// The training program's --trace: valid Chrome-trace JSON with one compute span per unit per pass
// and one span per collective the step issued.
TEST(Overlap, TrainingTraceHoldsEveryUnitAndCollective) {
  const std::string dir = fsdp_test::temp_prefix("trace");
  const std::string metrics = dir + "-metrics.jsonl";
  auto run = fsdp_test::sh(fsdp_test::fsdp_train() + " --nproc-per-node 2 --model tiny --steps 3 --trace " + dir +
                           " --trace-step 1 --metrics-jsonl " + metrics);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  json calls;
  {
    std::ifstream in(metrics);
    std::string line;
    while (std::getline(in, line)) {
      auto j = json::parse(line);
      if (j["rank"] == 0 && j["step"] == 1) calls = j["comm_calls"];
    }
  }
  ASSERT_FALSE(calls.is_null());
  for (int r = 0; r < 2; ++r) {
    std::ifstream in(dir + "/trace-rank" + std::to_string(r) + ".json");
    ASSERT_TRUE(in.good()) << "no trace for rank " << r;
    const json trace = json::parse(in);  // throws (fails the test) on invalid JSON
    std::map<std::string, int> forward, backward, collectives;
    for (const auto& ev : trace["traceEvents"]) {
      if (ev["ph"] != "X") continue;
      EXPECT_EQ(ev["pid"].get<int>(), r);
      EXPECT_GE(ev["dur"].get<double>(), 0.0);
      const std::string cat = ev["cat"];
      if (cat == "phase") continue;  // the step's phases (PhasesAreTheTracesAndTheirExposedWaits)
      const std::string unit = ev["args"]["unit"];
      if (cat == "forward") ++forward[unit];
      if (cat == "backward") ++backward[unit];
      if (cat == "all-gather" || cat == "reduce-scatter" || cat == "all-reduce") ++collectives[cat];
    }
    for (const std::string unit : {"<root>", "blocks.0", "blocks.1"}) {
      EXPECT_EQ(forward[unit], 1) << unit;
      EXPECT_EQ(backward[unit], 1) << unit;
    }
    if (r == 0) {
      EXPECT_EQ(collectives["all-gather"], calls["all_gather"].get<int>());
      EXPECT_EQ(collectives["reduce-scatter"], calls["reduce_scatter"].get<int>());
      EXPECT_EQ(collectives["all-reduce"], calls["all_reduce"].get<int>());
    }
  }
  std::system(("rm -rf " + dir + " " + metrics).c_str());
}

// The step's phases (Metrics::phases): the JSONL's "phases" and the trace's "step phases" track say
// the same, and the exposed communication the JSONL puts in each phase is what the trace's waits
// inside that phase's span add up to (the counter checked against what the timeline measured).
TEST(Overlap, PhasesAreTheTracesAndTheirExposedWaits) {
  const std::string dir = fsdp_test::temp_prefix("phases");
  const std::string metrics = dir + "-metrics/a/folder/not/made/yet.jsonl";  // fsdp-train makes it
  auto run = fsdp_test::sh(fsdp_test::fsdp_train() + " --nproc-per-node 2 --model tiny --steps 3 --trace " + dir +
                           " --trace-step 1 --metrics-jsonl " + metrics);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (int r = 0; r < 2; ++r) {
    json row;
    for (const auto& j : fsdp_test::read_jsonl(metrics)) {
      if (j.value("rank", -1) == r && j.value("step", -1) == 1) row = j;
    }
    ASSERT_TRUE(row.contains("phases")) << row.dump();
    const json& ph = row["phases"];
    double sum = 0, exposed_sum = 0;
    for (const char* p : {"forward", "backward", "clip", "optimizer"}) {
      const double ms = ph[p]["ms"].get<double>();
      const double exposed = ph[p]["exposed_all_gather_ms"].get<double>() + ph[p]["exposed_reduce_ms"].get<double>() +
                             ph[p]["rate_limiter_wait_ms"].get<double>();
      EXPECT_GT(ms, 0.0) << p;
      EXPECT_EQ(ph[p]["count"], 1) << p;
      EXPECT_LE(exposed, ms + 1e-6) << p;
      sum += ms;
      exposed_sum += exposed;
    }
    EXPECT_GE(ph["rest_ms"].get<double>(), 0.0);
    EXPECT_NEAR(sum + ph["rest_ms"].get<double>(), row["step_ms"].get<double>(), 1e-6);
    // Every exposed wait of the step fell in one of its phases.
    EXPECT_NEAR(exposed_sum, row["exposed_comm_ms"].get<double>(), 1e-3);

    const json trace = fsdp_test::read_json(dir + "/trace-rank" + std::to_string(r) + ".json");
    std::map<std::string, std::pair<double, double>> spans;  // phase -> [begin, end) in us
    std::vector<std::pair<double, double>> waits;
    for (const auto& ev : trace["traceEvents"]) {
      if (ev["ph"] != "X") continue;
      const std::string cat = ev["cat"];
      const double ts = ev["ts"].get<double>(), dur = ev["dur"].get<double>();
      if (cat == "phase") {
        EXPECT_EQ(spans.count(ev["name"].get<std::string>()), 0u) << "one span per phase";
        spans[ev["name"].get<std::string>()] = {ts, ts + dur};
      }
      // The waits Metrics counts as exposed: for a unit's all-gather or reduction, or the rate
      // limiter. Not the end-of-backward sequence check (sequence_check_ms) nor clip_grad_norm_'s
      // all-reduce of the norm (in the clip phase's wall time).
      const std::string name = ev["name"];
      const bool counted = cat == "rate-limit" || (cat == "wait" && name.find("sequence-check") == std::string::npos &&
                                                   name.find("(whole model)") == std::string::npos);
      if (counted) waits.push_back({ts, ts + dur});
    }
    for (const char* p : {"forward", "backward", "clip", "optimizer"}) {
      ASSERT_EQ(spans.count(p), 1u) << "no " << p << " span on rank " << r;
      const auto [b, e] = spans[p];
      EXPECT_NEAR((e - b) / 1000.0, ph[p]["ms"].get<double>(), 0.01) << p;
      double waited_us = 0;
      for (const auto& [wb, we] : waits) {
        if (wb >= b && we <= e) waited_us += we - wb;
      }
      const double exposed = ph[p]["exposed_all_gather_ms"].get<double>() + ph[p]["exposed_reduce_ms"].get<double>() +
                             ph[p]["rate_limiter_wait_ms"].get<double>();
      EXPECT_NEAR(waited_us / 1000.0, exposed, 0.05 + 0.05 * exposed) << p << " on rank " << r;
    }
  }
  std::system(("rm -rf " + dir + " " + dir + "-metrics").c_str());
}

}  // namespace

// A user's own loop marking the optimizer (record_phase), and what the outside review of issue 38
// broke: a StepPhase out of range was accepted (it swallowed every other phase, then corrupted
// memory), reset_step() inside an open phase carried the time before the reset into the new step,
// and a scope kept past its model wrote into the freed model (seen by scripts/sanitize).
TEST(Overlap, PhasesOfAUsersLoopAndTheirMisuses) {
  const std::string out = fsdp_test::temp_prefix("phases-api");
  auto run = fsdp_test::sh(fsdp_test::worker() + " phases --nproc-per-node 2 --out " + out);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  for (int r = 0; r < 2; ++r) {
    const json j = fsdp_test::read_json(out + "." + std::to_string(r) + ".json");
    std::remove((out + "." + std::to_string(r) + ".json").c_str());
    double sum = 0;
    for (const std::string p : {"forward", "backward", "clip", "optimizer"}) {
      EXPECT_EQ(j["step"][p]["count"], 1) << p << " rank " << r;
      EXPECT_GT(j["step"][p]["ms"].get<double>(), 0.0) << p << " rank " << r;
      sum += j["step"][p]["ms"].get<double>();
    }
    EXPECT_LE(sum, j["step_ms"].get<double>()) << "the phases lie inside the step, rank " << r;
    EXPECT_NE(j["out_of_range"].get<std::string>().find("record_phase(7): not a StepPhase; use StepPhase::FORWARD"),
              std::string::npos)
        << j["out_of_range"];
    // 300 ms before the reset, 5 after: the new step holds the 5.
    EXPECT_EQ(j["after_reset"]["optimizer"]["count"], 1);
    EXPECT_LT(j["after_reset"]["optimizer"]["ms"].get<double>(), 150.0) << "time from before reset_step() leaked in";
    EXPECT_TRUE(j["outlived"].get<bool>());
  }
}
