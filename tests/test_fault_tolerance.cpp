// Training that survives a failure, on one machine, run the way a user runs fsdp-train
// (docs/cluster.md, "When a host fails"): the local launcher restarts a full_shard job from its
// newest checkpoint and it ends bit-exact with an uninterrupted run; with --live-replicas the
// launcher hosts the coordinator, the groups that are left train on without the failed one, and
// the failed ranks come back as a replacement that ends with the same bits as every other group.
// The emulated cluster's versions of these (hosts killed, the coordinator on a host of its own)
// are in test_cluster.cpp.
#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;
using fsdp_test::read_jsonl;
using fsdp_test::sh;
using fsdp_test::events;
using fsdp_test::hashes;
using fsdp_test::step_losses;
using fsdp_test::expect_same_step_losses;

struct Result {
  fsdp_test::Run run;
  std::vector<json> rows;
};

// fsdp-train with its JSONL, under `env` (KEY=VALUE ...).
Result train(const std::string& env, const std::string& args, int timeout_s = 240) {
  static int n = 0;
  const std::string metrics = fsdp_test::temp_prefix("ft-" + std::to_string(n++)) + ".jsonl";
  std::remove(metrics.c_str());
  Result r;
  r.run = sh(env + " " + fsdp_test::fsdp_train() + " --log-every 1000 --metrics-jsonl " + metrics + " " + args, timeout_s);
  r.rows = read_jsonl(metrics);
  std::remove(metrics.c_str());
  return r;
}

const std::string kTiny = " --model tiny --global-batch-size 8 --block-size 32 ";

TEST(FaultTolerance, LauncherRestartsFullShardFromNewestCheckpointBitExact) {
  const std::string dir = fsdp_test::fresh_dir("ft-restart");
  const std::string job = kTiny + "--nproc-per-node 2 --strategy full_shard --steps 9 --state-hash ";
  // Rank 1 dies after step 6's backward: the launcher stops rank 0, starts both again, and they
  // resume from step-00000005 (saved after step 4 ... every 5 steps) to the end.
  const Result hit = train("FSDP_FAULT_KILL_AT_STEP=6 FSDP_FAULT_KILL_RANKS=1 FSDP_LAUNCHER_GRACE_S=5",
                           job + "--max-restarts 1 --save-every 5 --save-dir " + dir);
  ASSERT_EQ(hit.run.exit_code, 0) << hit.run.output;
  EXPECT_NE(hit.run.output.find("rank 1 (pid"), std::string::npos) << hit.run.output;
  EXPECT_NE(hit.run.output.find("restarting all 2 ranks (restart 1 of 1)"), std::string::npos) << hit.run.output;
  const auto restarted = events(hit.rows, "restarted");
  ASSERT_EQ(restarted.size(), 2u) << hit.run.output;
  for (const auto& e : restarted) EXPECT_EQ(e["resumed_step"], 5) << e;

  const Result clean = train("", job);
  ASSERT_EQ(clean.run.exit_code, 0) << clean.run.output;
  const auto a = hashes(hit.rows), b = hashes(clean.rows);
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(a.at(r)["hash"], b.at(r)["hash"]) << "rank " << r << "'s shards and optimizer state";
  expect_same_step_losses(step_losses(hit.rows), step_losses(clean.rows), 9);
  sh("rm -rf " + dir);
}

