// Bad input fails fast and clearly on every rank (issue: bad input): a world size not divisible
// by F, a missing or malformed launch environment, ranks disagreeing on the world size, a model
// or options that differ across ranks, and a rank that never arrives. Each case must exit non-zero
// on every rank, within 60 seconds, with a message naming the cause.
//
// Faults end everywhere, fast, with the cause: a rank killed (SIGKILL) inside forward, inside
// backward, inside the optimizer step or between steps, at W = 4, under the local launcher and
// launched torchrun-style by hand (no launcher to clean up); a rank whose user code throws; a rank
// whose forward takes another branch. Every survivor exits non-zero within 60 s with an error
// naming the collective that failed (or the divergence). The collective timeout is short here
// (FSDP_COLLECTIVE_TIMEOUT_S), though a dead peer is noticed at once: its sockets close.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>

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

// Below the kernel's ephemeral range (32768 and up): a port there may be any process's outgoing
// connection at the moment rank 0 binds it (CI failed once with "could not host the store").
int port() { return 20000 + (::getpid() * 7 + std::rand()) % 12000; }

void expect_every_rank_failed(const fsdp_test::Run& run, int ranks) {
  // all_must_fail prints "exit<code>" on a line of its own for each command.
  int failures = 0;
  std::istringstream lines(run.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("exit", 0) == 0 && line.size() > 4 && std::isdigit(static_cast<unsigned char>(line[4])) && line != "exit0") {
      ++failures;
    }
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
  // Says what to change, not only what is wrong (issue 35 review).
  run = sh("RANK=0 WORLD_SIZE=3 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1234 " + worker() + " structure");
  EXPECT_NE(run.output.find("WORLD_SIZE=3 is not a multiple of LOCAL_WORLD_SIZE=2"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("Set LOCAL_WORLD_SIZE to the ranks each node runs"), std::string::npos) << run.output;
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

TEST(Failure, ShardSizeThatMakesNoSenseIsRefused) {
  auto run = sh(worker() + " structure --nproc-per-node 2 --strategy full_shard --shard-size 1");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("shard_size=1 is for the hybrid strategies"), std::string::npos) << run.output;
  run = sh(worker() + " structure --nproc-per-node 2 --strategy hybrid_shard --shard-size -2");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("shard_size=-2 is negative"), std::string::npos) << run.output;
}

TEST(Failure, OptionsDifferAcrossRanks) {
  auto run = sh(worker() + " structure --nproc-per-node 3 --mismatch-rank 1 --mismatch-what prefetch");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("differs across ranks"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("backward_prefetch backward_post"), std::string::npos) << "names the option; " << run.output;
  EXPECT_LT(run.seconds, 60.0);
}

const std::string kFaultEnv = "FSDP_COLLECTIVE_TIMEOUT_S=20 FSDP_LAUNCHER_GRACE_S=20 ";

// Counts how many ranks reported an error of their own (not the launcher's lines).
int reported(const std::string& output, const std::string& needle) {
  int n = 0;
  for (size_t pos = output.find(needle); pos != std::string::npos; pos = output.find(needle, pos + 1)) ++n;
  return n;
}

// Every survivor of a killed rank 2 reported which collective failed, in its own words ("all-gather
// of unit 'block1''s parameters on rank 3 failed", "reduce-scatter of unit 'block3''s gradients on
// rank 0 failed": which one a survivor is in when the peer dies depends on timing).
void expect_survivors_reported(const std::string& output) {
  for (int r : {0, 1, 3}) {
    EXPECT_NE(output.find(" on rank " + std::to_string(r) + " failed; a peer rank probably exited"), std::string::npos)
        << "rank " << r << " did not report the failed collective:\n" << output;
  }
}

class KilledRank : public testing::TestWithParam<std::string> {};

