// fsdp-train --plan: the per-rank memory plan of any workload's preset (the GPT, T5, the DHEN-like
// model), without allocating it.
#include <algorithm>
#include <chrono>
#include <iostream>
#include <stdexcept>
#include <string>

#include <torch/torch.h>

#include "config.h"
#include "fsdp/deferred_init.h"
#include "fsdp/mesh.h"
#include "fsdp/plan.h"
#include "fsdp/tensor_parallel.h"
#include "keep_last_block.h"
#include "workload.h"

namespace train {

// The per-rank memory plan of the model in fp32 and in bf16 mixed precision, computed from a
// meta_init model: nothing is allocated, so any size can be planned on any machine.
int plan(const Config& c) {
  if (c.local || c.ddp_baseline) {
    // Their flags (--keep-gathered-after-forward and the like) would be planned as fsdp's.
    throw std::invalid_argument(std::string("--plan plans fsdp's sharding; ") + (c.local ? "--local" : "--ddp-baseline") +
                                " trains without it: drop one of the two (--strategy no_shard plans whole replicas)");
  }
  const auto workload = make_workload(c);
  const int W = c.plan_world;
  // Rank 0 of the planned job, alone and with stand-in collectives: a model with model-parallel
  // parts (the DHEN's embedding rows) is built as that rank holds it.
  // With --tp, its TP group splits the model (the plan of TP rank 0), and fsdp shards over the
  // W / TP data-parallel ranks, W / TP / hosts per host.
  const auto mesh = fsdp::Mesh::simulated(W, 0, c.tp > 1 ? std::min(c.plan_local, W) : 1);
  fsdp::TensorParallelOptions tp_options;
  tp_options.sequence_parallel = c.sequence_parallel;
  const auto tp = c.tp > 1 ? fsdp::TensorParallel::create(mesh, c.tp, tp_options) : nullptr;
  const int dp = W / c.tp, dp_local = c.tp > 1 ? std::max(1, std::min(c.plan_local, W) / c.tp) : c.plan_local;
  const auto t0 = std::chrono::steady_clock::now();
  auto model = fsdp::meta_init([&] { return workload->build(mesh); });
  if (tp) fsdp::parallelize(*model, tp, workload->tensor_parallel_plan());
  const double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Activations of one rank's micro-batch (a data-parallel rank's, which its TP ranks share), in
  // the compute dtype of each plan.
  const int64_t micro_batch = std::max<int64_t>(1, c.global_batch / dp / std::max(1, c.grad_accum));
  fsdp::Options opts = fsdp_options(c);
  std::vector<fsdp::MemoryPlan> plans;
  opts.mixed_precision.reset();
  workload->configure(opts, *model, micro_batch, 4, c.activation_checkpointing);
  resolve_keep_gathered(opts, *model, dp, dp_local);
  plans.push_back(fsdp::plan_memory(*model, dp, opts, dp_local));
  opts.mixed_precision = fsdp::MixedPrecision{};  // bf16 compute and reduce, fp32 master
  workload->configure(opts, *model, micro_batch, 2, c.activation_checkpointing);
  plans.push_back(fsdp::plan_memory(*model, dp, opts, dp_local));
  std::cout << "fsdp-train --plan: " << workload->name() << " (" << workload->num_parameters() / 1e9
            << " B parameters)" << (tp ? ", TP " + std::to_string(c.tp) + " x DP " + std::to_string(dp) : std::string())
            << ", global batch " << workload->batch_text(c.global_batch) << " ("
            << micro_batch << " per rank and micro-batch), built with meta_init in " << build_s
            << " s, nothing allocated\n\n"
            << fsdp::format_plans(plans) << std::endl;
  return 0;
}

}  // namespace train
