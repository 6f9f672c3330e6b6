// fsdp-train's training run (one rank): builds the workload's model (workload.h: the GPT, T5 or the
// DHEN-like model), wraps it (or not, with --local), and runs the loop: zero_grad, forward,
// backward (scaled with fp16), clip, step, log.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include <torch/torch.h>

#include "config.h"
#include "fsdp/activation_checkpoint.h"
#include "fsdp/checkpoint.h"
#include "fsdp/deferred_init.h"
#include "fsdp/fused_optimizer.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/plan.h"
#include "fsdp/process_memory.h"
#include "link_counters.h"
#include "fsdp/live_manager.h"
#include "live_training.h"
#include "lr_schedule.h"
#include "memory_log.h"
#include "metrics_log.h"
#include "run_folder.h"
#include "run_summary.h"
#include "text_sample.h"
#include "trainee.h"
#include "workload.h"

namespace train {
namespace {

// AdamW with no weight decay on biases and norms (parameters keep their names under fsdp), each
// parameter once (libtorch lists a tied weight under both names): fsdp::FusedAdamW, or libtorch's
// (--optimizer adamw-libtorch).
struct Optimizer {
  std::vector<torch::Tensor> unique_params;
  std::unique_ptr<torch::optim::Optimizer> adamw;
};

Optimizer make_optimizer(torch::nn::Module& model, const Config& c) {
  std::vector<torch::Tensor> decay, no_decay;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters()) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // tied weight once
    const bool exempt = item.key().find("bias") != std::string::npos || item.key().find("ln") != std::string::npos;
    (exempt ? no_decay : decay).push_back(item.value());
  }
  Optimizer o;
  o.unique_params = decay;
  o.unique_params.insert(o.unique_params.end(), no_decay.begin(), no_decay.end());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(c.lr).weight_decay(c.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(c.lr).weight_decay(0.0)));
  if (c.optimizer == "adamw-libtorch") {
    o.adamw = std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(c.lr));
  } else {
    o.adamw = std::make_unique<fsdp::FusedAdamW>(groups, torch::optim::AdamWOptions(c.lr));
  }
  return o;
}

// Local training holds the whole model, its gradients and Adam's state, and the activations: the
// plan of one replica without fsdp's buffers.
fsdp::MemoryPlan local_plan(torch::nn::Module& meta, const fsdp::Options& sharded) {
  fsdp::Options o = sharded;
  o.strategy = fsdp::ShardingStrategy::NO_SHARD;
  fsdp::MemoryPlan plan = fsdp::plan_memory(meta, 1, o, 1);
  plan.strategy = "local (no fsdp)";
  // Autograd's gradients are the gradients here: no flattened copies, no reductions.
  plan.peak_unsharded_grads = plan.unit_grads = plan.reduce_buffer = plan.root_grads = 0;
  plan.reductions_in_flight = 0;
  return plan;
}

// The global batch's mean of `value` (each rank's mean over an equal slice).
double global_mean(fsdp::Mesh& mesh, const torch::Tensor& value) {
  std::vector<at::Tensor> l{value.detach().reshape({1}).to(torch::kCPU, torch::kFloat).clone()};
  mesh.world()->allreduce(l)->wait();
  return l[0].item<double>() / mesh.world_size();
}

// Every rank's slice of `t` (equal slices, first dimension), in rank order, on every rank.
torch::Tensor all_gather_rows(fsdp::Mesh& mesh, const torch::Tensor& t) {
  torch::Tensor mine = t.detach().to(torch::kCPU, torch::kFloat).contiguous();
  if (mesh.world_size() == 1) return mine;
  std::vector<int64_t> shape = mine.sizes().vec();
  shape[0] *= mesh.world_size();
  torch::Tensor all = torch::empty(shape, mine.options());
  mesh.world()->_allgather_base(all, mine)->wait();
  return all;
}

Batch on_device(Batch b, const torch::Device& device) {
  if (!device.is_cuda()) return b;
  for (auto& t : b.inputs) t = t.to(device, /*non_blocking=*/true);
  b.targets = b.targets.to(device, /*non_blocking=*/true);
  return b;
}

