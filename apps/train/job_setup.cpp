// The job this rank trains in: connects it (live replica groups, tensor parallelism, a simulated
// rank or a plain mesh), shares the cores among the local ranks, and refuses the flags that cannot
// run together before any model is built.
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "job_setup.h"
#include "keep_last_block.h"

namespace train {

Job join_job(const Config& c) {
  const bool simulated = c.simulate_rank >= 0;
  // --live-replicas: each replica group is an fsdp job of its own (`world` is its F ranks) and the
  // groups average once per step in rounds a coordinator decides (live_training.h).
  if (c.live_replicas && simulated) throw std::invalid_argument("--live-replicas needs real peers; drop --simulate-rank");
  std::unique_ptr<LiveTraining> live =
      c.live_replicas ? LiveTraining::connect(c, fsdp::LaunchEnv::from_environment()) : nullptr;
  auto world = simulated ? fsdp::Mesh::simulated(c.plan_world, c.simulate_rank, std::min(c.plan_local, c.plan_world))
               : live    ? live->mesh()
                         : fsdp::Mesh::create(fsdp::LaunchEnv::from_environment());
  const fsdp::LaunchEnv env = live ? fsdp::LaunchEnv::from_environment() : world->env();
  // --tp N: tensor parallelism inside a host, fsdp over the data-parallel ranks. `mesh` is what
  // fsdp, the batch slices and checkpoints see: the DP ranks (all of them without --tp).
  if (c.tp > 1 && (c.local || c.ddp_baseline)) {
    throw std::invalid_argument("--tp needs fsdp; drop " + std::string(c.local ? "--local" : "--ddp-baseline"));
  }
  if (!keeps_only_by_default(c.keep_gathered_after_forward) && (c.local || c.ddp_baseline)) {
    throw std::invalid_argument("--keep-gathered-after-forward keeps fsdp units gathered; " +
                                std::string(c.local ? "--local" : "--ddp-baseline") + " has none: drop one of the two");
  }
  if (c.sequence_parallel && c.tp <= 1) {
    throw std::invalid_argument("--sequence-parallel splits the sequence over the TP ranks: add --tp N (N > 1)");
  }
  fsdp::TensorParallelOptions tp_options;
  tp_options.sequence_parallel = c.sequence_parallel;
  const std::shared_ptr<fsdp::TensorParallel> tp = c.tp > 1 ? fsdp::TensorParallel::create(world, c.tp, tp_options) : nullptr;
  const std::string checkpoint_kind = c.checkpoint_kind != "auto" ? c.checkpoint_kind : tp ? "full" : "sharded";
  // A split model saves FULL checkpoints only, which are written synchronously: said before the run
  // trains, not at its first save.
  if (tp && !c.save_dir.empty() && (checkpoint_kind != "full" || c.async_save)) {
    throw std::invalid_argument("--tp " + std::to_string(c.tp) + ": split models save FULL checkpoints only (a split parameter's "
                                "parts are put together as they are gathered), which are written synchronously: " +
                                (checkpoint_kind != "full" ? "drop --checkpoint-kind " + checkpoint_kind
                                                           : std::string("drop --async-save")) +
                                " (the default under --tp is full)");
  }
  const std::shared_ptr<fsdp::Mesh> mesh = tp ? tp->data_parallel() : world;
  const int world_rank = live ? env.rank : world->rank();
  // Share the cores among the local ranks instead of oversubscribing them (a simulated rank is
  // alone on this machine).
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  torch::set_num_threads(c.threads > 0 ? c.threads : std::max(1, cores / (simulated ? 1 : env.local_world_size)));
  const int W = mesh->world_size(), rank = mesh->rank();  // fsdp's ranks
  // Who reads which slice of the global batch: fsdp's ranks, or with live replicas every rank of
  // the job (a group that is out leaves its slices out of the step).
  const int data_W = live ? env.world_size : W, data_rank = live ? env.rank : rank;
  // What this process prints: rank 0's view, or the simulated rank's (with live replicas: each
  // group's first rank, since any group may be gone).
  const bool prints = live ? live->prints() : world_rank == 0 || simulated;
  if (simulated) {
    if (c.local) throw std::invalid_argument("--simulate-rank runs one rank of a sharded job; drop --local");
    if (!c.save_dir.empty() || !c.resume.empty() || !c.export_full.empty()) {
      throw std::invalid_argument("--simulate-rank: a simulated rank has no peers to save or load with; drop the "
                                  "checkpoint flags");
    }
    std::cout << "fsdp-train: SIMULATED rank " << rank << " of " << W << " (" << env.local_world_size
              << " per node): the other ranks do not exist and every collective is a stand-in that completes at "
                 "once. Memory and compute time are this rank's; the losses are NOT trained results and no "
                 "communication is timed."
              << std::endl;
  }
  if (c.global_batch % data_W != 0) {
    throw std::invalid_argument("--global-batch-size " + std::to_string(c.global_batch) +
                                " is not divisible by the world size " + std::to_string(data_W) +
                                "; choose a multiple of " + std::to_string(data_W));
  }
  if ((!c.trace_dir.empty() || !c.memory_timeline.empty()) && c.trace_step >= c.steps) {
    throw std::invalid_argument("--trace-step " + std::to_string(c.trace_step) + " is not below --steps " +
                                std::to_string(c.steps) + "; pick a step that runs");
  }
  // The output folders exist before the first step, so a bad path fails now rather than after it.
  for (const std::string& dir : {c.trace_dir, c.memory_timeline}) {
    if (!dir.empty()) std::filesystem::create_directories(dir);
  }
  if (c.local && W != 1) throw std::invalid_argument("--local trains in one process; drop --nproc-per-node");
  if (c.local && c.ddp_baseline) throw std::invalid_argument("--local and --ddp-baseline are two baselines; pick one");
  if (simulated && c.ddp_baseline) throw std::invalid_argument("--simulate-rank runs one rank of a sharded job; drop --ddp-baseline");
  // Without fsdp: one process (--local), or every rank a whole replica (--ddp-baseline).
  const bool plain = c.local || c.ddp_baseline;
  const char* plain_flag = c.local ? "--local" : "--ddp-baseline";
  if (plain && c.mixed_precision != "none") {
    throw std::invalid_argument(std::string("--mixed-precision needs fsdp; drop ") + plain_flag);
  }
  if ((c.global_batch / data_W) % c.grad_accum != 0) {
    throw std::invalid_argument("--grad-accum " + std::to_string(c.grad_accum) + " does not divide the " +
                                std::to_string(c.global_batch / data_W) + " sequences of each rank's batch");
  }

  Job job;
  job.live = std::move(live);
  job.world = world;
  job.env = env;
  job.tp = tp;
  job.checkpoint_kind = checkpoint_kind;
  job.mesh = mesh;
  job.simulated = simulated;
  job.world_rank = world_rank;
  job.W = W;
  job.rank = rank;
  job.data_W = data_W;
  job.data_rank = data_rank;
  job.prints = prints;
  job.plain = plain;
  job.plain_flag = plain_flag;
  return job;
}

}  // namespace train
