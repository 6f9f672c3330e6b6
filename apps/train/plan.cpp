// fsdp-train --plan: the per-rank memory plan of a GPT or T5 preset, without allocating it.
#include <chrono>
#include <iostream>

#include <torch/torch.h>

#include "config.h"
#include "fsdp/deferred_init.h"
#include "fsdp/plan.h"
#include "models/t5.h"

namespace train {

namespace {

// The paper's T5 shapes (§5): the model's state, gathered units and gradients per rank, without
// activations (no estimate for T5 yet), in fp32 and bf16.
int plan_t5(const Config& c) {
  const auto cfg = models::T5Config::preset(c.model);
  const int W = c.plan_world;
  const auto t0 = std::chrono::steady_clock::now();
  auto model = fsdp::meta_init([&] { return models::T5(cfg); });
  const double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fsdp::Options opts = fsdp_options(c);
  opts.auto_wrap_policy = fsdp::module_type_policy<models::T5EncoderBlockImpl, models::T5DecoderBlockImpl>();
  opts.mixed_precision.reset();
  std::vector<fsdp::MemoryPlan> plans;
  plans.push_back(fsdp::plan_memory(*model, W, opts, c.plan_local));
  opts.mixed_precision = fsdp::MixedPrecision{};
  plans.push_back(fsdp::plan_memory(*model, W, opts, c.plan_local));
  std::cout << "fsdp-train --plan: T5 '" << c.model << "' (" << cfg.num_parameters() / 1e9 << " B parameters: "
            << cfg.n_layer << " encoder and " << cfg.n_layer << " decoder blocks, d_model " << cfg.d_model << ", d_ff "
            << cfg.d_ff << ", " << cfg.n_head << " heads of " << cfg.d_kv << ", vocab " << cfg.vocab_size
            << "), built with meta_init in " << build_s << " s, nothing allocated; activations not included\n\n"
            << fsdp::format_plans(plans) << std::endl;
  return 0;
}

}  // namespace

// The per-rank memory plan of the model in fp32 and in bf16 mixed precision, computed from a
// meta_init model: nothing is allocated, so any size can be planned on any machine.
int plan(const Config& c) {
  if (c.model.rfind("t5-", 0) == 0) return plan_t5(c);
  auto cfg = models::GPTConfig::preset(c.model);
  if (c.block_size > 0) cfg.block_size = c.block_size;
  cfg.fused_attention = c.attention == "fused";
  const int W = c.plan_world;
  const auto t0 = std::chrono::steady_clock::now();
  auto model = fsdp::meta_init([&] { return models::GPT(cfg); });
  const double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fsdp::Options opts = fsdp_options(c);
  // Activations of one rank's micro-batch, in the compute dtype of each plan.
  const int64_t micro_batch = std::max<int64_t>(1, c.global_batch / W / std::max(1, c.grad_accum));
  opts.mixed_precision.reset();  // planned both ways below
  opts.memory_budget.activation_bytes = cfg.activation_bytes(micro_batch, cfg.block_size, 4, c.activation_checkpointing);
  opts.memory_budget.head_activation_bytes = cfg.head_activation_bytes(micro_batch, cfg.block_size, 4);
  std::vector<fsdp::MemoryPlan> plans;
  plans.push_back(fsdp::plan_memory(*model, W, opts, c.plan_local));
  opts.mixed_precision = fsdp::MixedPrecision{};  // bf16 compute and reduce, fp32 master
  opts.memory_budget.activation_bytes = cfg.activation_bytes(micro_batch, cfg.block_size, 2, c.activation_checkpointing);
  opts.memory_budget.head_activation_bytes = cfg.head_activation_bytes(micro_batch, cfg.block_size, 2);
  plans.push_back(fsdp::plan_memory(*model, W, opts, c.plan_local));
  std::cout << "fsdp-train --plan: GPT '" << c.model << "' (" << cfg.n_layer << " layers, d_model " << cfg.d_model
            << ", " << cfg.n_head << " heads, vocab " << cfg.vocab_size << ", block " << cfg.block_size
            << "), global batch " << c.global_batch << " (" << micro_batch << " sequences per rank and micro-batch)"
            << ", built with meta_init in " << build_s << " s, nothing allocated\n\n"
            << fsdp::format_plans(plans) << std::endl;
  return 0;
}

}  // namespace train
