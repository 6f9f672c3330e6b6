// fsdp-train with --live-replicas (fsdp/fault_tolerance.h): each replica group (its F ranks) runs
// fsdp on its own, and once per step the groups average gradients in a round the coordinator
// decides. This file is the loop's side of it: the round before a step (who left, who joined,
// the state a joining group gets), the average and the commit after backward, the events in the
// JSONL, and the restart and fault-injection switches the launchers set.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "config.h"
#include "fsdp/fault_tolerance.h"
#include "fsdp/live_manager.h"
#include "metrics_log.h"

namespace train {

class LiveTraining {
 public:
  // Connects to the coordinator (MASTER_ADDR:MASTER_PORT) as this rank of the job. Checks the
  // flags first: a hybrid strategy, at least two groups, nothing that differs per group.
  static std::unique_ptr<LiveTraining> connect(const Config& c, const fsdp::LaunchEnv& env);
  // Refuses flags and layouts live groups cannot keep (a launcher calls it before any rank starts).
  static void check(const Config& c, int world_size, int local_world_size);
  // F: --shard-size, or the ranks of a host.
  static int ranks_per_replica(const Config& c, int local_world_size);

  fsdp::LiveReplicas& replicas() { return live_->replicas(); }
  const std::shared_ptr<fsdp::Mesh>& mesh() const { return live_->replica_mesh(); }
  // What fsdp runs inside a group: full_shard for hybrid_shard, shard_grad_op for hybrid_shard_zero2.
  static std::string strategy_within(const std::string& strategy);

  // What a joining group copies: the wrapped model's shards and the optimizer's state (once, before
  // the first step).
  void track(fsdp::FullyShardedDataParallelBase& model, torch::optim::Optimizer& optimizer);
  // Before a step: waits for the round (a joining group receives the state here) and logs what
  // changed. Returns the step to run; >= c.steps when the job ended.
  int begin_step(int held_step, JsonlWriter& out);
  // After backward: averages this rank's gradient shards and the group's mean loss over the
  // round's members, and commits. False: the step is discarded (logged); the loop redoes it.
  bool end_step(double* loss, double step_ms, JsonlWriter& out);
  // The lowest member of the round saves checkpoints and writes the model: one copy of each.
  // Declares the job's identity (fsdp::LiveReplicas::declare_identity): the model's parameter
  // names, shapes and dtypes (before sharding), the optimizer and its settings, the strategy, the
  // data and the seed. Throws, naming what differs, when they are not the live job's.
  void declare_identity(const torch::nn::Module& model, const std::string& workload);
  bool is_writer() const { return !members_.empty() && members_.front() == live_->replica(); }
  bool prints() const;  // this group's first rank, when it writes
  void finish() { live_->finish(); }
  int replica() const { return live_->replica(); }

 private:
  LiveTraining(const Config& c, std::unique_ptr<fsdp::LiveManager> live) : c_(c), live_(std::move(live)) {}
  nlohmann::json event(const std::string& name) const;

  const Config& c_;
  std::unique_ptr<fsdp::LiveManager> live_;
  std::vector<int> members_;
  int step_ = 0;  // the step of the round in progress
  std::optional<std::chrono::steady_clock::time_point> discarded_at_;  // the last discarded step's end
};

// The restart this process is in: 0 for the first start (torchrun's TORCHELASTIC_RESTART_COUNT,
// which fsdp's launchers set too).
int restart_count();

// Fault injection for the tests and benchmarks: with FSDP_FAULT_KILL_AT_STEP=S this process kills
// itself (SIGKILL: no cleanup, as a lost host) at `point` of step S ("backward": after it, the
// default; FSDP_FAULT_KILL_AFTER=forward: after the forward, mid-step), in the job's first start
// only; FSDP_FAULT_KILL_RANKS="1,3" limits it to those global ranks.
void maybe_kill_for_test(int step, int global_rank, bool first_start, const std::string& point);
// With FSDP_FAULT_SLOW_MS=N each step of the ranks in FSDP_FAULT_SLOW_RANKS (every rank when
// unset) starts N ms late: a slow group (or a slow checkpoint save between steps).
void maybe_slow_for_test(int global_rank);
// With FSDP_FAULT_AVERAGE_FAILS_FROM=S the replica average of the ranks in
// FSDP_FAULT_AVERAGE_FAIL_RANKS fails from step S on, every time: a failure that repeats.
bool replica_average_fails_for_test(int step, int global_rank);

}  // namespace train
