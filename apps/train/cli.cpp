// fsdp-train's command line.
#include <cstdio>
#include <map>
#include <optional>

#include <CLI/CLI.hpp>

#include "config.h"
#include "workload.h"

namespace train {

std::optional<int> parse_cli(int argc, char** argv, Config& c) {
  CLI::App app{"fsdp-train: train a GPT, T5 or DHEN-like model with Fully Sharded Data Parallel on libtorch"};
  app.add_option("--nproc-per-node", c.nproc, "spawn this many local ranks (otherwise use the torchrun environment)");
  app.add_option("--strategy", c.strategy, "full_shard|shard_grad_op|no_shard|hybrid_shard|hybrid_shard_zero2")
      ->check(CLI::IsMember({"full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"}));
  app.add_option("--shard-size", c.shard_size, "sharding factor F for hybrid strategies (default: ranks per node)");
  app.add_option("--steps", c.steps, "training steps")->check(CLI::NonNegativeNumber);
  app.add_option("--global-batch-size", c.global_batch,
                 "sequences (DHEN: examples) per step, over all ranks; default 16 (DHEN: 256)")->check(CLI::PositiveNumber);
  app.add_option("--seed", c.seed, "seed for the initial weights and the batches");
  app.add_option("--metrics-jsonl", c.metrics_jsonl, "append one JSON object per step per rank to this file");
  app.add_option("--data", c.data, "text file, folder of text files, or .u16/.bin file of uint16 token ids");
  app.add_option("--model", c.model, "GPT preset: tiny, small, default, medium (25 M parameters), large (50 M), 200m (203 M), 1b, 175b (--plan); "
                 "T5 (sequence to sequence: reverse the text): t5-tiny, t5-small, t5-large, t5-3b, t5-11b (--plan); "
                 "DHEN-like recommendation model (synthetic clicks): dhen-tiny, dhen-small, dhen-large");
  app.add_option("--block-size", c.block_size, "sequence length (default: the preset's)");
  app.add_option("--vocab-size", c.vocab_size, "GPT: the embedding's and head's rows, at least the corpus's (GPT-2's "
                 "50257; under --tp a size the TP size does not divide is padded to a multiple, saved unpadded)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--n-kv-head", c.n_kv_head, "GPT: grouped-query attention with this many key/value heads, each shared "
                 "by n_head / N query heads (default: as many as query heads); under --tp, a TP size that divides N splits "
                 "them, one that N divides replicates them")->check(CLI::NonNegativeNumber);
  app.add_option("--lr", c.lr, "AdamW learning rate (the peak of --lr-schedule)");
  app.add_option("--lr-schedule", c.lr_schedule, "constant, or after --warmup-steps a linear or cosine decay from --lr to "
                 "--min-lr at the last step; a checkpoint saves the schedule and a resumed run continues it")
      ->check(CLI::IsMember({"constant", "linear", "cosine"}));
  app.add_option("--warmup-steps", c.warmup_steps, "raise the learning rate linearly from --lr/N to --lr over the first N steps");
  app.add_option("--min-lr", c.min_lr, "the learning rate a linear or cosine --lr-schedule ends at (default 0)");
  app.add_option("--optimizer", c.optimizer, "adamw: fsdp::FusedAdamW, one vectorized pass over each shard (moments bit "
                 "for bit libtorch's; parameters within a rounding per step: docs/performance.md); adamw-libtorch: "
                 "torch::optim::AdamW, operator by operator. Checkpoints of either load into the other.")
      ->check(CLI::IsMember({"adamw", "adamw-libtorch"}));
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
  app.add_option("--unit-detection", c.unit_detection,
                 "how fsdp knows a unit runs: dispatch_key (operators on parameters only) or record_function "
                 "(every operator; for code that aliases parameter storage behind the dispatcher)")
      ->check(CLI::IsMember({"dispatch_key", "record_function"}));
  app.add_option("--backward-prefetch", c.backward_prefetch, "none|backward_pre|backward_post")
      ->check(CLI::IsMember({"none", "backward_pre", "backward_post"}));
  app.add_flag("--forward-prefetch,!--no-forward-prefetch", c.forward_prefetch,
               "prefetch in forward from the previous iteration's order (static graphs; on by default: the workloads "
               "here are static)");
  app.add_option("--prefetch-count", c.prefetch_count, "how many units ahead a prefetch reaches")->check(CLI::PositiveNumber);
  app.add_option("--limit-all-gathers", c.limit_all_gathers, "rate limiter: all-gathers in flight at most (0: off)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--gloo-reduce-scatter", c.gloo_reduce_scatter,
                 "how CPU shard groups reduce-scatter gradients: ring (fsdp's, (F-1)/F of them per rank) or all_reduce "
                 "(Gloo's, twice the bytes)")
      ->check(CLI::IsMember({"ring", "all_reduce"}));
  app.add_option("--reshard-after-forward-to", c.reshard_after_forward_to,
                 "hpZ: after a unit's forward keep it sharded over groups of N consecutive ranks (1/N per rank) so "
                 "backward gathers within them; 0: off")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--reshard-after-forward-to-unit", c.reshard_after_forward_to_unit,
                 "UNIT=N: hpZ for one unit (its module path, e.g. blocks.0) instead of the default; N = 0 frees it "
                 "fully after forward; repeatable");
  app.add_option("--keep-gathered-after-forward", c.keep_gathered_after_forward,
                 "UNIT[,UNIT]: these units stay gathered from their forward to their backward (FSDP2's "
                 "reshard_after_forward=False per module); 'last': the model's last block (blocks.3 of the default "
                 "GPT), which saves backward's first all-gather, under full_shard and hybrid_shard; 'none': no unit")
      ->delimiter(',');
  app.add_flag_callback("--hpz", [&c] { c.reshard_after_forward_to = fsdp::Options::kRanksPerNode; },
                        "hpZ with N = the ranks per node: backward's all-gathers never cross hosts");
  app.add_option("--quantize-all-gather", c.quantize_all_gather,
                 "qwZ: all-gather parameters quantized per block (int8 or fp8 e4m3, one fp32 scale per block), "
                 "dequantized into the compute dtype; none: off")
      ->check(CLI::IsMember({"none", "int8", "fp8"}));
  app.add_option("--quantize-block", c.quantization_block, "elements per quantization scale")->check(CLI::PositiveNumber);
  app.add_option("--trace", c.trace_dir, "write each rank's Chrome trace (trace-rank<r>.json) of one step to this folder");
  app.add_option("--trace-step", c.trace_step, "which step --trace records (default 2: after warm-up)")->check(CLI::NonNegativeNumber);
  app.add_flag("--activation-checkpointing", c.activation_checkpointing,
               "keep only each block's input in forward and recompute the block in backward (less activation memory, "
               "one more forward of the blocks)");
  app.add_option("--attention", c.attention,
                 "fused (at::scaled_dot_product_attention) or reference (written out: matmul, masked_fill, softmax, matmul)")
      ->check(CLI::IsMember({"fused", "reference"}));
  app.add_option("--tp", c.tp,
                 "tensor parallelism: split the GPT's or T5's layers over N consecutive ranks of a host "
                 "(Megatron-style column/row-parallel layers, vocabulary-parallel embedding and loss) and shard with "
                 "fsdp over the W/N data-parallel ranks; N divides the ranks per host, the heads and the vocabulary. "
                 "Default 1")
      ->check(CLI::PositiveNumber);
  app.add_flag("--sequence-parallel", c.sequence_parallel,
               "with --tp: sequence parallelism (Megatron-SP): between the split layers (norms, dropout, residual) "
               "each TP rank holds its 1/N chunk of the sequence; the TP all-reduces become all-gather / "
               "reduce-scatter pairs. The sequence length must be a multiple of N");
  app.add_flag("--live-replicas", c.live_replicas,
               "hybrid strategies: when a replica group (the ranks of a shard group) fails, the others discard that "
               "step and train on without it; a replacement joins at a step boundary with a live group's state. "
               "With --nproc-per-node this process is the coordinator; ranks started otherwise (torchrun) need "
               "fsdp-coordinator at MASTER_ADDR:MASTER_PORT (docs/cluster.md)");
  app.add_option("--live-schedule", c.live_schedule,
                 "with --live-replicas: membership changes fixed in advance, out:R@S,in:R@T (group R sits out from "
                 "step S, back at step T): the run a failure is compared with");
  app.add_flag("--state-hash", c.state_hash,
               "end the --metrics-jsonl with a state_hash row per rank: a hash of its shards and optimizer state, to "
               "compare runs bit for bit (always there with --live-replicas)");
  app.add_option("--max-restarts", c.max_restarts,
                 "with --nproc-per-node: when a rank fails, restart every rank from the newest checkpoint under "
                 "--save-dir (or the run folder) up to N times; with --live-replicas, start only the failed rank "
                 "again, as a replacement that joins the groups training on (each rank restarted counts)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--dropout", c.dropout,
                 "dropout probability in the model (GPT: each block's attention and MLP outputs; T5: its layers; "
                 "DHEN: each layer's mix); default 0: none. Each rank draws its masks from its own generator, saved "
                 "and restored with checkpoints")
      ->check(CLI::Range(0.0, 0.95));
  app.add_option("--mixed-precision", c.mixed_precision, "none, bf16 or fp16 (fp16 adds the sharded gradient scaler)")
      ->check(CLI::IsMember({"none", "bf16", "fp16"}));
  app.add_flag("--sync-module-states", c.sync_module_states, "broadcast rank 0's initial weights to every rank");
  app.add_option("--init", c.init,
                 "how the model is built: deferred (materialized unit by unit as shards), normal (built whole, "
                 "then sharded), auto (deferred when sharded, F > 1)")
      ->check(CLI::IsMember({"auto", "deferred", "normal"}));
  app.add_option("--max-memory-per-rank", c.max_memory,
                 "refuse, before building anything, a configuration whose memory plan exceeds this per rank: "
                 "auto (available memory / local ranks; the device's memory on CUDA), 0 (no check), or a size "
                 "such as 1.5GiB, 800MiB, 2e9");
  app.add_option("--memory-timeline", c.memory_timeline,
                 "write each rank's memory through step --trace-step, sampled every millisecond, to "
                 "DIR/memory-rank*.csv");
  app.add_option("--save-dir", c.save_dir, "save checkpoints under this folder (step-00000010/, ...): every --save-every "
                 "steps and after the last step");
  app.add_option("--save-every", c.save_every, "save a checkpoint every N steps (0: only after the last step)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--checkpoint-kind", c.checkpoint_kind,
                 "sharded (each rank its pieces; reshardable; readable by torch.distributed.checkpoint), full (one "
                 "file gathered by rank 0) or local (raw shards; same layout only); default: sharded, full with --tp "
                 "(the only kind that puts a split parameter's parts together)")
      ->check(CLI::IsMember({"auto", "full", "sharded", "local"}));
  app.add_flag("--async-save", c.async_save, "copy the state to host memory and write it on a background thread");
  app.add_option("--keep-last", c.keep_last, "keep only the newest K checkpoints (0: all)")->check(CLI::NonNegativeNumber);
  app.add_option("--resume", c.resume, "resume from this checkpoint folder, or from the newest one under this --save-dir");
  app.add_option("--export-full", c.export_full, "after training, write the whole model to this .safetensors file");
  app.add_option("--load-weights", c.load_weights,
                 "before training, load the model's weights from a .safetensors file or a torch.save file of a dict");
  app.add_option("--run-dir", c.run_dir,
                 "keep the run's checkpoint (checkpoints/), the whole model (model.safetensors) and summary.json in "
                 "this folder; auto: runs/<model>-<date>-<time>; none: keep nothing")
      ->capture_default_str();
  app.add_option("--prompt", c.prompt, "the text the GPT's sample at the end of the run starts from")->capture_default_str();
  app.add_option("--sample-tokens", c.sample_tokens, "tokens the trained GPT writes after --prompt at the end (0: none)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--temperature", c.temperature, "the sample's temperature (0: always the most likely token)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--sample-via", c.sample_via,
                 "how the sample runs the model: summon (summon_full_params on rank 0: the model gathered once) or "
                 "sharded (the wrapped forward on every rank: gathered per token)")
      ->check(CLI::IsMember({"summon", "sharded"}))->capture_default_str();
  app.add_flag("--plan", c.plan, "print the per-rank memory plan (fp32 and bf16) without allocating the model, then exit");
  app.add_option("--world-size", c.plan_world, "--plan and --simulate-rank: the job's ranks (default: --nproc-per-node)")
      ->check(CLI::PositiveNumber);
  app.add_option("--ranks-per-node", c.plan_local,
                 "--plan and --simulate-rank: ranks per node (the hybrid strategies' default F)")
      ->check(CLI::PositiveNumber);
  app.add_option("--simulate-layers", c.simulate_layers,
                 "--simulate-rank: build and time only N of the model's blocks, and estimate the whole step's compute "
                 "from them (the memory plan stays the whole model's)")
      ->check(CLI::PositiveNumber);
  app.add_option("--simulate-rank", c.simulate_rank,
                 "run only this rank of a --world-size job in this process, every collective a stand-in: its real "
                 "memory peaks and compute time, before booking the cluster (losses are not trained results)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--local", c.local, "baseline: plain libtorch training in one process, without fsdp");
  app.add_flag("--ddp-baseline", c.ddp_baseline,
               "baseline: every rank holds the whole model and averages gradients with bucketed all-reduces during "
               "backward, as PyTorch's DDP does, without fsdp (the paper's Fig. 6a compares it with --strategy no_shard)");
  app.add_option("--export-init", c.export_init,
                 "write the initial weights, every step's batch and the settings to this folder, then exit");
  // CLI11 reads "--flag=" (an empty value) as "--flag" and takes the next argument as its value,
  // even another flag ("--run-dir= --steps 3" would write to a folder named "--steps"): refuse it.
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg.size() > 3 && arg.rfind("--", 0) == 0 && arg.back() == '=') {
      const std::string name = arg.substr(0, arg.size() - 1);
      const CLI::Option* opt = app.get_option_no_throw(name);
      if (opt != nullptr && opt->get_expected_max() == 0) {
        std::fprintf(stderr, "fsdp-train: %s takes no value: write %s\n", arg.c_str(), name.c_str());
      } else {
        std::fprintf(stderr, "fsdp-train: %s has an empty value: give one (%sVALUE), or leave %s out for its default\n",
                     arg.c_str(), arg.c_str(), name.c_str());
      }
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // An empty value ("--save-dir \"$DIR\"" with DIR unset) would quietly mean "none" or "here".
  for (const CLI::Option* opt : app.get_options()) {
    if (opt->get_expected_max() == 0 || opt->get_name() == "--prompt") continue;  // flags take no value
    for (const std::string& value : opt->results()) {
      if (value.empty()) {
        std::fprintf(stderr, "fsdp-train: %s was given an empty value: give one, or leave %s out for its default\n",
                     opt->get_name().c_str(), opt->get_name().c_str());
        return 2;
      }
    }
  }
  if (c.global_batch == 0) c.global_batch = default_global_batch(c.model);
  c.args.assign(argv + 1, argv + argc);
  return std::nullopt;
}