TEST_P(KilledRank, LocalLauncherReportsItAndEveryOtherRankEndsWithTheCause) {
  auto run = sh(kFaultEnv + worker() + " fault --nproc-per-node 4 --fault kill --fault-rank 2 --fault-at " + GetParam(), 90);
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_LT(run.seconds, 60.0) << run.output;
  EXPECT_NE(run.output.find("fsdp launcher: rank 2 (pid"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("was killed by signal 9 (SIGKILL)"), std::string::npos) << run.output;
  // Each survivor says itself which collective failed (not a SIGTERM from the launcher).
  expect_survivors_reported(run.output);
  // The job's failure is the killed rank's (an OOM kill looks like this), not a survivor's that
  // exited with code 1 a moment later: a SIGKILL is never a peer's closed connection.
  EXPECT_EQ(run.output.find("the job's failure is rank"), std::string::npos) << run.output;
  EXPECT_EQ(run.exit_code, 128 + 9) << run.output;
}

TEST_P(KilledRank, TorchrunStyleEveryOtherRankEndsOnItsOwn) {
  // Four processes given the environment by hand: nobody cleans up after the killed one.
  std::vector<std::string> cmds;
  const int p = port();
  for (int r = 0; r < 4; ++r) {
    cmds.push_back(kFaultEnv + env(r, 4, p) + worker() + " fault --fault kill --fault-rank 2 --fault-at " + GetParam());
  }
  auto run = all_must_fail(cmds);
  expect_every_rank_failed(run, 4);
  expect_survivors_reported(run.output);
}

INSTANTIATE_TEST_SUITE_P(Points, KilledRank, testing::Values("forward", "backward", "step", "between"),
                         [](const testing::TestParamInfo<std::string>& i) { return "In_" + i.param; });

TEST(Failure, RankThatThrowsInUserCode) {
  auto run = sh(kFaultEnv + worker() + " fault --nproc-per-node 4 --fault throw --fault-rank 1", 90);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_LT(run.seconds, 60.0) << run.output;
  EXPECT_NE(run.output.find("user code failed in forward on rank 1"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("fsdp launcher: rank 1 (pid"), std::string::npos) << run.output;
  for (int r : {0, 2, 3}) {
    EXPECT_NE(run.output.find("on rank " + std::to_string(r) + " failed"), std::string::npos) << "rank " << r << ":\n" << run.output;
  }
}

// A rank whose program ends with an error code: the job ends with that code and the launcher
// names that rank, though its peers' Gloo threads abort on its closed sockets (SIGABRT) and are
// often reaped first (an outside review saw 134 and "rank 0 was killed by signal 6" most times).
TEST(Failure, RankThatExitsWithACodeIsTheJobsFailure) {
  for (const char* launch : {"", "FSDP_LAUNCH_EXEC=1 "}) {
    auto run = sh(kFaultEnv + std::string(launch) + worker() + " fault --nproc-per-node 4 --fault exit --fault-rank 1", 90);
    EXPECT_EQ(run.exit_code, 5) << launch << "\n" << run.output;
    EXPECT_LT(run.seconds, 60.0) << run.output;
    EXPECT_NE(run.output.find("fsdp launcher: rank 1 (pid"), std::string::npos) << run.output;
    EXPECT_NE(run.output.find(") exited with code 5"), std::string::npos) << run.output;
  }
}

TEST(Failure, RanksEndWhenTheirLauncherIsKilled) {
  // A launcher killed with SIGKILL (an OOM kill, a scheduler's hard stop) cannot tell its ranks:
  // the kernel does (PR_SET_PDEATHSIG), instead of leaving them waiting in a collective forever.
  for (const char* launch : {"", "FSDP_LAUNCH_EXEC=1 "}) {
    const std::string script =
        "D=$(mktemp -d); " + std::string(launch) + worker() + " fault --nproc-per-node 2 --fault outlive 2>$D/err & L=$!; "
        "for i in $(seq 300); do [ $(grep -c waiting $D/err) -ge 2 ] && break; sleep 0.1; done; "
        "P=$(sed -n \"s/.*pid \\([0-9]*\\) waiting/\\1/p\" $D/err); kill -9 $L; wait $L 2>/dev/null; "
        "for i in $(seq 100); do A=; for p in $P; do kill -0 $p 2>/dev/null && A=\"$A $p\"; done; "
        "[ -z \"$A\" ] && break; sleep 0.1; done; "
        "echo \"ranks:\" $P; echo \"alive after the launcher died:$A.\"; for p in $A; do kill -9 $p; done; "
        "cat $D/err; rm -rf $D";
    const auto run = sh(script, 90);
    EXPECT_NE(run.output.find("alive after the launcher died:."), std::string::npos) << launch << "\n" << run.output;
    const auto ranks = run.output.find("ranks: ");
    ASSERT_NE(ranks, std::string::npos) << run.output;
    const std::string pids = run.output.substr(ranks, run.output.find('\n', ranks) - ranks);
    EXPECT_EQ(std::count(pids.begin(), pids.end(), ' '), 2) << "two ranks started: " << run.output;
  }
}

TEST(Failure, ArgumentsAfterADoubleDashAreTheProgramsOwn) {
  // The launcher takes --nproc-per-node 2 and passes "--" and all after it to the ranks, whose
  // parser (the worker's) refuses the "--" it did not expect: that refusal is the ranks speaking.
  for (const char* launch : {"", "FSDP_LAUNCH_EXEC=1 "}) {
    const auto run = sh(std::string(launch) + worker() + " structure --nproc-per-node 2 -- --nproc-per-node 3", 60);
    EXPECT_NE(run.exit_code, 0) << run.output;
    EXPECT_NE(run.output.find("unknown flag --"), std::string::npos) << launch << "\n" << run.output;
    EXPECT_EQ(run.output.find("wants a positive integer"), std::string::npos) << run.output;
  }
}

TEST(Failure, RankWhoseForwardTakesAnotherBranch) {
  // Its units run in another order: equal-size units would silently swap shards; the
  // end-of-backward check stops every rank before the optimizer step. (The collective logs, off
  // here, would find it too, in a wait that took long: the next test.)
  auto run = sh("FSDP_COMPARE_COLLECTIVES_AFTER_S=0 " + kFaultEnv + worker() + " fault --nproc-per-node 4 --fault branch --fault-rank 3", 90);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_LT(run.seconds, 60.0) << run.output;
  EXPECT_EQ(reported(run.output, "the ranks issued different collectives in this iteration (rank(s) 3 differ"), 4)
      << run.output;
}

TEST(Failure, RankWhoseForwardSkipsAUnit) {
  // Its collectives no longer line up with the others' (the next unit's gather meets a gather of
  // another size): Gloo may end the process from its own thread before any fsdp check runs, so
  // fsdp explains it on the way out. Every rank ends, fast, and the output says what happened.
  auto run = sh(kFaultEnv + worker() + " fault --nproc-per-node 4 --fault skip --fault-rank 1", 90);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_LT(run.seconds, 60.0) << run.output;
  EXPECT_NE(run.output.find("the ranks issued different collectives"), std::string::npos) << run.output;
  // The rank whose Gloo thread found it ends with code 70, and the launcher blames it, not a peer
  // that exited with code 1 after its connection closed (it did when the rank died of SIGABRT).
  EXPECT_NE(run.output.find("exited with code 70"), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("the job's failure is rank"), std::string::npos) << run.output;
}

TEST(Failure, RankWhoseForwardSkipsAUnitOfTheSameSize) {
  // Every unit it gathers is one size, so Gloo pairs the skipped unit's all-gather with the next
  // unit's: the ranks compute with each other's parameters, then each waits for a collective its
  // peers never issue. Before collective logs, every rank waited out the collective timeout (20 s
  // here) and blamed a peer that "probably exited". Now a wait of 2 s compares the ranks' logs, and
  // every rank names the collective where they parted, long before the timeout.
  for (int W : {2, 4}) {
    auto run = sh("FSDP_COMPARE_COLLECTIVES_AFTER_S=2 " + kFaultEnv + worker() + " fault --nproc-per-node " +
                      std::to_string(W) + " --fault skip-paired --fault-rank 1",
                  90);
    EXPECT_NE(run.exit_code, 0) << run.output;
    EXPECT_LT(run.seconds, 15.0) << "ended by the collective timeout, not by the comparison:\n" << run.output;
    // Every rank says it; which words depends on timing: once one rank has left on the comparison,
    // a peer still waiting may first receive another collective's message, of another size, which
    // Gloo refuses (explained as such, exit code 70).
    EXPECT_GE(reported(run.output, "the ranks issued different collectives"), W) << run.output;
    EXPECT_GE(reported(run.output, "the ranks issued different collectives on process group"), 1) << run.output;
    // Rank 1's all-gather of block3 met the others' of block2: the message names both, and rank 1.
    EXPECT_NE(run.output.find("all-gather of unit 'block3''s parameters (forward, 1056 fp32) on rank 1"), std::string::npos)
        << run.output;
    EXPECT_NE(run.output.find("all-gather of unit 'block2''s parameters (forward, 1056 fp32) on rank"), std::string::npos)
        << run.output;
    EXPECT_NE(run.output.find("Run every branch on every rank"), std::string::npos) << run.output;
    EXPECT_EQ(run.output.find("probably exited"), std::string::npos) << run.output;
  }
}

TEST(Failure, RankThatSkipsClippingOrTrainsTwoModelsInAnotherOrder) {
  // A skipped clip_grad_norm_: rank 1's next all-gather meets the others' all-reduce of the norm.
  // Before, each rank threw after 2 s but then sat in the process group's destructor, joining a
  // Gloo thread stuck in that collective, until the collective timeout (20 s here).
  auto clip = sh("FSDP_COMPARE_COLLECTIVES_AFTER_S=2 " + kFaultEnv + worker() +
                     " fault --nproc-per-node 2 --fault skip-clip --fault-rank 1",
                 90);
  EXPECT_NE(clip.exit_code, 0) << clip.output;
  EXPECT_LT(clip.seconds, 15.0) << clip.output;
  EXPECT_GE(reported(clip.output, "the ranks issued different collectives"), 2) << clip.output;
  EXPECT_GE(reported(clip.output, "the all-reduce of the gradient norm (2 fp32) on rank 0"), 1) << clip.output;
  // Two wrapped models of one architecture, trained in another order on rank 1 at step 2: every
  // collective paired with one of the same size and the job trained each model with the other's
  // parameters, silently. The end-of-backward check now stops every rank before the optimizer step.
  auto swap = sh(kFaultEnv + worker() + " fault --nproc-per-node 2 --fault swap-models --fault-rank 1", 90);
  EXPECT_NE(swap.exit_code, 0) << swap.output;
  EXPECT_EQ(swap.output.find("\"completed\""), std::string::npos) << swap.output;
  EXPECT_EQ(reported(swap.output, "the ranks issued different collectives in this iteration"), 2) << swap.output;
}

TEST(Failure, ComparingCollectivesInEveryWaitChangesNothingInARunThatAgrees) {
  // The comparison must never see a difference where there is none (a rank that is merely slow, a
  // snapshot published before its rank went on, replicas' all-reduces, hpZ subgroups, quantized
  // all-gathers). At 1 ms nearly every blocking wait publishes and compares: the runs succeed with
  // the losses of runs that never compare.
  for (const std::string flags : {"--strategy hybrid_shard --shard-size 2 --reshard-after-forward-to 1",
                                   "--reshard-after-forward-to 2 --quantize-all-gather int8"}) {
    std::string losses[2];
    for (int i = 0; i < 2; ++i) {
      auto run = sh(std::string("FSDP_COMPARE_COLLECTIVES_AFTER_S=") + (i == 0 ? "0" : "0.001") + " " + fsdp_test::fsdp_train() +
                        " --nproc-per-node 4 --steps 3 " + flags,
                    240);
      ASSERT_EQ(run.exit_code, 0) << flags << "\n" << run.output;
      const size_t at = run.output.find("   loss ");
      ASSERT_NE(at, std::string::npos) << run.output;
      losses[i] = run.output.substr(at, run.output.find('\n', at) - at);
    }
    EXPECT_EQ(losses[0], losses[1]) << flags;
  }
}

TEST(Failure, RankThatNeverArrives) {
  // A world of 3 where rank 2 is never started: ranks 0 and 1 must give up with a clear error.
  const int p = port();
  // A short wait for it (FSDP_INIT_TIMEOUT_S, 30 s by default): what is asserted is the message.
  const std::string wait = "FSDP_INIT_TIMEOUT_S=8 ";
  auto run = all_must_fail({wait + env(0, 3, p) + worker() + " structure", wait + env(1, 3, p) + worker() + " structure"});
  expect_every_rank_failed(run, 2);
  EXPECT_NE(run.output.find("never arrived"), std::string::npos) << run.output;
  // Named, with its node: a host that never joined shows as its ranks.
  EXPECT_NE(run.output.find("1 of 3 ranks never arrived"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find(": rank 2 (node "), std::string::npos) << run.output;
}

}  // namespace

namespace {

TEST(Failure, GlooInterfaceThatDoesNotExistIsRefusedWithTheOnesThatDo) {
  const auto run = fsdp_test::sh("GLOO_SOCKET_IFNAME=nope0 " + fsdp_test::fsdp_train() +
                                     " --model tiny --steps 1 --nproc-per-node 2",
                                 90);
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("GLOO_SOCKET_IFNAME names 'nope0', which is not an interface of this host. "
                            "Interfaces here: lo (127.0.0.1)"),
            std::string::npos)
      << run.output;
  // A name that exists is used, as PyTorch users set it.
  const auto lo = fsdp_test::sh("GLOO_SOCKET_IFNAME=lo " + fsdp_test::fsdp_train() +
                                    " --model tiny --steps 2 --nproc-per-node 2",
                                90);
  EXPECT_EQ(lo.exit_code, 0) << lo.output;
  EXPECT_NE(lo.output.find("Gloo communicates over interface lo (GLOO_SOCKET_IFNAME)"), std::string::npos) << lo.output;
}

}  // namespace
