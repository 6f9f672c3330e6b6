// fsdp-train's settings: one field per command-line flag (cli.cpp), read by the modes: training
// (training_loop.cpp), --export-init (export_init.cpp) and --plan (plan.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/options.h"
#include "models/data.h"
#include "models/gpt.h"

namespace train {

struct Config {
  std::string strategy = "full_shard";
  int shard_size = 0;
  int steps = 300;
  int64_t global_batch = 0;  // 0 until parsed: then the flag, or the workload's default (workload.h)
  uint64_t seed = 1234;
  std::string metrics_jsonl;
  std::string data = models::kDefaultCorpus;
  std::string model = "default";
  int64_t block_size = 0;  // 0: the preset's
  int64_t n_kv_head = 0;
  int64_t vocab_size = 0;  // GPT: the embedding's rows (0: the preset's, or the corpus's if more)   // GPT: grouped-query attention's key/value heads (0: the preset's, n_head)
  double lr = 2e-3;
  std::string lr_schedule = "constant";  // or linear / cosine (lr_schedule.h)
  int warmup_steps = 0;
  double min_lr = 0.0;
  double weight_decay = 0.1;
  std::string optimizer = "adamw";  // adamw: fsdp::FusedAdamW; adamw-libtorch: torch::optim::AdamW
  double clip = 1.0;
  int log_every = 10;
  int grad_accum = 1;        // micro-batches per step; all but the last under no_sync
  int eval_every = 0;        // every N steps, the loss on a held-out batch (forward only); 0: never
  int threads = 0;           // intra-op threads per rank; 0: the cores divided among the local ranks
  bool local = false;        // baseline: plain libtorch training in one process, no fsdp
  bool ddp_baseline = false;  // baseline: every rank a whole replica, gradients all-reduced DDP-style (ddp_baseline.cpp)
  std::string export_init;   // write initial weights, batches and settings here, then exit
  std::string device = "cpu";
  std::string backward_prefetch = "backward_pre";
  std::string unit_detection = "dispatch_key";
  bool forward_prefetch = true;  // issue 38: exposed comm 6.7 % -> 1.2 % of the step at W = 2 (docs/performance.md)
  int prefetch_count = 1;
  int limit_all_gathers = 2;
  std::string gloo_reduce_scatter = "ring";  // or all_reduce (Gloo's own: twice the bytes)
  int reshard_after_forward_to = 0;          // hpZ; -1 (--hpz): the ranks per node
  std::vector<std::string> reshard_after_forward_to_unit;  // UNIT=N overrides
  std::vector<std::string> keep_gathered_after_forward = {"last"};  // units not freed after forward (keep_last_block.h)
  std::string quantize_all_gather = "none";  // qwZ: int8 or fp8
  int quantization_block = 64;
  std::string trace_dir;     // write each rank's Chrome trace of step `trace_step` here
  int trace_step = 2;
  std::string mixed_precision = "none";  // or bf16 / fp16: param and reduce dtype
  bool sync_module_states = false;
  bool activation_checkpointing = false;  // recompute every block in backward, keeping its input
  std::string attention = "fused";  // or "reference": written out (GPTConfig::fused_attention)
  double dropout = 0.0;             // the workload's dropout (GPT's blocks, T5's layers, DHEN's mix)
  int tp = 1;                       // tensor parallelism inside a host (2-D with fsdp across)
  bool sequence_parallel = false;   // --sequence-parallel: Megatron-SP under --tp
  // Fault tolerance (docs/cluster.md, "When a host fails"): replica groups that drop out and rejoin
  // while the others train on (a coordinator at MASTER_ADDR decides), and the membership changes a
  // run to compare with fixes in advance ("out:1@5,in:1@8").
  bool live_replicas = false;
  std::string live_schedule;
  bool state_hash = false;   // --state-hash: the JSONL ends with each rank's hash of its shards and optimizer state
  int max_restarts = 0;             // the local launcher's: restart from the newest checkpoint
  // How the model is built: "deferred" (fsdp::deferred_init, materialized unit by unit as shards:
  // no rank ever holds the whole model), "normal" (every rank builds it whole, then shards), or
  // "auto": deferred whenever the model is sharded (F > 1), normal otherwise.
  std::string init = "auto";
  // The per-rank memory budget the plan must fit: "auto" (available memory / local ranks on CPU,
  // the device's memory on CUDA), "0" (no check), or a size: 1.5GiB, 800MiB, 2e9.
  std::string max_memory = "auto";
  std::string memory_timeline;  // write each rank's memory through step `trace_step` here (CSV)
  // Checkpoints (docs/checkpoints.md).
  std::string save_dir;      // save checkpoints under this folder
  int save_every = 0;        // every N steps (and after the last step); 0: only after the last step
  std::string checkpoint_kind = "auto";  // full, sharded or local; auto: sharded, full with --tp
  bool async_save = false;   // write on a background thread while training continues
  int keep_last = 0;         // keep the newest K checkpoints; 0: all
  std::string resume;        // a checkpoint folder, or a --save-dir folder (its newest checkpoint)
  std::string export_full;   // after training, write the whole model to this .safetensors file
  std::string load_weights;  // before training, load weights from a .safetensors or torch.save file
  // The end of a run (run_folder.h, text_sample.h): where it keeps its checkpoint and model
  // ("auto": runs/<model>-<date>-<time>; "none": nothing unless --save-dir / --export-full ask),
  // and the text sample the trained GPT writes after --prompt.
  std::string run_dir = "auto";
  std::string prompt = "This program is ";
  int sample_tokens = 200;       // 0: no sample
  double temperature = 0.8;      // 0: greedy
  std::string sample_via = "summon";  // or "sharded" (text_sample.h)
  std::vector<std::string> args;  // the flags as given (after the launcher's), for the resume command
  bool plan = false;         // print the per-rank memory plan for plan_world ranks, then exit
  int plan_world = 0;
  int plan_local = 8;        // ranks per node, for the plan's hybrid strategies
  int nproc = 0;             // --nproc-per-node (the launcher consumes it; --plan reads it)
  // Run only this rank of a --world-size job, with stand-in collectives (Mesh::simulated): a
  // pre-flight check of one rank's memory and compute time. -1: a real run.
  int simulate_rank = -1;
  // With simulate_rank: build and time only this many of the model's blocks (a sample, where a
  // whole step of the simulated rank would take too long here); the memory plan stays the whole
  // model's, and the whole step's compute time is estimated from the sample by FLOPs. 0: all.
  int simulate_layers = 0;
};

// Parses argv into `c`. Returns an exit code when the program should stop (help, a bad flag).
std::optional<int> parse_cli(int argc, char** argv, Config& c);

// The GPT the flags ask for, with the vocabulary grown to the data's.
models::GPTConfig model_config(const Config& c, const models::TokenSource& data);
// The fsdp options the flags ask for; the workload (workload.h) adds its units and its
// activation estimate.
fsdp::Options fsdp_options(const Config& c);
// "auto" -> MemoryBudget::kAuto, "0" -> kOff, "1.5GiB" / "800MiB" / "64KiB" / "2e9" -> bytes.
int64_t parse_memory_size(const std::string& text);

// The modes.
int train(const Config& c);        // one rank of a training run
int export_init(const Config& c);  // --export-init
int plan(const Config& c);         // --plan

}  // namespace train