models::GPTConfig model_config(const Config& c, const models::TokenSource& data) {
  auto cfg = models::GPTConfig::preset(c.model);
  cfg.vocab_size = std::max<int64_t>(cfg.vocab_size, data.vocab_size());
  if (c.vocab_size > 0) {
    if (c.vocab_size < data.vocab_size()) {
      throw std::invalid_argument("--vocab-size " + std::to_string(c.vocab_size) + " is smaller than the corpus's " +
                                  std::to_string(data.vocab_size()) + " token ids: give at least that");
    }
    cfg.vocab_size = c.vocab_size;
  }
  if (c.block_size > 0) cfg.block_size = c.block_size;
  if (c.n_kv_head > 0) cfg.n_kv_head = c.n_kv_head;
  cfg.fused_attention = c.attention == "fused";
  cfg.tensor_parallel = c.tp;
  cfg.sequence_parallel = c.sequence_parallel && c.tp > 1;
  cfg.dropout = c.dropout;
  return cfg;
}

fsdp::Options fsdp_options(const Config& c) {
  fsdp::Options opts;
  opts.strategy = fsdp::parse_strategy(c.strategy);
  opts.shard_size = c.shard_size;
  opts.backward_prefetch = fsdp::parse_backward_prefetch(c.backward_prefetch);
  opts.unit_detection = fsdp::parse_unit_detection(c.unit_detection);
  opts.forward_prefetch = c.forward_prefetch;
  opts.prefetch_count = c.prefetch_count;
  opts.limit_all_gathers = c.limit_all_gathers;
  opts.gloo_reduce_scatter = fsdp::parse_gloo_reduce_scatter(c.gloo_reduce_scatter);
  opts.reshard_after_forward_to = c.reshard_after_forward_to;
  for (const auto& item : c.reshard_after_forward_to_unit) {
    const auto eq = item.rfind('=');
    int n = -2;
    try {
      if (eq != std::string::npos) n = std::stoi(item.substr(eq + 1));
    } catch (const std::exception&) {
      n = -2;
    }
    if (eq == std::string::npos || n < 0) {
      throw std::invalid_argument("--reshard-after-forward-to-unit wants UNIT=N with N >= 0 (e.g. blocks.0=2), got '" +
                                  item + "'");
    }
    opts.reshard_after_forward_to_by_unit[item.substr(0, eq)] = n;
  }
  opts.keep_gathered_after_forward = c.keep_gathered_after_forward;
  opts.quantize_all_gather = fsdp::parse_all_gather_quantization(c.quantize_all_gather);
  opts.quantization_block = c.quantization_block;
  opts.sync_module_states = c.sync_module_states;
  if (c.mixed_precision != "none") {
    const auto dtype = fsdp::parse_dtype(c.mixed_precision);
    opts.mixed_precision = fsdp::MixedPrecision{dtype, dtype, dtype, false};
  }
  opts.memory_budget.max_bytes_per_rank = parse_memory_size(c.max_memory);
  opts.memory_budget.async_checkpoint = c.async_save && c.device == "cpu";
  return opts;
}

int64_t parse_memory_size(const std::string& text) {
  if (text == "auto") return fsdp::MemoryBudget::kAuto;
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  static const std::map<std::string, double> units = {{"", 1.0}, {"B", 1.0}, {"KiB", 1024.0}, {"MiB", 1024.0 * 1024},
                                                      {"GiB", 1024.0 * 1024 * 1024}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}};
  const auto it = units.find(unit);
  if (used == 0 || it == units.end() || value < 0) {
    throw std::invalid_argument("--max-memory-per-rank '" + text +
                                "' is not a size: use auto, 0 (no check), or a number with an optional unit "
                                "(B, KiB, MiB, GiB, KB, MB, GB), e.g. 1.5GiB");
  }
  return static_cast<int64_t>(value * it->second);
}

}  // namespace train
