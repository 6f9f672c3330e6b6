// fsdp-train: the main job. Trains a GPT-style decoder (plain libtorch, models/gpt.h) on real text
// with a byte-level tokenizer, sharded with fsdp across local ranks (--nproc-per-node) or ranks
// started by torchrun. The global batch is fixed whatever the world size, so runs at different W
// compute the same math.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <cstdio>
#include <iostream>
#include <optional>
#include <thread>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "fsdp/fsdp.h"
#include "fsdp/deferred_init.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/plan.h"
#include "fsdp/launch.h"
#include "models/data.h"
#include "models/gpt.h"

namespace {

struct Config {
  std::string strategy = "full_shard";
  int shard_size = 0;
  int steps = 300;
  int64_t global_batch = 16;
  uint64_t seed = 1234;
  std::string metrics_jsonl;
  std::string data = models::kDefaultCorpus;
  std::string model = "default";
  int64_t block_size = 0;  // 0: the preset's
  double lr = 2e-3;
  double weight_decay = 0.1;
  double clip = 1.0;
  int log_every = 10;
  bool local = false;  // baseline: plain libtorch training in one process, no fsdp
  std::string export_init;  // write initial weights, batches and settings here, then exit
  std::string device = "cpu";
  std::string backward_prefetch = "backward_pre";
  bool forward_prefetch = false;
  int prefetch_count = 1;
  int limit_all_gathers = 2;
  std::string trace_dir;    // write each rank's Chrome trace of step `trace_step` here
  int trace_step = 2;
  std::string mixed_precision = "none";  // or bf16 / fp16: param and reduce dtype
  bool sync_module_states = false;
  bool plan = false;        // print the per-rank memory plan for plan_world ranks, then exit
  int plan_world = 0;
  int plan_local = 8;       // ranks per node, for the plan's hybrid strategies
};

// One JSON line per write() on an O_APPEND descriptor: ranks can share the file.
class JsonlWriter {
 public:
  explicit JsonlWriter(const std::string& path) {
    if (path.empty()) return;
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd_ < 0) throw std::runtime_error("cannot open --metrics-jsonl file '" + path + "' for appending");
  }
  ~JsonlWriter() { if (fd_ >= 0) ::close(fd_); }
  void write(const nlohmann::json& j) {
    if (fd_ < 0) return;
    const std::string line = j.dump() + "\n";
    if (::write(fd_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
      throw std::runtime_error("writing the metrics file failed");
    }
  }
 private:
  int fd_ = -1;
};

std::string mb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MB", bytes / 1e6);
  return buf;
}

models::GPTConfig model_config(const Config& c, const models::TokenSource& data) {
  auto cfg = models::GPTConfig::preset(c.model);
  cfg.vocab_size = std::max<int64_t>(cfg.vocab_size, data.vocab_size());
  if (c.block_size > 0) cfg.block_size = c.block_size;
  return cfg;
}

