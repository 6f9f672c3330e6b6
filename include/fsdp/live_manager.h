// Live replica groups in a training loop of your own (what torchft's Manager gives a Python loop):
// each replica group shards the model over its own F ranks, and once per step the groups average
// their gradients in a round the coordinator decides (fsdp/fault_tolerance.h). A group that fails
// is left out within seconds and the others redo the step without it; a replacement takes the
// job's state from a live group and trains on with them.
//
//   auto live = fsdp::LiveManager::connect(env, options);       // options.total_steps, ...
//   live->declare_identity({{"model", fsdp::parameters_identity(*model)}, {"lr", "0.01"}});
//   fsdp::FullyShardedDataParallel sharded(model, live->replica_mesh(), fsdp_options);
//   torch::optim::AdamW optimizer(sharded.parameters(), ...);
//   live->track(sharded, optimizer);                            // what a joiner copies
//   live->register_state("data", save_position, load_position); // and what else it needs
//   while (auto step = live->start_step()) {                    // nullopt: the job ended
//     ... forward and backward on step *step's batch ...
//     if (live->should_commit({loss})) optimizer.step();          // else: redone without a failed group
//   }
//   live->finish();
//
// Run it with fsdp::launch_live_local (one machine: the coordinator, the ranks, a replacement for a
// rank that dies), or with fsdp-coordinator and torchrun on a cluster (docs/cluster.md).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/fault_tolerance.h"
#include "fsdp/fsdp.h"

namespace fsdp {

class LiveManager {
 public:
  // Connects this rank to the job's coordinator (LiveReplicas::connect): options.total_steps,
  // ranks_per_replica (F), min_replicas, max_retries and schedule must be the same on every rank.
  static std::unique_ptr<LiveManager> connect(const LaunchEnv& env, LiveOptions options,
                                              MeshOptions mesh_options = MeshOptions::from_environment());

  // The F ranks of this replica group: shard the model over this mesh (FULL_SHARD or SHARD_GRAD_OP).
  const std::shared_ptr<Mesh>& replica_mesh() const { return live_->replica_mesh(); }
  LiveReplicas& replicas() { return *live_; }
  int replica() const { return live_->replica(); }
  bool is_replacement() const { return live_->is_replacement(); }

  // What makes this job this job (LiveReplicas::declare_identity): a rank of another job is
  // refused by name before any state moves.
  void declare_identity(const std::map<std::string, std::string>& items) { live_->declare_identity(items); }

  // What a joining group copies from a live one: the wrapped model's parameters (this rank's
  // shards) and the optimizer's state for them (SGD, Adam, AdamW, RMSprop, Adagrad). Refuses, with
  // std::invalid_argument naming what to change, a model live groups cannot keep: one sharded
  // over another mesh than replica_mesh(), a hybrid strategy (the groups are the replicas),
  // tensor parallelism, or hpZ (reshard_after_forward_to). Call once, before the first start_step.
  void track(FullyShardedDataParallelBase& model, torch::optim::Optimizer& optimizer);
  // The rest of what a joiner needs to train on as the others do (LiveReplicas::register_state):
  // a data loader's position, a learning-rate scheduler, a gradient scaler's scale, an RNG. The
  // names must be the same on every rank (a rank that registered others is refused by name before
  // it joins), registered before the first start_step. The job's first round gives every group
  // the first group's parameters, optimizer state and registered states, so that groups built
  // apart start as one replica (DDP's first broadcast, torchft's init_sync).
  void register_state(const std::string& name, std::function<std::string()> save,
                      std::function<void(const std::string&)> load) {
    live_->register_state(name, std::move(save), std::move(load));
  }

  // The step this rank's state is at: 0, or the step a checkpoint resumed (set it before the first
  // start_step). It moves on with every committed step.
  void set_step(int64_t step) { step_ = step; }
  int64_t step() const { return step_; }

  // Waits for the coordinator's round and returns the step to run (a joining group receives the
  // job's state in it first). nullopt: the job trained every step: call finish(). A group that
  // got in only after the last step holds no trained state then (holds_final_state() is false):
  // do not save or evaluate it. Throws when this rank's group was left out of the job or the
  // coordinator is gone, with what to do.
  std::optional<int64_t> start_step();
  const LiveRound& round() const { return round_; }
  // Whether this rank's state is the job's after its last step (false for a group that got in
  // only after the last step, and before the end).
  bool holds_final_state() const { return step_ >= live_->total_steps(); }

  // After backward: averages the tracked parameters' gradients and `extra` (the loss, a metric)
  // over the round's groups, in place, and asks the coordinator to commit. True: every group
  // finished the step; apply it (clip, then optimizer.step()). False: a group failed during it; do
  // not apply it (the next start_step redoes the step). Call it once after every step's backward,
  // on every rank: a start_step without it, or a second call, is refused (std::logic_error). A
  // gradient some rank lacks (a unit its group did not use) counts as zeros there, as in DDP; one
  // no rank has stays undefined. `extra` must be floating-point tensors, the same number, dtypes
  // and shapes on every rank: the ranks agree on that first, and every rank refuses a difference
  // (std::invalid_argument).
  bool should_commit(std::vector<at::Tensor> extra = {});
  const std::string& last_failure() const { return failure_; }  // why the last should_commit was false
  int64_t discarded_steps() const { return discarded_; }

  // This rank trained every step: the coordinator ends the job once every member has.
  void finish() { live_->finish(); }

 private:
  explicit LiveManager(std::shared_ptr<LiveReplicas> live) : live_(std::move(live)) {}
  std::shared_ptr<LiveReplicas> live_;
  std::vector<at::Tensor> params_;
  torch::optim::Optimizer* optimizer_ = nullptr;
  int64_t step_ = 0;
  LiveRound round_;
  std::string failure_;
  int64_t discarded_ = 0;
  bool in_step_ = false;  // start_step returned a step whose should_commit has not run
};

// One machine's live job for a program of your own, as fsdp-train --live-replicas
// --nproc-per-node N runs: when argv holds --nproc-per-node N (and this process is not a rank),
// this process becomes the coordinator (bound to 127.0.0.1, with a fresh FSDP_LIVE_SECRET) and the
// launcher, which starts a rank that dies again alone (up to --max-restarts in all) so that it
// joins the groups that trained on. Returns the job's exit code: 0 when every step was trained.
// nullopt: this process is a rank (or was not asked to launch); run the loop.
std::optional<int> launch_live_local(int argc, char** argv);

// Each replica group saves checkpoints under a folder of its own (a checkpointer locks its folder):
// <save_dir>/replica-<R>.
std::string live_checkpoint_dir(const std::string& save_dir, int replica);
// `path` itself when it is a checkpoint or holds step-N/ folders; else the newest checkpoint of its
// replica-<R>/ folders (or `path` when it has none): what a restarted job resumes from.
std::string newest_live_checkpoint(const std::string& path);

// A digest of this rank's tensors and their optimizer state, to compare replicas (and a live run
// with its schedule) bit for bit.
std::string state_digest(const std::vector<at::Tensor>& params, torch::optim::Optimizer& optimizer);

}  // namespace fsdp
