// Bad input fails fast and clearly on every rank (issue: bad input): a world size not divisible
// by F, a missing or malformed launch environment, ranks disagreeing on the world size, a model
// that differs across ranks, and a rank that never arrives. Each case must exit non-zero on every
// rank, within 60 seconds, with a message naming the cause.
#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

using fsdp_test::sh;
using fsdp_test::worker;

std::string env(int rank, int world, int port) {
  return "RANK=" + std::to_string(rank) + " WORLD_SIZE=" + std::to_string(world) +
         " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " ";
}

// Starts each command in the background, waits for all, and fails unless every one exited non-zero.
fsdp_test::Run all_must_fail(const std::vector<std::string>& cmds) {
  std::string script;
  for (size_t i = 0; i < cmds.size(); ++i) script += "(" + cmds[i] + "; echo \"exit$?\") & ";
  script += "wait";
  return sh(script, 120);
}

int port() { return 20000 + (::getpid() * 7 + std::rand()) % 20000; }

void expect_every_rank_failed(const fsdp_test::Run& run, int ranks) {
  int failures = 0;
  for (size_t pos = run.output.find("exit"); pos != std::string::npos; pos = run.output.find("exit", pos + 4)) {
    if (run.output.compare(pos, 5, "exit0") != 0) ++failures;
  }
  EXPECT_EQ(failures, ranks) << run.output;
  EXPECT_LT(run.seconds, 60.0) << run.output;
}

TEST(Failure, WorldSizeNotDivisibleByShardSize) {
  auto run = sh(worker() + " structure --nproc-per-node 4 --strategy hybrid_shard --shard-size 3");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("does not divide the world size W=4"), std::string::npos) << run.output;
  EXPECT_LT(run.seconds, 60.0);
}

TEST(Failure, MissingLaunchEnvironment) {
  auto run = sh("env -u RANK -u WORLD_SIZE " + worker() + " structure");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("WORLD_SIZE is not set"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("torchrun"), std::string::npos) << run.output;  // says how to fix it
}

TEST(Failure, MalformedLaunchEnvironment) {
  auto run = sh("RANK=one WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1234 " + worker() + " structure");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("RANK='one' is not an integer"), std::string::npos) << run.output;
  run = sh("RANK=2 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1234 " + worker() + " structure");
  EXPECT_NE(run.output.find("RANK=2 is not below WORLD_SIZE=2"), std::string::npos) << run.output;
  run = sh("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=99999 " + worker() + " structure");
  EXPECT_NE(run.output.find("MASTER_PORT=99999 is not a TCP port"), std::string::npos) << run.output;
  run = sh("RANK=0 WORLD_SIZE=2 MASTER_PORT=1234 env -u MASTER_ADDR " + worker() + " structure");
  EXPECT_NE(run.output.find("MASTER_ADDR is not set"), std::string::npos) << run.output;
}

TEST(Failure, RanksDisagreeOnWorldSize) {
  const int p = port();
  auto run = all_must_fail({env(0, 2, p) + worker() + " structure", env(1, 3, p) + worker() + " structure"});
  expect_every_rank_failed(run, 2);
  EXPECT_NE(run.output.find("world size mismatch"), std::string::npos) << run.output;
}

TEST(Failure, ModelDiffersAcrossRanks) {
  auto run = sh(worker() + " structure --nproc-per-node 3 --mismatch-rank 2");
  EXPECT_NE(run.exit_code, 0);
  // Every rank reports it (the launcher prints each rank's error), naming the first difference.
  size_t reports = 0;
  for (size_t pos = run.output.find("differs across ranks"); pos != std::string::npos;
       pos = run.output.find("differs across ranks", pos + 1)) {
    ++reports;
  }
  EXPECT_EQ(reports, 3u) << run.output;
  EXPECT_NE(run.output.find("First difference"), std::string::npos) << run.output;
  EXPECT_LT(run.seconds, 60.0);
}

TEST(Failure, RankThatNeverArrives) {
  // A world of 3 where rank 2 is never started: ranks 0 and 1 must give up with a clear error.
  const int p = port();
  auto run = all_must_fail({env(0, 3, p) + worker() + " structure", env(1, 3, p) + worker() + " structure"});
  expect_every_rank_failed(run, 2);
  EXPECT_NE(run.output.find("never arrived"), std::string::npos) << run.output;
}

}  // namespace
