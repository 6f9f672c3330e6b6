// Training that survives a lost replica group without a restart (docs/cluster.md, "When a host
// fails"). Under the hybrid strategies the F ranks of a shard group hold a whole replica of the
// model; R such groups average their gradients. With live replicas each group is an fsdp job of
// its own (its F ranks, its own process groups) and the groups average gradients once per step
// over a replica group that is rebuilt whenever its members change, so that:
//
//   - when a group fails, the others discard the step it broke and redo it without it, at R - 1,
//     within seconds, without reloading anything;
//   - a replacement (a new host, or the failed one restarted) asks to join; at a step boundary a
//     live group's ranks send it their shards, optimizer state and step, and from then on the job
//     runs at R again.
//
// Who is in each step's quorum is decided by a coordinator that outlives every rank
// (run_coordinator: fsdp-coordinator, or the local launcher): it hosts the store the ranks meet
// in, watches their heartbeats and commits each step only when every member finished it, so that
// every surviving group takes the same steps. A rank that cannot reach it stops with an error that
// says so; what remains (the coordinator lost, a group without a live peer to copy from) is
// restarted from the newest checkpoint by the launcher (fsdp/launch.h, --max-restarts).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "fsdp/mesh.h"

namespace fsdp {

// Thrown on a rank whose replica group the coordinator left out of the job (a rank of it was stuck
// past the ready timeout, its failures reached the retry limit, or a peer of it is gone): the other
// groups train on. Its message says why; a program exits with kLeftOutExitCode (fsdp/launch.h), and
// starting the group's ranks again makes them rejoin as a replacement.
class LeftOutOfJob : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct CoordinatorOptions {
  int port = 29500;  // where the ranks reach it (their MASTER_PORT); 0: any free port
  // A rank whose heartbeat has not changed for this long is gone. Environment: FSDP_LIVE_DEAD_AFTER_S.
  std::chrono::milliseconds dead_after{std::chrono::seconds(3)};
  // How long the first round waits for every replica group before it starts with those present.
  std::chrono::milliseconds start_timeout{std::chrono::seconds(120)};
  // How long it waits for a replacement when no group is left before it gives up (exit 1).
  std::chrono::milliseconds empty_timeout{std::chrono::seconds(600)};
  // After a discarded step, how long a member whose heartbeat is fresh may take to notice (it
  // finishes the forward and backward it was in first, or the checkpoint it was saving) before it
  // is dropped as stuck: this, or 3 times the slowest committed round so far when that is longer
  // (a group with slow steps is never taken for a stuck one). A dropped group's ranks stop and say
  // why. Environment: FSDP_LIVE_READY_TIMEOUT_S; fsdp-coordinator --ready-timeout.
  std::chrono::milliseconds ready_timeout{std::chrono::seconds(60)};
  std::string events_jsonl;  // its decisions, one JSON object per line ("" : stderr only)
  // Where the store listens: "" every interface (a cluster's coordinator, reached by every host),
  // "127.0.0.1" one machine's ranks only (the local launcher's).
  std::string bind_address;
  // The job's secret (FSDP_LIVE_SECRET, or the first line of FSDP_LIVE_SECRET_FILE; at least 16
  // characters): every value the ranks and the coordinator write carries an HMAC-SHA256 under it,
  // and a value without the right one is never acted on (a client that reaches the port without
  // the secret can disturb the job, never make a rank apply a step or take a state). Empty: values
  // are not authenticated (one host's loopback, or a network only the job's hosts reach). The
  // ranks must hold the same secret. The local launcher makes one for each job.
  std::string secret;
  // Asked while the coordinator waits for groups to join (fewer than the job's minimum, or none):
  // true when none can come (the local launcher is out of --max-restarts with a rank down); the
  // job is then lost at once instead of after empty_timeout.
  std::function<bool()> replacements_exhausted;
  // How many ranks are down for good (failed with no restart left; the local launcher counts
  // them). Before the first round, once fewer groups than the job's minimum could still have every
  // rank (each rank down takes its group with it), the job is lost at once instead of after
  // start_timeout. Unset: nothing is known.
  std::function<int()> ranks_down_for_good;
  // Called once the job's end is decided, before the coordinator lingers for the last ranks: with
  // 0 when every step was trained, 1 when no group with the job's state is left.
  std::function<void(int verdict)> on_end;
  // The defaults with FSDP_LIVE_DEAD_AFTER_S, FSDP_LIVE_READY_TIMEOUT_S and the secret applied.
  static CoordinatorOptions from_environment();
};

// Hosts the ranks' store on `port` and decides every round until all members finished training
// (returns 0), or no group is left and none joins within empty_timeout (returns 1). `on_listening`
// is called with the port once the store listens (the local launcher starts its ranks then).
int run_coordinator(const CoordinatorOptions& options, const std::function<void(int port)>& on_listening = {});

struct LiveOptions {
  int ranks_per_replica = 1;  // F: ranks RANK / F * F ... + F - 1 are one replica group
  int64_t total_steps = 0;    // the run's --steps: every rank must say the same
  // Membership changes fixed in advance, "out:R@S,in:R@T": replica group R sits out from step S
  // and comes back at step T (a run to compare a failure with). Every rank must say the same.
  std::string schedule;
  // The fewest replica groups a step may run with (torchft's min_replica_size): with fewer, the
  // coordinator waits for groups to join (up to its empty_timeout) and the members wait with it.
  // Every rank must say the same. Environment: FSDP_LIVE_MIN_REPLICAS.
  int min_replicas = 1;
  // How many times a step may be redone in a row with the same groups before one of them is left
  // out (torchft's max_retries): a failure that repeats every round (a partition between two
  // groups, a state transfer that always fails) would otherwise be retried forever. The group left
  // out is a joining one, else the highest-numbered that failed; its ranks stop and say why.
  // -1: no limit. Every rank must say the same. Environment: FSDP_LIVE_MAX_RETRIES.
  int max_retries = 3;
  std::chrono::milliseconds heartbeat{std::chrono::milliseconds(200)};
  // How long a rank waits for the coordinator's next decision before it stops with an error, and
  // how long its heartbeat may go unanswered (a cut link) before a watchdog stops the process.
  // Environment: FSDP_LIVE_TIMEOUT_S (default 120 s).
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  // The job's secret, as the coordinator's (CoordinatorOptions::secret); from the environment.
  std::string secret;
  static LiveOptions from_environment();
};

// Refuses, with what to change, a job whose ranks cannot form live replica groups: F must divide
// the world size, leave at least 2 groups, and be whole hosts or divide one. LiveReplicas::connect
// checks it on every rank; a launcher can check it before it starts any.
void check_live_layout(int world_size, int local_world_size, int ranks_per_replica);

// An identity item for a model (LiveReplicas::declare_identity): its parameters' count of elements
// and a digest of their names, shapes and dtypes. Call it on the model as built, before fsdp wraps
// it (a wrapped model's parameters are this rank's shards).
std::string parameters_identity(const torch::nn::Module& model);

// What changed at the start of a round, for the log.
struct LiveRound {
  int64_t number = 0;
  int64_t step = 0;             // the training step this round computes
  std::vector<int> members;     // replica groups in this step, ascending
  std::vector<int> left;        // groups of the previous round that are not in this one
  std::vector<int> joined;      // groups that got the state this round (from `source`)
  int source = -1;
  bool i_joined = false;        // this rank's group got its state this round
  double wait_ms = 0;           // waiting for the decision and rebuilding the replica group
  double transfer_ms = 0;       // sending or receiving the state
  int64_t transfer_bytes = 0;   // this rank's part of it
};

class LiveReplicas {
 public:
  // Connects to the coordinator at MASTER_ADDR:MASTER_PORT, states the job's shape, starts the
  // heartbeat and builds this rank's replica group mesh (F ranks, its own process groups) for fsdp.
  // A rank that starts while its group's earlier ranks are gone is a replacement: it joins by
  // calling next_round() like the others.
  static std::shared_ptr<LiveReplicas> connect(const LaunchEnv& env, LiveOptions options,
                                               MeshOptions mesh_options = MeshOptions::from_environment());
  ~LiveReplicas();
  LiveReplicas(const LiveReplicas&) = delete;
  LiveReplicas& operator=(const LiveReplicas&) = delete;

