// fsdp-train's command line.
#include <optional>

#include <CLI/CLI.hpp>

#include "config.h"

namespace train {

std::optional<int> parse_cli(int argc, char** argv, Config& c) {
  CLI::App app{"fsdp-train: train a GPT with Fully Sharded Data Parallel on libtorch"};
  app.add_option("--nproc-per-node", c.nproc, "spawn this many local ranks (otherwise use the torchrun environment)");
  app.add_option("--strategy", c.strategy, "full_shard|shard_grad_op|no_shard|hybrid_shard|hybrid_shard_zero2")
      ->check(CLI::IsMember({"full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"}));
  app.add_option("--shard-size", c.shard_size, "sharding factor F for hybrid strategies (default: ranks per node)");
  app.add_option("--steps", c.steps, "training steps")->check(CLI::NonNegativeNumber);
  app.add_option("--global-batch-size", c.global_batch, "sequences per step, over all ranks")->check(CLI::PositiveNumber);
  app.add_option("--seed", c.seed, "seed for the initial weights and the batches");
  app.add_option("--metrics-jsonl", c.metrics_jsonl, "append one JSON object per step per rank to this file");
  app.add_option("--data", c.data, "text file, folder of text files, or .u16/.bin file of uint16 token ids");
  app.add_option("--model", c.model, "GPT preset: tiny, small, default, medium, 1b");
  app.add_option("--block-size", c.block_size, "sequence length (default: the preset's)");
  app.add_option("--lr", c.lr, "AdamW learning rate");
  app.add_option("--clip", c.clip, "clip gradients to this global norm (0: off)");
  app.add_option("--log-every", c.log_every, "print every N steps")->check(CLI::PositiveNumber);
  app.add_option("--grad-accum", c.grad_accum,
                 "micro-batches per step (gradient accumulation; all but the last without communication)")
      ->check(CLI::PositiveNumber);
  app.add_option("--eval-every", c.eval_every, "every N steps, print the loss on a held-out batch (0: never)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", c.threads, "intra-op threads per rank (default: the cores divided among the local ranks)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--device", c.device, "cpu (Gloo) or cuda (NCCL; rank i uses GPU i mod the visible count)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--backward-prefetch", c.backward_prefetch, "none|backward_pre|backward_post")
      ->check(CLI::IsMember({"none", "backward_pre", "backward_post"}));
  app.add_flag("--forward-prefetch", c.forward_prefetch, "prefetch in forward from the previous iteration's order (static graphs)");
  app.add_option("--prefetch-count", c.prefetch_count, "how many units ahead a prefetch reaches")->check(CLI::PositiveNumber);
  app.add_option("--limit-all-gathers", c.limit_all_gathers, "rate limiter: all-gathers in flight at most (0: off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--trace", c.trace_dir, "write each rank's Chrome trace (trace-rank<r>.json) of one step to this folder");
  app.add_option("--trace-step", c.trace_step, "which step --trace records (default 2: after warm-up)")->check(CLI::NonNegativeNumber);
  app.add_option("--mixed-precision", c.mixed_precision, "none, bf16 or fp16 (fp16 adds the sharded gradient scaler)")
      ->check(CLI::IsMember({"none", "bf16", "fp16"}));
  app.add_flag("--sync-module-states", c.sync_module_states, "broadcast rank 0's initial weights to every rank");
  app.add_flag("--plan", c.plan, "print the per-rank memory plan (fp32 and bf16) without allocating the model, then exit");
  app.add_option("--world-size", c.plan_world, "--plan: ranks to plan for (default: --nproc-per-node)")->check(CLI::PositiveNumber);
  app.add_option("--ranks-per-node", c.plan_local, "--plan: ranks per node (the hybrid strategies' default F)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--local", c.local, "baseline: plain libtorch training in one process, without fsdp");
  app.add_option("--export-init", c.export_init,
                 "write the initial weights, every step's batch and the settings to this folder, then exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return std::nullopt;
}

models::GPTConfig model_config(const Config& c, const models::TokenSource& data) {
  auto cfg = models::GPTConfig::preset(c.model);
  cfg.vocab_size = std::max<int64_t>(cfg.vocab_size, data.vocab_size());
  if (c.block_size > 0) cfg.block_size = c.block_size;
  return cfg;
}

fsdp::Options fsdp_options(const Config& c) {
  fsdp::Options opts;
  opts.strategy = fsdp::parse_strategy(c.strategy);
  opts.shard_size = c.shard_size;
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  opts.backward_prefetch = fsdp::parse_backward_prefetch(c.backward_prefetch);
  opts.forward_prefetch = c.forward_prefetch;
  opts.prefetch_count = c.prefetch_count;
  opts.limit_all_gathers = c.limit_all_gathers;
  opts.sync_module_states = c.sync_module_states;
  if (c.mixed_precision != "none") {
    const auto dtype = fsdp::parse_dtype(c.mixed_precision);
    opts.mixed_precision = fsdp::MixedPrecision{dtype, dtype, dtype, false};
  }
  return opts;
}

}  // namespace train
