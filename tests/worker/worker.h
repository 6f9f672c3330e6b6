// One rank of a multi-process test. The gtest drivers (tests/test_*.cpp) launch W of these with
// fsdp's local launcher and assert on the JSON each rank writes to PREFIX.<rank>.json:
//
//   fsdp-test-worker MODE [flags] --out PREFIX
//
// Each mode is one file here, registered in main.cpp's table (as nccl-tests puts each collective
// behind one struct): parity, accounting, structure, overlap, dynamic, precision, scaler, sync,
// deferred, fuzz, fault, misuse, summon, checkpoint, checkpoint_ignored, recompute, holes, wire, tensor_parallel. Their flags and what they write are described at the top of each file.
// --device cuda runs parity on this rank's GPU (the GPU script's CUDA check; default cpu).
// Prefetch flags (any mode that shards): --backward-prefetch none|backward_pre|backward_post,
// --forward-prefetch 0|1, --prefetch-count N, --limit-all-gathers K.
#pragma once

#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "fsdp/fsdp.h"
#include "models/click_data.h"
#include "models/data.h"
#include "models/dhen.h"
#include "models/gpt.h"
#include "models/t5.h"

namespace worker {

using json = nlohmann::json;

constexpr int64_t kGlobalBatch = 12;  // divisible by every world size 1..4
constexpr int kSteps = 5;

struct Args {
  std::string mode, strategy = "full_shard", out = "/tmp/fsdp-worker", variants = "plain";
  int shard_size = 0, mismatch_rank = -1;
  std::string backward_prefetch = "backward_pre";
  std::string unit_detection = "dispatch_key";
  int forward_prefetch = 0, prefetch_count = 1, limit_all_gathers = 2;
  std::string device = "cpu";
  std::string param_dtype = "bf16", reduce_dtype;
  int inf_rank = -1, sync_module_states = 1;
  std::string model = "gpt";
  int keep_low_grads = 0;
  std::string seeds = "0:1";  // fuzz: seeds [A, B)
  std::string mixed_precision = "none";  // fuzz: none, bf16 or fp16 (param and reduce dtype)
  std::string fault = "kill", fault_at = "forward";  // fault: what happens, where
  int fault_rank = -1, fault_step = 2;
  std::string sequence;  // fuzz: explicit calls instead of random ones
  std::string features;  // fuzz: features forced on every seed (fuzz_models.h, Features::force)
  std::string mismatch_what = "model";  // structure: what differs on --mismatch-rank
  int calls = 12;             // fuzz: calls per sequence
  std::string hole;           // holes: which loop (holes.cpp)
  std::string path;           // checkpoint_hostile: the checkpoint (folder) it works on
  std::string quantize = "none";  // Options::quantize_all_gather (int8, fp8)
  int quantize_block = 64;
  int hpz = 0;                    // Options::reshard_after_forward_to
  std::string gloo_reduce_scatter = "ring";
  int tp = 2;                     // tensor_parallel: the TP size
};
Args parse(int argc, char** argv);
// The strategy and prefetch settings the flags ask for (no wrap policy: each mode picks its units).
fsdp::Options options_from(const Args& a);

// A mode: runs on this rank and returns what it writes (null: nothing to write).
using Mode = std::function<json(const std::shared_ptr<fsdp::Mesh>&, const Args&)>;

// Where models and batches live (--device).
extern torch::Device g_device;

const models::TokenSource& corpus();
// Slice [begin, end) of step `step`'s global batch of random [kGlobalBatch, 16] inputs and targets.
std::pair<torch::Tensor, torch::Tensor> uneven_batch(int64_t step, int64_t begin, int64_t end);
// "sgd": SGD with momentum; otherwise AdamW with no weight decay on biases and norms, as users do.
std::unique_ptr<torch::optim::Optimizer> make_optim(const std::string& kind, torch::nn::Module& m);
// Unique parameters by first name (libtorch lists a tied weight under each of its names).
std::vector<std::pair<std::string, torch::Tensor>> unique_params(torch::nn::Module& m);

// Language-model loss of the tiny GPT on slice [begin, end) of step `step`'s global batch.
template <typename Forward>
torch::Tensor gpt_loss(Forward&& fwd, int64_t step, int64_t begin, int64_t end) {
  auto cfg = models::GPTConfig::preset("tiny");
  auto [x, y] = corpus().batch(step, kGlobalBatch, cfg.block_size, 7, begin, end);
  return models::lm_loss(fwd(x.to(g_device)), y.to(g_device));
}

// Max |mine - ref| over this rank's slice of every parameter of `sharded`'s units, located with the
// FlatParameter layout; `ref` is a whole local model with the same parameter names. Throws when a
// shard does not have the size the layout says.
double max_shard_diff(const fsdp::FullyShardedDataParallelBase& sharded, torch::nn::Module& mine, torch::nn::Module& ref,
                      int rank);

// The last step's timeline: one object per span (kind, unit, backward, begin/start/end_ns, seq,
// end_seq, bytes).
json timeline_json(const fsdp::FullyShardedDataParallelBase& sharded);

// Sum of every rank's value, divided by W: the global mean of per-rank means of equal slices.
double global_mean(const std::shared_ptr<fsdp::Mesh>& mesh, const torch::Tensor& local);

// Blocks that run in a different order every step, and one of them not at all on odd steps: a
// model whose unit order changes between iterations (prefetch guesses are wrong half the time).
struct RoutedStackImpl : torch::nn::Module {
  RoutedStackImpl();
  torch::Tensor forward(const torch::Tensor& x, int64_t step);
  std::vector<torch::nn::Linear> blocks;
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(RoutedStack);

// A constructor that initializes the way libtorch users do: default kaiming for Conv2d and
// Linear, xavier and kaiming calls on registered tensors, a padding row zeroed through a view,
// a random factory, and BatchNorm buffers.
struct InitZooImpl : torch::nn::Module {
  InitZooImpl();
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear lin{nullptr};
  torch::Tensor xavier_w, kaiming_w, noise, first_half, second_half;
  torch::nn::Embedding emb{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(InitZoo);

// The modes (one file each).
json run_parity(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_accounting(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_structure(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_overlap(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_phases(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_dynamic(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_precision(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_scaler(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_sync(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_deferred(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_fuzz(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_fault(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_misuse(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_summon(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_checkpoint(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_checkpoint_ignored(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_recompute(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_holes(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_wire(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_tensor_parallel(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);
json run_checkpoint_hostile(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a);

// What fn threw ("" when it returned): for a worker that checks a refusal's message.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace worker