// For training the same run elsewhere (bench/vs_pytorch.py): the initial weights every rank starts
// from, every step's global batch, and the settings, in files Python's torch.load reads.
int export_init(const Config& c) {
  namespace fs = std::filesystem;
  fs::create_directories(c.export_init);
  auto data = models::TokenSource::from_path(c.data);
  const auto cfg = model_config(c, data);
  torch::manual_seed(c.seed);
  models::GPT model(cfg);
  auto write = [&](const std::string& name, const c10::impl::GenericDict& dict) {
    const std::vector<char> bytes = torch::pickle_save(dict);
    const fs::path tmp = fs::path(c.export_init) / (name + ".tmp"), dst = fs::path(c.export_init) / name;
    std::ofstream f(tmp, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f.flush()) throw std::runtime_error("writing " + tmp.string() + " failed");
    f.close();
    fs::rename(tmp, dst);  // never a half-written file under the final name
  };
  c10::impl::GenericDict weights(c10::StringType::get(), c10::TensorType::get());
  for (const auto& item : model->named_parameters()) weights.insert(item.key(), item.value().detach().clone());
  write("init.pt", weights);
  std::vector<torch::Tensor> xs, ys;
  for (int step = 0; step < c.steps; ++step) {
    auto [x, y] = data.batch(step, c.global_batch, cfg.block_size, c.seed, 0, c.global_batch);
    xs.push_back(x);
    ys.push_back(y);
  }
  c10::impl::GenericDict batches(c10::StringType::get(), c10::TensorType::get());
  batches.insert("x", torch::stack(xs));
  batches.insert("y", torch::stack(ys));
  write("batches.pt", batches);
  const nlohmann::json settings = {
      {"vocab_size", cfg.vocab_size}, {"block_size", cfg.block_size}, {"n_layer", cfg.n_layer},
      {"n_head", cfg.n_head}, {"d_model", cfg.d_model}, {"steps", c.steps}, {"global_batch", c.global_batch},
      {"lr", c.lr}, {"weight_decay", c.weight_decay}, {"clip", c.clip}, {"seed", c.seed},
      {"adamw", {{"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}}},
      {"no_decay_rule", "parameter name contains 'bias' or 'ln'; the tied weight once, first name wins"}};
  std::ofstream(fs::path(c.export_init) / "config.json") << settings.dump(2) << "\n";
  std::cout << "fsdp-train: wrote " << model->named_parameters().size() << " tensors, " << c.steps
            << " batches and config.json to " << c.export_init << std::endl;
  return 0;
}

// The fsdp options the flags ask for; the GPT's blocks are the units.
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

// The per-rank memory plan of the model in fp32 and in bf16 mixed precision, computed from a
// meta_init model: nothing is allocated, so any size can be planned on any machine.
int plan(const Config& c) {
  auto cfg = models::GPTConfig::preset(c.model);
  if (c.block_size > 0) cfg.block_size = c.block_size;
  const int W = c.plan_world;
  const auto t0 = std::chrono::steady_clock::now();
  auto model = fsdp::meta_init([&] { return models::GPT(cfg); });
  const double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fsdp::Options opts = fsdp_options(c);
  opts.mixed_precision.reset();  // planned both ways below
  std::vector<fsdp::MemoryPlan> plans;
  plans.push_back(fsdp::plan_memory(*model, W, opts, c.plan_local));
  opts.mixed_precision = fsdp::MixedPrecision{};  // bf16 compute and reduce, fp32 master
  plans.push_back(fsdp::plan_memory(*model, W, opts, c.plan_local));
  std::cout << "fsdp-train --plan: GPT '" << c.model << "' (" << cfg.n_layer << " layers, d_model " << cfg.d_model
            << ", " << cfg.n_head << " heads, vocab " << cfg.vocab_size << ", block " << cfg.block_size
            << "), built with meta_init in " << build_s << " s, nothing allocated\n\n"
            << fsdp::format_plans(plans) << std::endl;
  return 0;
}

int train(const Config& c) {
  const fsdp::LaunchEnv env = fsdp::LaunchEnv::from_environment();
  // Share the cores among the local ranks instead of oversubscribing them.
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  torch::set_num_threads(std::max(1, cores / env.local_world_size));
  auto mesh = fsdp::Mesh::create(env);
  const int W = mesh->world_size(), rank = mesh->rank();
  if (c.global_batch % W != 0) {
    throw std::invalid_argument("--global-batch-size " + std::to_string(c.global_batch) +
                                " is not divisible by the world size " + std::to_string(W) +
                                "; choose a multiple of " + std::to_string(W));
  }

  auto data = models::TokenSource::from_path(c.data);
  const auto cfg = model_config(c, data);
  torch::manual_seed(c.seed);  // the same initial weights on every rank
  models::GPT model(cfg);
  torch::Device device(torch::kCPU);
  if (c.device == "cuda") {
    if (!torch::cuda::is_available()) throw std::invalid_argument("--device cuda: no CUDA device is visible to this process");
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank % torch::cuda::device_count()));
    // NCCL talks to the current device: make it this rank's.
    c10::impl::getDeviceGuardImpl(torch::kCUDA)->setDevice(device);
    model->to(device);  // keeps the parameters' identity (the tied weight stays tied)
  }

  if (!c.trace_dir.empty() && c.trace_step >= c.steps) {
    throw std::invalid_argument("--trace-step " + std::to_string(c.trace_step) + " is not below --steps " +
                                std::to_string(c.steps) + "; pick a step that runs");
  }
  if (c.local && W != 1) throw std::invalid_argument("--local trains in one process; drop --nproc-per-node");
  const fsdp::Options opts = fsdp_options(c);
  if (c.local && c.mixed_precision != "none") throw std::invalid_argument("--mixed-precision needs fsdp; drop --local");
  // fp16's narrow range needs loss scaling; bf16 has fp32's range and does not.
  std::optional<fsdp::ShardedGradScaler> scaler;
  if (c.mixed_precision == "fp16") scaler.emplace(mesh);
  std::optional<fsdp::FullyShardedDataParallel<models::GPTImpl>> fsdp_model;
  if (!c.local) fsdp_model.emplace(model, mesh, opts);

  // No weight decay on biases, norms and embeddings' 1-D friends: parameters keep their names.
  std::vector<torch::Tensor> decay, no_decay;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : model->named_parameters()) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // tied weight once
    const bool exempt = item.key().find("bias") != std::string::npos || item.key().find("ln") != std::string::npos;
    (exempt ? no_decay : decay).push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(c.lr).weight_decay(c.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(c.lr).weight_decay(0.0)));
  torch::optim::AdamW optim(groups, torch::optim::AdamWOptions(c.lr));

  std::vector<torch::Tensor> unique_params;
  for (const auto& p : decay) unique_params.push_back(p);
  for (const auto& p : no_decay) unique_params.push_back(p);
  if (rank == 0) {
    std::cout << "fsdp-train: GPT '" << c.model << "' " << cfg.num_parameters() << " parameters, "
              << (c.local ? std::string("local training (no fsdp)")
                          : std::to_string(fsdp_model->units().size()) + " units, strategy " + c.strategy +
                                " F=" + std::to_string(fsdp_model->shard_size()))
              << ", W=" << W << ", global batch " << c.global_batch << " x " << cfg.block_size
              << " tokens, corpus " << data.origin() << " (" << data.size() << " tokens)" << std::endl;
  }
  JsonlWriter metrics_out(c.metrics_jsonl);
  const int64_t per_rank = c.global_batch / W;
  const double tokens_per_step = static_cast<double>(c.global_batch * cfg.block_size);
  for (int step = 0; step < c.steps; ++step) {
    if (fsdp_model) fsdp_model->reset_step();
    const auto t0 = std::chrono::steady_clock::now();
    auto [x, y] = data.batch(step, c.global_batch, cfg.block_size, c.seed, rank * per_rank, (rank + 1) * per_rank);
    if (device.is_cuda()) {
      x = x.to(device, /*non_blocking=*/true);
      y = y.to(device, /*non_blocking=*/true);
    }
    optim.zero_grad();
    auto loss = models::lm_loss(fsdp_model ? fsdp_model->forward(x) : model->forward(x), y);
    if (scaler) scaler->scale(loss).backward(); else loss.backward();
    if (scaler) scaler->unscale_(optim);
    if (c.clip > 0) {
      if (fsdp_model) fsdp_model->clip_grad_norm_(c.clip);
      else torch::nn::utils::clip_grad_norm_(unique_params, c.clip);
    }
    if (scaler) {
      if (!scaler->step(optim) && rank == 0) std::cout << "step " << step << ": gradients overflowed, step skipped" << std::endl;
      scaler->update();
    } else {
      optim.step();
    }
    // The global batch's mean loss: the mean of the ranks' means (equal slices).
    std::vector<at::Tensor> l{loss.detach().reshape({1}).to(torch::kCPU, torch::kFloat).clone()};
    mesh->world()->allreduce(l)->wait();
    const double global_loss = l[0].item<double>() / W;
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    fsdp::Metrics m;
    if (fsdp_model) {
      m = fsdp_model->metrics();
    } else {
      for (const auto& p : unique_params) m.memory.sharded_params += p.numel() * p.element_size();
      m.memory.sharded_grads = m.memory.sharded_params;
    }
    if (fsdp_model && !c.trace_dir.empty() && step == c.trace_step) {
      const std::string path = c.trace_dir + "/trace-rank" + std::to_string(rank) + ".json";
      fsdp_model->write_trace(path);
      if (rank == 0) std::cout << "fsdp-train: wrote the Chrome trace of step " << step << " to " << c.trace_dir
                                << "/trace-rank*.json (open in https://ui.perfetto.dev or chrome://tracing)" << std::endl;
    }
    const double tps = tokens_per_step / (ms / 1000.0);
    auto ms_of = [](int64_t ns) { return static_cast<double>(ns) / 1e6; };
    metrics_out.write({{"rank", rank}, {"step", step}, {"loss", global_loss}, {"step_ms", ms}, {"tokens_per_s", tps},
                       {"param_bytes_resident", m.memory.sharded_params},
                       {"grad_bytes_resident", m.memory.sharded_grads},
                       {"peak_unsharded_bytes", m.memory.unsharded_peak},
                       {"comm_bytes", {{"all_gather", m.comm.all_gather}, {"reduce_scatter", m.comm.reduce_scatter},
                                       {"all_reduce", m.comm.all_reduce}}},
                       {"comm_calls", {{"all_gather", m.comm.all_gather_calls}, {"reduce_scatter", m.comm.reduce_scatter_calls},
                                       {"all_reduce", m.comm.all_reduce_calls}}},
                       {"exposed_comm_ms", ms_of(m.overlap.exposed_ns())},
                       {"exposed_all_gather_ms", ms_of(m.overlap.exposed_all_gather_ns)},
                       {"exposed_reduce_ms", ms_of(m.overlap.exposed_reduce_ns)},
                       {"rate_limiter_wait_ms", ms_of(m.overlap.rate_limiter_wait_ns)},
                       {"max_all_gathers_in_flight", m.overlap.max_all_gathers_in_flight},
                       {"device_memory", {{"allocated_peak", m.device.allocated_peak}, {"active_peak", m.device.active_peak},
                                          {"reserved_peak", m.device.reserved_peak},
                                          {"num_alloc_retries", m.device.num_alloc_retries}}}});
    if (rank == 0 && (step % c.log_every == 0 || step == c.steps - 1)) {
      char line[256];
      std::snprintf(line, sizeof(line), "step %4d | loss %.4f | %8.0f tok/s | %7.1f ms", step, global_loss, tps, ms);
      std::cout << line << " | params " << mb(m.memory.sharded_params) << " resident, peak unsharded "
                << mb(m.memory.unsharded_peak) << " | comm AG " << mb(m.comm.all_gather) << " RS "
                << mb(m.comm.reduce_scatter) << " AR " << mb(m.comm.all_reduce);
      if (fsdp_model) std::cout << " | exposed comm " << ms_of(m.overlap.exposed_ns()) << " ms";
      if (device.is_cuda()) std::cout << " | peak allocated " << mb(m.device.allocated_peak) << ", alloc retries " << m.device.num_alloc_retries;
      std::cout << std::endl;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"fsdp-train: train a GPT with Fully Sharded Data Parallel on libtorch"};
  int nproc = 0;
  app.add_option("--nproc-per-node", nproc, "spawn this many local ranks (otherwise use the torchrun environment)");
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
  try {
    if (!c.export_init.empty()) return export_init(c);
    if (c.plan) {
      Config p = c;
      if (p.plan_world <= 0) p.plan_world = std::max(1, nproc);
      return plan(p);
    }
    if (auto code = fsdp::maybe_launch_local(argc, argv)) return *code;
    if (std::getenv("RANK") == nullptr && std::getenv("WORLD_SIZE") == nullptr) {
      // Neither launched nor asked to launch: one local rank.
      return fsdp::launch_local(1, [&] {
        std::vector<std::string> a{"/proc/self/exe"};
        for (int i = 1; i < argc; ++i) a.emplace_back(argv[i]);
        return a;
      }());
    }
    return train(c);
  } catch (const std::exception& e) {
    std::cerr << "fsdp-train: error: " << e.what() << std::endl;
    return 1;
  }
}
