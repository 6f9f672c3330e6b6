// The model this rank trains: the workload's model planned from a meta copy, built (deferred as
// shards, or whole from the seed), split under --tp, wrapped by fsdp or trained plainly (--local,
// --ddp-baseline), with its optimizer, fp16's loss scaler and each rank's dropout stream.
#include <algorithm>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>

#include <torch/torch.h>

#include "fsdp/activation_checkpoint.h"
#include "fsdp/deferred_init.h"
#include "fsdp/fused_optimizer.h"
#include "keep_last_block.h"
#include "model_setup.h"

namespace train {
namespace {

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

}  // namespace

Model build_model(const Config& c, const Job& job) {
  std::unique_ptr<Workload> workload = make_workload(c);
  if (c.simulate_layers > 0) {
    // What this process builds: the whole model, or a simulated rank's sample of its blocks.
    if (!job.simulated) throw std::invalid_argument("--simulate-layers samples the blocks of a --simulate-rank run");
    if (workload->blocks() == 0) {
      throw std::invalid_argument("--simulate-layers: " + workload->name() + " cannot be sampled by blocks; drop it");
    }
    if (c.simulate_layers >= workload->blocks()) {
      throw std::invalid_argument("--simulate-layers " + std::to_string(c.simulate_layers) + " is not below the model's " +
                                  std::to_string(workload->blocks()) + " blocks; drop it to run them all");
    }
  }
  if (job.plain && c.init == "deferred") throw std::invalid_argument(std::string("--init deferred needs fsdp; drop ") + job.plain_flag);
  torch::Device device(torch::kCPU);
  if (c.device == "cuda") {
    if (!torch::cuda::is_available()) throw std::invalid_argument("--device cuda: no CUDA device is visible to this process");
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(job.env.local_rank % torch::cuda::device_count()));
    // NCCL talks to the current device: make it this rank's.
    c10::impl::getDeviceGuardImpl(torch::kCUDA)->setDevice(device);
  }
  fsdp::Options options = fsdp_options(c);
  options.tensor_parallel = job.tp;
  if (job.live) {  // inside a group; the groups average in the rounds
    options.strategy = fsdp::parse_strategy(LiveTraining::strategy_within(c.strategy));
    options.shard_size = 0;
  }
  // Activations of one rank's micro-batch, in the compute dtype.
  const int64_t micro_batch = c.global_batch / job.data_W / std::max(1, c.grad_accum);
  const int64_t element = options.mixed_precision ? c10::elementSize(options.mixed_precision->param_dtype) : 4;
  // The paper's way to build a sharded model (§3.1): deferred, then materialized unit by unit as
  // shards, so no rank ever holds the whole model. Its values are bit for bit those of a normal
  // construction from the same seed. The plan, from a meta model, says whether it is sharded;
  // the wrapper holds it against the memory budget (on every rank alike) before materializing.
  bool deferred = false;
  fsdp::MemoryPlan plan;
  {
    auto meta = fsdp::meta_init([&] { return workload->build(job.plain ? nullptr : job.mesh); });  // the whole model's plan
    if (job.tp) fsdp::parallelize(*meta, job.tp, workload->tensor_parallel_plan());  // this rank's parts
    workload->configure(options, *meta, micro_batch, element, c.activation_checkpointing);
    if (job.plain) {
      options.keep_gathered_after_forward.clear();  // no unit to keep ("last" or "none": job_setup refuses names)
      plan = local_plan(*meta, options);
      const int64_t budget = fsdp::memory_budget_bytes(options, device, 1);
      if (budget > 0 && plan.total() > budget) {
        throw std::invalid_argument(fsdp::explain_over_budget(*meta, plan, options, 1, budget));
      }
    } else {
      if (c.simulate_layers > 0 && keeps_only_by_default(options.keep_gathered_after_forward)) {
        // The sample's blocks are not the whole model's: its last block is not the plan's.
        options.keep_gathered_after_forward.clear();
      } else {
        resolve_keep_gathered(options, *meta, job.W, job.mesh->env().local_world_size);
      }
      plan = fsdp::plan_memory(*meta, job.W, options, job.mesh->env().local_world_size);
      // A TP model is built whole and then split (fsdp::parallelize): not deferred.
      deferred = !job.tp && (c.init == "deferred" || (c.init == "auto" && plan.shard_size > 1));
      // Refused here, before building (the wrapper checks again, on the built model).
      fsdp::check_memory_budget(*meta, *job.mesh, options, device);
    }
  }
  const int64_t live_before_model = fsdp::process_memory().live_tensor_bytes;
  torch::manual_seed(c.seed);  // the same initial weights on every rank
  auto build = [&] { return workload->build(job.plain ? nullptr : job.mesh, c.simulate_layers); };
  std::shared_ptr<torch::nn::Module> model = deferred ? fsdp::deferred_init(build) : build();
  // Built whole from the seed on every TP rank (local training's values), then each keeps its parts.
  if (job.tp) fsdp::parallelize(*model, job.tp, workload->tensor_parallel_plan());
  workload->configure(options, *model, micro_batch, element, c.activation_checkpointing);  // this model's own modules
  if (c.activation_checkpointing) workload->apply_checkpointing(*model);
  // A replacement proves it is this job before it asks to join (its model's shapes, its optimizer).
  if (job.live) job.live->declare_identity(*model, workload->name());
  if (deferred) {
    options.init_device = device;
  } else if (device.is_cuda()) {
    model->to(device);  // keeps the parameters' identity (the tied weight stays tied)
  }

  // fp16's narrow range needs loss scaling; bf16 has fp32's range and does not.
  std::optional<fsdp::ShardedGradScaler> scaler;
  // Over the whole job: an overflow in one TP rank's parts must skip the step on every rank.
  if (c.mixed_precision == "fp16") scaler.emplace(job.world);
  std::unique_ptr<Trainee> trainee;
  if (!job.plain) {
    trainee = sharded_trainee(model, job.mesh, options,
                              job.live ? c.strategy + " (live replica groups, " + LiveTraining::strategy_within(c.strategy) +
                                         " in each)"
                                   : c.strategy);
  }
  Optimizer optim = make_optimizer(*model, c);  // after sharding: it steps this rank's shards
  if (job.live) job.live->track(*trainee->wrapped(), *optim.adamw);  // what a joining group copies
  if (c.local) trainee = local_trainee(model, optim.unique_params);
  if (c.ddp_baseline) trainee = ddp_trainee(model, job.mesh, optim.unique_params);
  // Dropout draws each rank's masks from its own stream (the same seed would give every rank the
  // same masks for its part of the batch); checkpoints save and restore each rank's generator.
  // Under --tp the TP ranks of a data-parallel group seed alike (they hold the replicated
  // activations alike) and each draws split activations' masks from its own stream.
  if (c.dropout > 0) {
    const uint64_t seed = c.seed * 1000003ull + static_cast<uint64_t>(job.rank) + 1;
    if (job.tp) fsdp::seed_tensor_parallel_rng(job.tp, seed);
    else torch::manual_seed(seed);
  }
  const fsdp::ProcessMemory constructed = fsdp::process_memory(device);

  Model m;
  m.workload = std::move(workload);
  m.device = device;
  m.deferred = deferred;
  m.plan = std::move(plan);
  m.live_before_model = live_before_model;
  m.model = std::move(model);
  m.scaler = std::move(scaler);
  m.trainee = std::move(trainee);
  m.optim = std::move(optim);
  m.constructed = constructed;
  return m;
}

}  // namespace train