// Samples [begin, begin + n) of `b`: a micro-batch.
Batch slice(const Batch& b, int64_t begin, int64_t n) {
  Batch out;
  for (const auto& t : b.inputs) out.inputs.push_back(t.narrow(0, begin, n));
  out.targets = b.targets.narrow(0, begin, n);
  return out;
}

// Bytes under `path` (a file or a folder), for the saved files' lines.
int64_t bytes_under(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return static_cast<int64_t>(fs::file_size(path, ec));
  int64_t total = 0;
  for (const auto& e : fs::recursive_directory_iterator(path, ec)) {
    if (e.is_regular_file(ec)) total += static_cast<int64_t>(e.file_size(ec));
  }
  return total;
}

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

std::string megabytes(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MB", static_cast<double>(bytes) / 1e6);
  return text;
}

}  // namespace

int train(const Config& c) {
  fsdp::install_host_allocator();  // before anything is allocated: every CPU tensor counts
  // The learning rate of every step; a resumed run continues the checkpoint's (below).
  LrSchedule schedule = lr_schedule_of(c);  // validated before any rank connects
  const bool simulated = c.simulate_rank >= 0;
  // --live-replicas: each replica group is an fsdp job of its own (`world` is its F ranks) and the
  // groups average once per step in rounds a coordinator decides (live_training.h).
  if (c.live_replicas && simulated) throw std::invalid_argument("--live-replicas needs real peers; drop --simulate-rank");
  const std::unique_ptr<LiveTraining> live =
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
  if (!c.keep_gathered_after_forward.empty() && (c.local || c.ddp_baseline)) {
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

  const std::unique_ptr<Workload> workload = make_workload(c);
  if (c.simulate_layers > 0) {
    // What this process builds: the whole model, or a simulated rank's sample of its blocks.
    if (!simulated) throw std::invalid_argument("--simulate-layers samples the blocks of a --simulate-rank run");
    if (workload->blocks() == 0) {
      throw std::invalid_argument("--simulate-layers: " + workload->name() + " cannot be sampled by blocks; drop it");
    }
    if (c.simulate_layers >= workload->blocks()) {
      throw std::invalid_argument("--simulate-layers " + std::to_string(c.simulate_layers) + " is not below the model's " +
                                  std::to_string(workload->blocks()) + " blocks; drop it to run them all");
    }
  }
  if (plain && c.init == "deferred") throw std::invalid_argument(std::string("--init deferred needs fsdp; drop ") + plain_flag);
  torch::Device device(torch::kCPU);
  if (c.device == "cuda") {
    if (!torch::cuda::is_available()) throw std::invalid_argument("--device cuda: no CUDA device is visible to this process");
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank % torch::cuda::device_count()));
    // NCCL talks to the current device: make it this rank's.
    c10::impl::getDeviceGuardImpl(torch::kCUDA)->setDevice(device);
  }
  fsdp::Options options = fsdp_options(c);
  options.tensor_parallel = tp;
  if (live) {  // inside a group; the groups average in the rounds
    options.strategy = fsdp::parse_strategy(LiveTraining::strategy_within(c.strategy));
    options.shard_size = 0;
  }
  // Activations of one rank's micro-batch, in the compute dtype.
  const int64_t micro_batch = c.global_batch / data_W / std::max(1, c.grad_accum);
  const int64_t element = options.mixed_precision ? c10::elementSize(options.mixed_precision->param_dtype) : 4;
  // The paper's way to build a sharded model (§3.1): deferred, then materialized unit by unit as
  // shards, so no rank ever holds the whole model. Its values are bit for bit those of a normal
  // construction from the same seed. The plan, from a meta model, says whether it is sharded;
  // the wrapper holds it against the memory budget (on every rank alike) before materializing.
  bool deferred = false;
  fsdp::MemoryPlan plan;
  {
    auto meta = fsdp::meta_init([&] { return workload->build(plain ? nullptr : mesh); });  // the whole model's plan
    if (tp) fsdp::parallelize(*meta, tp, workload->tensor_parallel_plan());  // this rank's parts
    workload->configure(options, *meta, micro_batch, element, c.activation_checkpointing);
    if (plain) {
      plan = local_plan(*meta, options);
      const int64_t budget = fsdp::memory_budget_bytes(options, device, 1);
      if (budget > 0 && plan.total() > budget) {
        throw std::invalid_argument(fsdp::explain_over_budget(*meta, plan, options, 1, budget));
      }
    } else {
      plan = fsdp::plan_memory(*meta, W, options, mesh->env().local_world_size);
      // A TP model is built whole and then split (fsdp::parallelize): not deferred.
      deferred = !tp && (c.init == "deferred" || (c.init == "auto" && plan.shard_size > 1));
      // Refused here, before building (the wrapper checks again, on the built model).
      fsdp::check_memory_budget(*meta, *mesh, options, device);
    }
  }
  const int64_t live_before_model = fsdp::process_memory().live_tensor_bytes;
  torch::manual_seed(c.seed);  // the same initial weights on every rank
  auto build = [&] { return workload->build(plain ? nullptr : mesh, c.simulate_layers); };
  std::shared_ptr<torch::nn::Module> model = deferred ? fsdp::deferred_init(build) : build();
  // Built whole from the seed on every TP rank (local training's values), then each keeps its parts.
  if (tp) fsdp::parallelize(*model, tp, workload->tensor_parallel_plan());
  workload->configure(options, *model, micro_batch, element, c.activation_checkpointing);  // this model's own modules
  if (c.activation_checkpointing) workload->apply_checkpointing(*model);
  // A replacement proves it is this job before it asks to join (its model's shapes, its optimizer).
  if (live) live->declare_identity(*model, workload->name());
  if (deferred) {
    options.init_device = device;
  } else if (device.is_cuda()) {
    model->to(device);  // keeps the parameters' identity (the tied weight stays tied)
  }

  // fp16's narrow range needs loss scaling; bf16 has fp32's range and does not.
  std::optional<fsdp::ShardedGradScaler> scaler;
  // Over the whole job: an overflow in one TP rank's parts must skip the step on every rank.
  if (c.mixed_precision == "fp16") scaler.emplace(world);
  std::unique_ptr<Trainee> trainee;
  if (!plain) {
    trainee = sharded_trainee(model, mesh, options,
                              live ? c.strategy + " (live replica groups, " + LiveTraining::strategy_within(c.strategy) +
                                         " in each)"
                                   : c.strategy);
  }
  Optimizer optim = make_optimizer(*model, c);  // after sharding: it steps this rank's shards
  if (live) live->track(*trainee->wrapped(), *optim.adamw);  // what a joining group copies
  if (c.local) trainee = local_trainee(model, optim.unique_params);
  if (c.ddp_baseline) trainee = ddp_trainee(model, mesh, optim.unique_params);
  // Dropout draws each rank's masks from its own stream (the same seed would give every rank the
  // same masks for its part of the batch); checkpoints save and restore each rank's generator.
  // Under --tp the TP ranks of a data-parallel group seed alike (they hold the replicated
  // activations alike) and each draws split activations' masks from its own stream.
  if (c.dropout > 0) {
    const uint64_t seed = c.seed * 1000003ull + static_cast<uint64_t>(rank) + 1;
    if (tp) fsdp::seed_tensor_parallel_rng(tp, seed);
    else torch::manual_seed(seed);
  }
  const fsdp::ProcessMemory constructed = fsdp::process_memory(device);

  // Checkpoints: weights from a file, a resumed run, and the checkpointer for this one.
  if (plain && (!c.save_dir.empty() || !c.resume.empty() || !c.export_full.empty() || !c.load_weights.empty() ||
                (c.run_dir != "auto" && c.run_dir != "none"))) {
    throw std::invalid_argument(std::string("--save-dir, --resume, --export-full, --load-weights and --run-dir need "
                                            "fsdp; drop ") + plain_flag);
  }
  if (simulated && c.run_dir != "auto" && c.run_dir != "none") {
    throw std::invalid_argument("--simulate-rank: a simulated rank has no peers to save with; drop --run-dir");
  }
  // Where the run keeps what it made (run_folder.h): its checkpoint and the whole model, unless
  // --save-dir / --export-full name other places. A collective: rank 0 names it.
  if (live && c.run_dir != "auto" && c.run_dir != "none") {
    throw std::invalid_argument("--live-replicas: name --save-dir (each group saves under replica-<R>/) and --export-full "
                                "instead of --run-dir");
  }
  const std::optional<RunFolder> run = plain || simulated || live ? std::nullopt : RunFolder::create(c, *world);
  const std::string save_dir = live && !c.save_dir.empty() ? fsdp::live_checkpoint_dir(c.save_dir, live->replica())
                               : !c.save_dir.empty()       ? c.save_dir
                               : run                       ? run->checkpoints()
                                                           : "";
  const std::string export_full = !c.export_full.empty() ? c.export_full : run ? run->model_file() : "";
  fsdp::FullyShardedDataParallelBase* wrapped = trainee->wrapped();
  fsdp::ShardedGradScaler* scaler_ptr = scaler ? &*scaler : nullptr;
  if (!c.load_weights.empty()) fsdp::load_model_file(c.load_weights, *wrapped);
  // The checkpointer first: it locks the folder, so a second job saving there stops here, before
  // it loads or trains anything.
  std::unique_ptr<fsdp::Checkpointer> checkpointer;
  if (!save_dir.empty()) {
    fsdp::CheckpointOptions co;
    // A TP model's checkpoints are FULL (its split parameters put together; they load at any TP).
    co.kind = fsdp::parse_state_dict_kind(checkpoint_kind);
    co.keep_last = c.keep_last;
    co.async = c.async_save;
    checkpointer = std::make_unique<fsdp::Checkpointer>(world, save_dir, co);  // every rank of the job
  }

  int start_step = 0;
  // Restarted by a launcher (--max-restarts, torchrun's): from the newest checkpoint of this run,
  // when there is one. A replacement of a live replica group gets its state from a peer instead.
  const bool restarted = restart_count() > 0;
  const bool replacement = live && live->replicas().is_replacement();
  std::string resume = replacement ? "" : c.resume;
  if (resume.empty() && restarted && !replacement && !save_dir.empty()) resume = live ? c.save_dir : save_dir;
  if (live && !resume.empty()) resume = fsdp::newest_live_checkpoint(resume);
  if (!resume.empty() && c.resume.empty() && !fsdp::find_checkpoint(*world, resume)) {
    if (prints) std::cout << "fsdp-train: restarted, but no checkpoint was saved yet: starting from step 0" << std::endl;
    resume.clear();
  }
  if (!resume.empty()) {
    // Rank 0 decides which checkpoint --resume names; every rank loads that one.
    const auto found = fsdp::find_checkpoint(*world, resume);
    if (!found) {
      throw std::invalid_argument("--resume " + c.resume + ": neither a checkpoint (no manifest.json) nor a folder of "
                                  "checkpoints (no complete, undamaged step-N/ inside)");
    }
    const std::string path = *found;
    const auto l0 = std::chrono::steady_clock::now();
    const fsdp::TrainingState resumed = fsdp::load_checkpoint(path, *wrapped, optim.adamw.get(), scaler_ptr);
    const double load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - l0).count();
    start_step = static_cast<int>(resumed.step);
    const auto saved = nlohmann::json::parse(resumed.user_json);
    if (saved.contains("lr_schedule")) {  // checkpoints from before the schedule ran at a constant --lr
      const LrSchedule from_checkpoint = LrSchedule::from_json(saved["lr_schedule"]);
      if (!(from_checkpoint == schedule) && prints) {
        std::cout << "fsdp-train: note: the checkpoint's learning-rate schedule continues (" << from_checkpoint.describe()
                  << "), not the flags' (" << schedule.describe() << "); to train on with another, start a new run "
                  << "from its weights (--load-weights)" << std::endl;
      }
      schedule = from_checkpoint;
      if (schedule.kind != "constant" && c.steps > schedule.horizon && prints) {
        std::cout << "fsdp-train: note: steps " << schedule.horizon << " to " << c.steps - 1 << " run at the schedule's "
                  << "floor, " << exact_text(schedule.min_lr) << " (its decay ended at step " << schedule.horizon - 1
                  << "); to decay over a longer run, start a new run from these weights (--load-weights)" << std::endl;
      }
    }
    if (saved.value("seed", c.seed) != c.seed && prints) {
      std::cout << "fsdp-train: note: the checkpoint was trained with --seed " << saved["seed"]
                << "; batches from step " << start_step << " on follow --seed " << c.seed << std::endl;
    }
    if (prints) {
      std::cout << "fsdp-train: resumed from " << path << " at step " << start_step << " (loaded in "
                << static_cast<int64_t>(load_ms) << " ms)" << std::endl;
      if (start_step >= c.steps) {
        std::cout << "fsdp-train: note: the checkpoint is at step " << start_step << ", not below --steps " << c.steps
                  << ": nothing to train; raise --steps to continue" << std::endl;
      }
    }
  }
  if (prints) {
    std::cout << "fsdp-train: " << workload->name() << " " << workload->num_parameters() << " parameters, "
              << trainee->describe() << (deferred ? ", built deferred" : "") << ", W=" << world->world_size()
              << (tp ? " (TP " + std::to_string(tp->size()) + " x DP " + std::to_string(W) + ")" : "") << ", global batch "
              << workload->batch_text(c.global_batch) << ", " << workload->data_origin()
              << std::endl;
    if (W > 1 && !simulated) std::cout << "fsdp-train: Gloo communicates over " << mesh->network() << std::endl;
  }
  JsonlWriter metrics_out(c.metrics_jsonl);
  if (restarted) {
    metrics_out.write({{"event", "restarted"}, {"rank", world_rank}, {"restart", restart_count()},
                       {"resumed_step", start_step}, {"replacement", replacement}});
  }
  const int64_t per_rank = c.global_batch / data_W;
  const double tokens_per_step = static_cast<double>(c.global_batch * workload->tokens_per_sample());
  auto loss_of = [&](const Batch& b) {
    return workload->loss(*model, trainee->forward([&] { return workload->forward(*model, b, trainee->input_dtype()); }), b);
  };
  // The held-out figures after `step`: the loss of a held-out batch (forward only: no graph, nothing
  // gathered stays behind) and what else the workload evaluates (the DHEN's AUC).
  auto evaluate = [&](int step) {
    torch::NoGradGuard no_grad;
    // Held out: without dropout, drawing nothing from the generators (the training steps' masks
    // do not depend on when evaluations ran).
    model->eval();
    struct BackToTraining {
      torch::nn::Module& m;
      ~BackToTraining() { m.train(); }
    } back{*model};
    const int64_t eval_n = workload->eval_samples(c.global_batch), eval_per_rank = eval_n / W;
    const Batch held_out = on_device(
        workload->batch(-1 - step, eval_n, c.seed, rank * eval_per_rank, (rank + 1) * eval_per_rank), device);
    const torch::Tensor out = trainee->forward([&] { return workload->forward(*model, held_out, trainee->input_dtype()); });
    std::map<std::string, double> figures = {{"loss", global_mean(*mesh, workload->loss(*model, out, held_out))}};
    for (const auto& [name, value] : workload->evaluate(all_gather_rows(*mesh, out), all_gather_rows(*mesh, held_out.targets))) {
      figures[name] = value;
    }
    return figures;
  };
  RunSummary summary(workload->name() + ", " + trainee->describe() + ", W=" + std::to_string(live ? data_W : world->world_size()) +
                         (tp ? " (TP " + std::to_string(tp->size()) + " x DP " + std::to_string(W) + ")" : std::string()),
                     workload->throughput_unit());
  std::map<std::string, double> last_eval;  // the newest held-out figures, and after which step
  int last_eval_step = -1;
  std::string last_checkpoint;
  std::vector<double> sampled_step_ms;  // --simulate-layers: the steps after the first
  std::optional<MemoryTimeline> timeline;
  if (!c.memory_timeline.empty()) timeline.emplace(device);
  summary.begin();
  for (int step = start_step; step < c.steps;) {  // ++step at the end: a discarded step is redone
    if (live) {
      step = live->begin_step(step, metrics_out);
      maybe_slow_for_test(world_rank);
      if (step >= c.steps) break;
    }
    trainee->begin_step();
    MemoryTimeline* sampling = timeline && step == c.trace_step ? &*timeline : nullptr;
    if (sampling) sampling->start();
    auto mark = [&](const char* phase) {
      if (sampling) sampling->mark(phase);
    };
    nlohmann::json memory = {{"after_construction", to_json(constructed)},
                             {"live_before_model", live_before_model},
                             {"plan_bytes", plan.total()}};
    const fsdp::HostMemoryPeak peak;  // live tensor bytes through the step
    const LinkCounters links_before = LinkCounters::read();
    const auto t0 = std::chrono::steady_clock::now();
    const Batch batch =
        on_device(workload->batch(step, c.global_batch, c.seed, data_rank * per_rank, (data_rank + 1) * per_rank), device);
    optim.adamw->zero_grad();
    // Micro-batches of this rank's slice: all but the last accumulate without communicating.
    torch::Tensor loss;
    // The step's phases (Metrics::phases, the JSONL's "phases", the trace's "step phases" track):
    // forward with the loss, backward with the DDP baseline's final wait, clip, optimizer step.
    auto forward_phase = [&] { return trainee->phase(fsdp::StepPhase::FORWARD); };
    auto backward = [&](const torch::Tensor& l) {
      auto timed = trainee->phase(fsdp::StepPhase::BACKWARD);
      if (scaler) scaler->scale(l).backward(); else l.backward();
      trainee->finish_backward();
    };
    if (c.grad_accum == 1) {
      mark("forward");
      {
        auto timed = forward_phase();
        loss = loss_of(batch);
      }
      memory["after_forward"] = to_json(fsdp::process_memory(device));
      maybe_kill_for_test(step, world_rank, !restarted && !replacement, "forward");
      mark("backward");
      backward(loss);
    } else {
      const int64_t micro = per_rank / c.grad_accum;
      loss = torch::zeros({}, torch::TensorOptions().device(device));
      for (int m = 0; m < c.grad_accum; ++m) {
        std::shared_ptr<void> quiet;
        if (m + 1 < c.grad_accum) quiet = trainee->no_sync();
        mark("forward");
        torch::Tensor part;
        {
          auto timed = forward_phase();
          part = loss_of(slice(batch, m * micro, micro)) / c.grad_accum;
        }
        if (m + 1 == c.grad_accum) memory["after_forward"] = to_json(fsdp::process_memory(device));
        mark("backward");
        backward(part);
        loss = loss + part.detach();
      }
    }
    memory["after_backward"] = to_json(fsdp::process_memory(device));
    maybe_kill_for_test(step, world_rank, !restarted && !replacement, "backward");
    // The global batch's mean loss: the mean of the ranks' means (equal slices).
    double mean_loss = global_mean(*mesh, loss);
    if (live && !live->end_step(&mean_loss, ms_since(t0), metrics_out)) {
      optim.adamw->zero_grad();  // discarded: the next round redoes this step
      continue;
    }
    mark("step");
    double grad_norm = -1.0, r_lr = 0.0;
    if (scaler || c.clip > 0) {  // --clip 0 without a scaler: no clip phase at all
      auto timed = trainee->phase(fsdp::StepPhase::CLIP);
      if (scaler) scaler->unscale_(*optim.adamw);
      if (c.clip > 0) grad_norm = trainee->clip_grad_norm(c.clip, workload->model_parallel_parameters(*model));
    }
    {
      auto timed = trainee->phase(fsdp::StepPhase::OPTIMIZER);
      r_lr = schedule.at(step);
      set_learning_rate(*optim.adamw, r_lr);
      if (scaler) {
        if (!scaler->step(*optim.adamw) && prints) std::cout << "step " << step << ": gradients overflowed, step skipped" << std::endl;
        scaler->update();
      } else {
        optim.adamw->step();
      }
    }
    memory["after_step"] = to_json(fsdp::process_memory(device));
    memory["peak_live_tensor_bytes"] = peak.start_bytes() + peak.peak_bytes();
    if (sampling) {
      sampling->stop();
      const std::string path = c.memory_timeline + "/memory-rank" + std::to_string(world_rank) + ".csv";
      sampling->write_csv(path);
      if (prints) {
        std::cout << "fsdp-train: wrote the memory of step " << step << " to " << c.memory_timeline
                  << "/memory-rank*.csv" << std::endl;
      }
    }
    StepRecord r;
    r.rank = world_rank;
    r.local_rank = env.local_rank;
    r.node_rank = world_rank / env.local_world_size;
    r.step = step;
    r.loss = mean_loss;
    r.grad_norm = grad_norm;
    r.lr = r_lr;
    r.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    r.time = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    r.tokens_per_s = tokens_per_step / (r.step_ms / 1000.0);
    r.metrics = trainee->metrics();
    r.memory = std::move(memory);
    r.links = LinkCounters::read().since(links_before);
    if (!c.trace_dir.empty() && step == c.trace_step) {
      const std::string path = c.trace_dir + "/trace-rank" + std::to_string(world_rank) + ".json";
      if (trainee->write_trace(path) && prints) {
        std::cout << "fsdp-train: wrote the Chrome trace of step " << step << " to " << c.trace_dir
                  << "/trace-rank*.json (open in https://ui.perfetto.dev or chrome://tracing)" << std::endl;
      }
    }
    summary.add_step(step, r.loss, r.step_ms, tokens_per_step);
    nlohmann::json eval;  // the held-out figures, on the steps that evaluate
    if (c.eval_every > 0 && (step + 1) % c.eval_every == 0) {
      last_eval = evaluate(step);
      last_eval_step = step;
      eval = last_eval;
      if (prints) {
        std::cout << "step " << step;
        for (const auto& [name, value] : eval.items()) std::cout << " | eval " << name << " " << value.get<double>();
        std::cout << std::endl;
      }
    }
    nlohmann::json record = to_json(r);
    if (!eval.is_null()) record["eval"] = eval;
    if (simulated) record["simulated"] = true;  // not a trained result
    if (c.simulate_layers > 0) {
      record["simulated_layers"] = {{"built", c.simulate_layers}, {"of", workload->blocks()},
                                    {"flops_scale", workload->flops_scale(c.simulate_layers)}};
      if (step > start_step) sampled_step_ms.push_back(r.step_ms);
    }
    const bool saves = checkpointer && (!live || live->is_writer());  // live: one group writes
    if (saves && ((c.save_every > 0 && (step + 1) % c.save_every == 0) || step + 1 == c.steps)) {
      // The batches are a function of the step, so the step is the data position.
      const auto s0 = std::chrono::steady_clock::now();
      const fsdp::HostMemoryPeak save_peak;  // what the save allocates (FULL: one unit at a time)
      const nlohmann::json training = {{"data_position", step + 1}, {"seed", c.seed}, {"lr_schedule", schedule.to_json()}};
      const std::string where = checkpointer->save(*wrapped, optim.adamw.get(), {step + 1, training.dump()}, scaler_ptr);
      last_checkpoint = where;
      const double stall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count();
      int64_t largest_unit = 0;
      for (const auto& u : wrapped->units()) largest_unit = std::max(largest_unit, u.padded_numel * u.element_size);
      record["checkpoint_stall_ms"] = stall;
      record["checkpoint_memory"] = {{"peak_increase_bytes", save_peak.peak_bytes()},
                                     {"largest_unit_bytes", largest_unit},
                                     {"live_before_bytes", save_peak.start_bytes()}};
      if (prints) {
        std::cout << "fsdp-train: " << (c.async_save ? "saving " : "saved ") << where << " (training stalled "
                  << static_cast<int64_t>(stall) << " ms)" << std::endl;
      }
    }
    metrics_out.write(record);
    if (prints && (!live || live->is_writer()) && (step % c.log_every == 0 || step == c.steps - 1)) {
      std::cout << (simulated ? "[SIMULATED] " : "") << progress_line(r, trainee->is_sharded(), device.is_cuda(), workload->throughput_unit())
                << std::endl;
    }
    ++step;
  }
  if (checkpointer) checkpointer->wait();
  if (live) live->finish();  // the coordinator ends the job once every member has
  // This rank's shards and optimizer state as one hash: replicas (and a run against its restarted
  // twin) compare bit for bit.
  if (!plain && !simulated && (c.state_hash || live)) {
    nlohmann::json e = {{"event", "state_hash"}, {"rank", world_rank}, {"shard_rank", rank},
                        {"hash", fsdp::state_digest(optim.unique_params, *optim.adamw)}};
    if (live) e["replica"] = live->replica();
    metrics_out.write(e);
  }
  if (c.simulate_layers > 0) {
    if (sampled_step_ms.empty()) {
      std::cout << "fsdp-train: SIMULATED: run at least 2 steps to time the sample of blocks (the first warms up)" << std::endl;
    } else {
      std::sort(sampled_step_ms.begin(), sampled_step_ms.end());
      const double median = sampled_step_ms[sampled_step_ms.size() / 2];
      const double scale = workload->flops_scale(c.simulate_layers);
      std::cout << "fsdp-train: SIMULATED: timed " << c.simulate_layers << " of " << workload->blocks()
                << " blocks: median step " << static_cast<int64_t>(median) << " ms; the whole model's step "
                << "would compute for about " << static_cast<int64_t>(median * scale) << " ms on this device (x"
                << scale << " by FLOPs; no communication). The memory plan (plan_bytes) is the whole model's; the "
                << "measured peaks are the sample's." << std::endl;
    }
  }
  const bool trained = summary.steps() > 0;
  // An explicit --export-full writes whatever the model holds (weights loaded, steps 0); the run
  // folder keeps a model only when this run trained it.
  if (!export_full.empty() && (trained || !c.export_full.empty()) && (!live || live->is_writer())) {
    fsdp::export_full(export_full, *wrapped);
    if (prints && (!run || !trained)) std::cout << "fsdp-train: wrote the whole model to " << export_full << std::endl;
  }
  if (simulated) return 0;  // a simulated rank's losses are not trained results: nothing to sum up

  // The end of the run: what it did, what it kept, and what the trained model writes.
  if (trained) {
    if (last_eval_step != c.steps - 1) last_eval = evaluate(c.steps - 1);
    summary.set_held_out(last_eval);
  }
  summary.end();
  if (prints) {
    std::cout << "\n";
    for (const std::string& line : summary.lines()) std::cout << line << "\n";
    if (run && trained) {
      std::ofstream(run->summary_file()) << summary.to_json().dump(2) << "\n";
      // Single-host runs get the local launcher's flag; a job over hosts is started by its launcher.
      // Under --tp the job is every rank, W of them data-parallel.
      const int job_W = world->world_size();
      const int nproc = env.local_world_size == job_W ? job_W : 0;
      std::cout << "== saved in " << run->path() << "/\n";
      if (!last_checkpoint.empty()) {
        std::cout << "   checkpoint " << last_checkpoint << " (" << checkpoint_kind << ", "
                  << megabytes(bytes_under(last_checkpoint)) << ")\n";
      }
      std::cout << "   model      " << export_full << " (" << megabytes(bytes_under(export_full))
                << ", safetensors, the whole model)\n";
      std::cout << "   summary    " << run->summary_file() << "\n";
      if (!last_checkpoint.empty()) {
        std::cout << "   resume:    " << resume_command(c, save_dir, 2 * c.steps, nproc) << "\n";
      }
      std::cout << "   in Python: " << python_load_command(export_full) << "\n";
      if (nproc == 0) std::cout << "   (start the resumed job with your launcher, " << job_W << " ranks)\n";
    } else if (run) {
      std::error_code ec;
      std::filesystem::remove(run->path(), ec);  // nothing trained: an empty folder is not kept
    } else if (plain) {
      std::cout << "== nothing saved: " << plain_flag << " trains without fsdp, and checkpoints need it\n";
    }
    std::cout << std::flush;
  }
  // A model resumed at its last step writes a sample too: the trained model, without training more.
  if (trained || start_step > 0) {
    if (const std::optional<TextSample> sample = live ? std::nullopt : sample_text(c, *workload, *model, *trainee, *mesh, device, tp)) {
      std::cout << "== sample: " << sample->tokens << " tokens after \"" << sample->prompt << "\" (temperature "
                << c.temperature << ", seed " << c.seed << "; through " << sample->via << ", "
                << static_cast<int64_t>(sample->seconds * 1000) << " ms)\n"
                << sample->text << "\n" << std::flush;
    }
  }
  return 0;
}

}  // namespace train