TEST(FaultTolerance, LauncherOutOfRestartsReportsTheFailure) {
  const Result r = train("FSDP_FAULT_KILL_AT_STEP=2 FSDP_LAUNCHER_GRACE_S=5",
                         kTiny + "--nproc-per-node 2 --steps 5 --max-restarts 0");
  EXPECT_EQ(r.run.exit_code, 137) << r.run.output;  // the rank's SIGKILL
  EXPECT_NE(r.run.output.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << r.run.output;
  EXPECT_EQ(r.run.output.find("restarting"), std::string::npos) << r.run.output;
}

// Four ranks, two replica groups of two; group 1 (ranks 2 and 3) fails at step 3 as `faults` say.
void live_group_leaves_and_rejoins_as_if_scheduled(const std::string& faults) {
  const std::string job = kTiny + "--nproc-per-node 4 --strategy hybrid_shard --shard-size 2 --live-replicas --steps 12 ";
  const Result hit = train(faults, job + "--max-restarts 2");
  ASSERT_EQ(hit.run.exit_code, 0) << hit.run.output;
  EXPECT_NE(hit.run.output.find("starting rank 2 again"), std::string::npos) << hit.run.output;

  // Rank 0 (group 0) saw group 1 leave at step 3 and come back.
  std::vector<json> left, joined;
  for (const auto& e : events(hit.rows, "replica_left")) if (e["rank"] == 0) left.push_back(e);
  for (const auto& e : events(hit.rows, "replica_joined")) if (e["rank"] == 0) joined.push_back(e);
  ASSERT_EQ(left.size(), 1u) << hit.run.output;
  EXPECT_EQ(left[0]["step"], 3);
  EXPECT_EQ(left[0]["replicas"], json::array({1}));
  EXPECT_LT(left[0]["pause_ms"].get<double>(), 10000.0);
  ASSERT_EQ(joined.size(), 1u) << "the replacement never joined\n" << hit.run.output;
  // The replacement may be ready before step 3 is redone: then it joins in that very round.
  const int back = joined[0]["step"].get<int>();
  EXPECT_GE(back, 3);
  EXPECT_EQ(joined[0]["source"], 0);
  EXPECT_GT(joined[0]["transfer_bytes"].get<int64_t>(), 0);
  EXPECT_FALSE(events(hit.rows, "step_discarded").empty()) << "step 3 was not discarded";

  // Both groups end with the same bits, shard rank by shard rank.
  const auto h = hashes(hit.rows);
  ASSERT_EQ(h.size(), 4u) << hit.run.output;
  EXPECT_EQ(h.at(0)["hash"], h.at(2)["hash"]);
  EXPECT_EQ(h.at(1)["hash"], h.at(3)["hash"]);

  // The same as a run told from the start that group 1 sits out from step 3 and is back at `back`
  // (back at 3: the same as a run where nothing happened).
  const Result planned =
      train("", job + (back > 3 ? "--live-schedule out:1@3,in:1@" + std::to_string(back) : std::string()));
  ASSERT_EQ(planned.run.exit_code, 0) << planned.run.output;
  expect_same_step_losses(step_losses(hit.rows), step_losses(planned.rows), 12);
  const auto p = hashes(planned.rows);
  ASSERT_EQ(p.size(), 4u);
  EXPECT_EQ(h.at(0)["hash"], p.at(0)["hash"]);
  EXPECT_EQ(h.at(1)["hash"], p.at(1)["hash"]);
}

TEST(FaultTolerance, LiveReplicaGroupKilledAfterBackwardRejoinsAsIfScheduled) {
  live_group_leaves_and_rejoins_as_if_scheduled("FSDP_FAULT_KILL_AT_STEP=3 FSDP_FAULT_KILL_RANKS=2,3");
}

// One rank of group 1, mid-step: its peer's next collective inside the group fails, so group 1
// leaves whole; group 0 learns of it at the replica average. Both ranks come back.
TEST(FaultTolerance, OneRankKilledMidStepTakesItsGroupOutAndBack) {
  live_group_leaves_and_rejoins_as_if_scheduled(
      "FSDP_FAULT_KILL_AT_STEP=3 FSDP_FAULT_KILL_AFTER=forward FSDP_FAULT_KILL_RANKS=2");
}

TEST(FaultTolerance, LiveReplicasWithNothingToKeepOrNoCoordinatorAreRefused) {
  // No replicas to keep training.
  const Result full = train("", kTiny + "--nproc-per-node 2 --strategy full_shard --live-replicas --steps 2");
  EXPECT_NE(full.run.exit_code, 0);
  EXPECT_NE(full.run.output.find("--strategy full_shard has no replicas to keep"), std::string::npos) << full.run.output;
  // One group: nobody to train on when it fails.
  const Result one = train("", kTiny + "--nproc-per-node 2 --strategy hybrid_shard --shard-size 2 --live-replicas --steps 2");
  EXPECT_NE(one.run.exit_code, 0);
  EXPECT_NE(one.run.output.find("need at least 2 replica groups"), std::string::npos) << one.run.output;
  // A state a replacement could not take from a peer.
  const Result dropout = train("", kTiny + "--nproc-per-node 4 --strategy hybrid_shard --shard-size 2 --live-replicas "
                                           "--dropout 0.1 --steps 2");
  EXPECT_NE(dropout.run.exit_code, 0);
  EXPECT_NE(dropout.run.output.find("--live-replicas with --dropout: not supported"), std::string::npos)
      << dropout.run.output;
  // Ranks started by hand (torchrun-style) with no coordinator where MASTER_ADDR points.
  const Result alone = train("FSDP_INIT_TIMEOUT_S=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 WORLD_SIZE=4 RANK=0 "
                             "LOCAL_RANK=0 LOCAL_WORLD_SIZE=4",
                             kTiny + "--strategy hybrid_shard --shard-size 2 --live-replicas --steps 2", 60);
  EXPECT_NE(alone.run.exit_code, 0);
  EXPECT_NE(alone.run.output.find("cannot reach the live replicas' coordinator at 127.0.0.1:1: start fsdp-coordinator"),
            std::string::npos)
      << alone.run.output;
}

}  // namespace