  // The F ranks of this replica group: what fsdp shards over (full_shard within the group).
  const std::shared_ptr<Mesh>& replica_mesh() const;
  int replica() const;     // which group, RANK / F
  int replicas() const;    // R, the job's groups when all are in
  int generation() const;  // 1 for the ranks the job started with, then one more per replacement
  int64_t total_steps() const;  // LiveOptions::total_steps
  bool is_replacement() const { return generation() > 1; }

  // What makes this job this job, item by item (fsdp-train declares the model's structure, shapes
  // and dtypes, the optimizer and its hyper-parameters, the strategy, the data and the seed): every
  // rank and every replacement must declare the same before its first round. The first rank's
  // declaration is the job's; a rank whose items differ is refused here, with std::invalid_argument
  // naming the first item that differs and both values, before it asks to join and before any
  // state moves, so the groups in the job train on. A second call must declare the same items.
  void declare_identity(const std::map<std::string, std::string>& items);

  // The user's own state a joining group needs besides the parameters and the optimizer (a data
  // loader's position, a scheduler, a gradient scaler's scale, an RNG): `save` runs on the source
  // group's ranks and `load` on the joining group's, in the round it joins, after the parameters
  // and optimizer state arrived. Register the same names on every rank, before the first round.
  void register_state(const std::string& name, std::function<std::string()> save,
                      std::function<void(const std::string&)> load);

  // Waits for the coordinator's next round. `held_step` is the step this rank's state is at (the
  // next step it would run). When a group joins, the source group's values of `params` (this
  // rank's shards, in the same order on every group), of `optimizer`'s state for them and of the
  // step are sent to it (collective over the members). Returns the round; its step is the one to
  // run (for a group that got in after the last step: the run's total, nothing to run). Throws when this rank's group was dropped (a peer of it is gone) or the
  // coordinator cannot be reached; a group sitting out by the schedule waits inside until it is
  // let back in.
  LiveRound next_round(int64_t held_step, const std::vector<at::Tensor>& params, torch::optim::Optimizer* optimizer);

  // Averages `tensors` (this rank's gradient shards and the loss, each already averaged over the
  // group's F ranks) over the round's members, in place. False when a member failed during it
  // (the step must then be discarded; `why` says what failed).
  bool average(std::vector<at::Tensor>& tensors, std::string* why);

  // The element-wise maximum of `values` (int64, the same size on every rank) over the round's
  // members, in place: what the members must agree on before a collective whose layout depends on
  // it. False when a member failed during it, as average().
  bool agree(at::Tensor& values, std::string* why);

  // Every member reports how its step went; the coordinator commits the step only when all
  // finished it. True: apply the step. False: discard it (the next round redoes it).
  bool commit(bool ok, const std::string& why);

  // This rank finished training: the coordinator ends the job once every member has.
  void finish();

 private:
  struct Impl;
  explicit LiveReplicas(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp
