// Deferred initialization and tensor parallelism at their edges (PyTorch FSDP1's test_fsdp_meta,
// test_fsdp_tp_integration, test_fsdp_sharded_grad_scaler and FSDP2's test_fully_shard_init,
// test_fully_shard_state_dict): a deferred model under mixed precision, with parameters of even,
// uneven and smaller-than-W sizes; deferred initialization with TP; rank 0 holding the only copy of
// the weights; TP with sync_module_states; collective counts under TP; a hybrid TP checkpoint
// round trip; the sharded gradient scaler on a 2-D mesh.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

#include "conformance.h"
#include "fsdp/deferred_init.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/tensor_parallel.h"

namespace conformance {
namespace deferred_init_and_tensor_parallel {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {


// Folders by POSIX calls: std::filesystem here resolves to libtorch's own copy, built for another
// library ABI (a crash in remove_all).
std::vector<std::string> entries_of(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(n);
    }
    ::closedir(d);
  }
  return out;
}

void remove_tree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    for (const auto& n : entries_of(path)) remove_tree(path + "/" + n);
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

std::string file_name(const std::string& path) { return path.substr(path.rfind('/') + 1); }

void barrier(const Ctx& c) {
  std::vector<at::Tensor> flag{torch::zeros({1})};
  c.mesh->world()->allreduce(flag)->wait();
}

struct ScenarioDir {
  ScenarioDir(const Ctx& c, const std::string& name)
      : ctx(c), path("/tmp/c4-" + name + "-" + std::to_string(c.mesh->env().master_port)) {
    if (c.rank == 0) {
      remove_tree(path);
      ::mkdir(path.c_str(), 0755);
    }
    barrier(c);
  }
  ~ScenarioDir() {
    barrier(ctx);
    if (ctx.rank == 0) {
      remove_tree(path);
    }
  }
  std::string sub(const std::string& name) const { return path + "/" + name; }
  const Ctx& ctx;
  std::string path;
};

// --- a deferred model: 1, 9 (uneven), 32 and 72 (even) element units, and a buffer ---------------

struct ScaleImpl : torch::nn::Module {
  // Initialized in place (uniform_, normal_): what deferred_init records.
  ScaleImpl() { w = register_parameter("w", torch::empty({1}).uniform_(0.9, 1.1)); }
  torch::Tensor w;
};
TORCH_MODULE(Scale);

struct ShiftBlockImpl : torch::nn::Module {
  ShiftBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(8, 8));
    shift = register_buffer("shift", torch::empty({8}).normal_(0.0, 0.1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(fc(x) + shift) + x; }
  torch::nn::Linear fc{nullptr};
  torch::Tensor shift;
};
TORCH_MODULE(ShiftBlock);

struct DeferredNetImpl : torch::nn::Module {
  DeferredNetImpl() {
    scale = register_module("scale", Scale());
    fc1 = register_module("fc1", torch::nn::Linear(2, 3));
    fc2 = register_module("fc2", torch::nn::Linear(3, 8));
    block = register_module("block", ShiftBlock());
    head = register_module("head", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(block(fc2(torch::tanh(fc1(x))))) * scale->w;
  }
  Scale scale{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
  ShiftBlock block{nullptr};
};
TORCH_MODULE(DeferredNet);

fsdp::Options deferred_units(const Variant& v, DeferredNet& m) {
  fsdp::fully_shard(*m->scale);
  fsdp::fully_shard(*m->fc1);
  fsdp::fully_shard(*m->fc2);
  fsdp::Options o = v.options;
  o.auto_wrap_policy = fsdp::module_type_policy<ShiftBlockImpl>();
  return o;
}

template <typename W>
double deferred_step(const Ctx& c, W& model, torch::optim::Optimizer& optim, int step) {
  const auto x = randn(100 + step, {8, 2}), y = randn(200 + step, {8, 2});
  optim.zero_grad();
  auto loss = torch::mse_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
  loss.backward();
  optim.step();
  return global_mean(c, loss.item().toDouble());
}

}  // namespace

CONFORMANCE_CASE(DeferredInitAndTensorParallel, DeferredModelWithTinyParametersAndMixedPrecisionEqualsNormalConstruction, 4,
                 "#168, #275: FSDP1 test_fsdp_meta test_meta_device_with_mixed_precision; FSDP2 test_fully_shard_init "
                 "test_meta_device_1d_init (even, uneven and empty-local dims, with and without bf16 mixed precision)") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(0);
    DeferredNet normal;
    torch::manual_seed(0);
    DeferredNet deferred = fsdp::deferred_init([] { return DeferredNet(); });
    c.expect(fsdp::is_deferred(deferred->fc1->weight), "deferred_init made the parameters deferred");
    torch::manual_seed(0);
    DeferredNet local;
    fsdp::FullyShardedDataParallel normal_model(normal, c.mesh, deferred_units(v, normal));
    fsdp::FullyShardedDataParallel deferred_model(deferred, c.mesh, deferred_units(v, deferred));
    // Shard for shard the same bits, an empty one included (the scale's on ranks 1 to 3 at F = 4).
    const auto a = normal_model.named_parameters(), b = deferred_model.named_parameters();
    c.expect(a.size() == b.size(), "both wrapped models list the same parameters");
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      c.expect(a[i].first == b[i].first, "parameter " + std::to_string(i) + " has the same name");
      expect_same_tensor(c, "this rank's shard of " + a[i].first, b[i].second, a[i].second, 0.0);
    }
    // The buffer, materialized whole and cast once to buffer_dtype under mixed precision.
    const auto want_dtype = v.mixed_precision() ? v.options.mixed_precision->buffer_dtype : torch::kFloat;
    c.expect(deferred->block->shift.scalar_type() == want_dtype, "the buffer is in the buffer dtype");
    expect_same_tensor(c, "the buffer", deferred->block->shift, normal->block->shift, 0.0);
    expect_same_tensor(c, "the buffer against the local model's", deferred->block->shift.to(torch::kFloat),
                       local->block->shift, v.mixed_precision() ? 4e-3 : 0.0);

    torch::optim::SGD normal_optim(normal_model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD deferred_optim(deferred_model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    // bf16 compute (8 bits of mantissa) against fp32 local training: 3e-2 over two steps.
    const double tol = v.mixed_precision() ? 3e-2 : 1e-5;
    for (int step = 0; step < 2; ++step) {
      const double l = deferred_step(c, deferred_model, deferred_optim, step);
      c.expect_near("loss at step " + std::to_string(step) + " against the normally built model",
                    l, deferred_step(c, normal_model, normal_optim, step), 0.0);
      const auto x = randn(100 + step, {8, 2}), y = randn(200 + step, {8, 2});
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step) + " against local training", l, local_loss.item().toDouble(), tol);
    }
    const auto wa = whole_state(normal_model, *normal), wb = whole_state(deferred_model, *deferred);
    for (const auto& [name, t] : wa) expect_same_tensor(c, "after two steps, " + name, wb.at(name), t, 0.0);
    expect_same_model(c, deferred_model, *deferred, *local, tol, /*buffers=*/!v.mixed_precision());
  });
}

CONFORMANCE_CASE(DeferredInitAndTensorParallel, RankZeroHoldsTheOnlyWeightsOfADeferredModel, 4,
                 "#278, #51: FSDP2 test_fully_shard_init test_rank0_broadcast_meta_device_init (rank 0 alone holds "
                 "the full state dict; the meta-initialized sharded model is filled from it)") {
  ScenarioDir dir(c, "rank0-weights");
  int run = 0;
  for_each(c, every_strategy(c), [&](const Variant& v) {
    // The weights: a trained model, exported whole by rank 0 into one file.
    torch::manual_seed(0);
    DeferredNet trained;
    torch::manual_seed(0);
    DeferredNet local;
    fsdp::FullyShardedDataParallel trained_model(trained, c.mesh, deferred_units(v, trained));
    torch::optim::SGD optim(trained_model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 2; ++step) {
      const double l = deferred_step(c, trained_model, optim, step);
      const auto x = randn(100 + step, {8, 2}), y = randn(200 + step, {8, 2});
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), l, local_loss.item().toDouble(), 1e-5);
    }
    const std::string file = dir.sub(std::to_string(run++) + ".safetensors");
    fsdp::export_full(file, trained_model);

    // Every rank builds the model deferred from another seed. sync_module_states has nothing to
    // broadcast yet: refused, saying how to start from the file instead.
    torch::manual_seed(5);
    DeferredNet again = fsdp::deferred_init([] { return DeferredNet(); });
    fsdp::Options o = deferred_units(v, again);
    o.sync_module_states = true;
    c.expect_refused("sync_module_states with a deferred_init model",
                     [&] { fsdp::FullyShardedDataParallel m(again, c.mesh, o); },
                     {"sync_module_states", "deferred_init", "load_model_file"});
    // The way: wrap (each rank materializes only its shards), then load the file, each rank
    // reading only the elements it holds.
    fsdp::FullyShardedDataParallel model(again, c.mesh, deferred_units(v, again));
    fsdp::load_model_file(file, model);
    const auto want = whole_state(trained_model, *trained), got = whole_state(model, *again);
    for (const auto& [name, t] : want) expect_same_tensor(c, "loaded " + name, got.at(name), t, 0.0);
    // And it trains on like local training (a fresh optimizer on both sides).
    torch::optim::SGD optim2(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim2(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 2; step < 4; ++step) {
      const double l = deferred_step(c, model, optim2, step);
      const auto x = randn(100 + step, {8, 2}), y = randn(200 + step, {8, 2});
      local_optim2.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), y);
      local_loss.backward();
      local_optim2.step();
      c.expect_near("loss at step " + std::to_string(step) + " after the load", l, local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *again, *local, 1e-5);
  });
}

namespace {

// --- a model of the user's own, split for TP: two residual MLP blocks (up column-parallel, down
// row-parallel), a replicated buffer, replicated input and head layers ------------------------------

struct TpBlockImpl : torch::nn::Module {
  TpBlockImpl() {
    up = register_module("up", torch::nn::Linear(8, 16));
    down = register_module("down", torch::nn::Linear(16, 8));
    shift = register_buffer("shift", torch::empty({8}).normal_(0.0, 0.1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x + fsdp::row_parallel(down, torch::relu(fsdp::column_parallel(up, x))) + shift;
  }
  torch::nn::Linear up{nullptr}, down{nullptr};
  torch::Tensor shift;
};
TORCH_MODULE(TpBlock);

struct TpNetImpl : torch::nn::Module {
  TpNetImpl() {
    inp = register_module("inp", torch::nn::Linear(6, 8));
    b0 = register_module("b0", TpBlock());
    b1 = register_module("b1", TpBlock());
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(b1(b0(inp(x)))); }
  torch::nn::Linear inp{nullptr}, head{nullptr};
  TpBlock b0{nullptr}, b1{nullptr};
};
TORCH_MODULE(TpNet);

const std::vector<fsdp::TensorParallelRule>& tp_plan() {
  static const std::vector<fsdp::TensorParallelRule> plan{
      {"b*.up.weight", {0, 1}}, {"b*.up.bias", {0, 1}}, {"b*.down.weight", {1, 1}}};
  return plan;
}

// The variants of a 2-D mesh of TP 2 x DP 2: the strategies the DP pair can run.
std::vector<Variant> dp_pair_strategies(const Ctx& c, bool hybrid) {
  std::vector<Variant> out;
  for (const char* s : {"full_shard", "shard_grad_op", "no_shard"}) {
    Variant v = strategy(c, s);
    v.name = std::string(s) + (std::string(s) == "no_shard" ? " F=1" : " F=2") + ", TP 2 x DP 2";
    out.push_back(v);
  }
  if (hybrid) {
    for (const char* s : {"hybrid_shard", "hybrid_shard_zero2"}) {
      Variant v = strategy(c, s);
      v.options.shard_size = 1;
      v.name = std::string(s) + " F=1, TP 2 x DP 2";
      out.push_back(v);
    }
  }
  return out;
}

// This DP rank's rows of a global batch (both ranks of a TP group take the same rows).
torch::Tensor dp_rows(const fsdp::TensorParallel& tp, const torch::Tensor& global) {
  const auto& dp = tp.data_parallel();
  const int64_t per = global.size(0) / dp->world_size();
  return global.narrow(0, dp->rank() * per, per);
}

template <typename W>
double tp_step(const Ctx& c, const fsdp::TensorParallel& tp, W& model, torch::optim::Optimizer& optim, int step) {
  const auto x = randn(100 + step, {8, 6}), y = randn(200 + step, {8, 3});
  optim.zero_grad();
  auto loss = torch::mse_loss(model(dp_rows(tp, x)), dp_rows(tp, y));
  loss.backward();
  optim.step();
  return global_mean(c, loss.item().toDouble());  // the TP ranks of a DP rank hold the same loss
}

double tp_local_step(TpNet& local, torch::optim::Optimizer& optim, int step) {
  const auto x = randn(100 + step, {8, 6}), y = randn(200 + step, {8, 3});
  optim.zero_grad();
  auto loss = torch::mse_loss(local->forward(x), y);
  loss.backward();
  optim.step();
  return loss.item().toDouble();
}

// Whole parameters and buffers of a TP-split wrapped model, by name (collective over the job).
std::map<std::string, torch::Tensor> tp_whole(fsdp::FullyShardedDataParallelBase& model) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : fsdp::full_state_dict(model, /*rank0_only=*/false)) out[name] = t;
  return out;
}

void expect_like_local(Ctx& c, const std::string& what, const std::map<std::string, torch::Tensor>& got,
                       torch::nn::Module& local, double tol) {
  for (const auto& [name, t] : state_of(local)) {
    auto it = got.find(name);
    if (it == got.end()) {
      c.fail(what + ": no " + name);
      continue;
    }
    // Buffers under mixed precision are kept in the low dtype: compared in local training's.
    expect_same_tensor(c, what + ": " + name, it->second.to(t.scalar_type()), t, tol);
  }
}

}  // namespace

CONFORMANCE_CASE(DeferredInitAndTensorParallel, DeferredInitWithTensorParallelIsRefused, 4,
                 "#276: FSDP2 test_fully_shard_init test_meta_device_2d_init (meta-device init with TP + FSDP, even "
                 "and uneven dims)") {
  auto tp = fsdp::TensorParallel::create(c.mesh, 2);
  for_each(c, dp_pair_strategies(c, false), [&](const Variant& v) {
    torch::manual_seed(0);
    TpNet deferred = fsdp::deferred_init([] { return TpNet(); });
    // tensor_parallel.h: a TP model is built whole, every TP rank from the same seed, then split.
    // Split while deferred, its parts keep no record to make their values from: the wrapper
    // refuses it by name (parallelize itself takes meta models, which fsdp-train plans with).
    c.expect_refused("fsdp::parallelize of a deferred_init model, then wrapping it",
                     [&] {
                       fsdp::parallelize(*deferred, tp, tp_plan());
                       fsdp::Options o = v.options;
                       o.auto_wrap_policy = fsdp::module_type_policy<TpBlockImpl>();
                       o.tensor_parallel = tp;
                       fsdp::FullyShardedDataParallel model(deferred, tp->data_parallel(), o);
                     },
                     {"b0.up.weight", "fsdp::parallelize", "build it normally"});
    // Built whole, split, wrapped: like local training.
    torch::manual_seed(0);
    TpNet mine;
    torch::manual_seed(0);
    TpNet local;
    fsdp::parallelize(*mine, tp, tp_plan());
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<TpBlockImpl>();
    o.tensor_parallel = tp;
    fsdp::FullyShardedDataParallel model(mine, tp->data_parallel(), o);
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 2; ++step) {
      c.expect_near("loss at step " + std::to_string(step), tp_step(c, *tp, model, optim, step),
                    tp_local_step(local, local_optim, step), 1e-5);
    }
    expect_like_local(c, "after two steps", tp_whole(model), *local, 1e-5);
  });
}

CONFORMANCE_CASE(DeferredInitAndTensorParallel, TensorParallelWithSyncModuleStates, 4,
                 "#144: FSDP1 test_fsdp_tp_integration test_fsdp_tp_sync_module_state (rank-seeded TP model, "
                 "sync_module_states)") {
  auto tp = fsdp::TensorParallel::create(c.mesh, 2);
  for_each(c, dp_pair_strategies(c, true), [&](const Variant& v) {
    // Every rank builds the model from its own seed, then splits it. PyTorch's test accepts this
    // (the replicated parameters become rank 0's, each TP rank's parts its first DP rank's): a model
    // no rank built, and with the usual "rank 0 loaded the weights, sync_module_states spreads
    // them", TP rank 1's parts would silently be another rank's random ones. Refused on every rank,
    // naming the fix (issue 36).
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<TpBlockImpl>();
    o.tensor_parallel = tp;
    o.sync_module_states = true;
    torch::manual_seed(100 + c.rank);
    TpNet ragged;
    fsdp::parallelize(*ragged, tp, tp_plan());
    c.expect_refused("a rank-seeded TP model under sync_module_states",
                     [&] { fsdp::FullyShardedDataParallel m(ragged, tp->data_parallel(), o); },
                     {"built different models", "same seed", "sync_module_states"});
    // The way: every rank builds the model from one seed; sync_module_states then changes nothing
    // and training is local training's.
    torch::manual_seed(100);
    TpNet mine;
    fsdp::parallelize(*mine, tp, tp_plan());
    fsdp::FullyShardedDataParallel model(mine, tp->data_parallel(), o);
    torch::manual_seed(100);
    TpNet local;
    expect_like_local(c, "after sync_module_states", tp_whole(model), *local, 0.0);
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 2; ++step) {
      c.expect_near("loss at step " + std::to_string(step), tp_step(c, *tp, model, optim, step),
                    tp_local_step(local, local_optim, step), 1e-5);
    }
    expect_like_local(c, "after two steps", tp_whole(model), *local, 1e-5);
  });
}

CONFORMANCE_CASE(DeferredInitAndTensorParallel, CollectiveCallsUnderTensorParallel, 4,
                 "#143: FSDP1 test_fsdp_tp_integration test_fsdp_tp_extension_grad (exact comm counts on a 2-D mesh, "
                 "no NaN gradients)") {
  auto tp = fsdp::TensorParallel::create(c.mesh, 2);
  for_each(c, dp_pair_strategies(c, true), [&](const Variant& v) {
    torch::manual_seed(0);
    TpNet mine;
    torch::manual_seed(0);
    TpNet local;
    fsdp::parallelize(*mine, tp, tp_plan());
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<TpBlockImpl>();
    o.tensor_parallel = tp;
    fsdp::FullyShardedDataParallel model(mine, tp->data_parallel(), o);
    const int64_t N = static_cast<int64_t>(model.units().size());
    const int F = model.shard_size(), R = tp->data_parallel()->world_size() / F;
    const bool raf = v.options.strategy == fsdp::ShardingStrategy::FULL_SHARD ||
                     v.options.strategy == fsdp::ShardingStrategy::HYBRID_SHARD;
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      model.reset_step();
      const std::string at = "step " + std::to_string(step);
      const auto x = randn(100 + step, {8, 6}), y = randn(200 + step, {8, 3});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(dp_rows(*tp, x)), dp_rows(*tp, y));
      loss.backward();
      // fsdp's own collectives run over the DP pair only, by the schedule of one dimension
      // (the TP all-reduces of the layers are the TP group's, not in fsdp's metrics).
      const auto m = model.metrics();
      const int64_t ag = F > 1 ? N + (raf ? N - 1 : 0) : 0;
      c.expect(m.comm.all_gather_calls == ag && m.comm.reduce_scatter_calls == (F > 1 ? N : 0) &&
                   m.comm.all_reduce_calls == (R > 1 ? N : 0),
               at + ": " + std::to_string(m.comm.all_gather_calls) + " all-gathers, " +
                   std::to_string(m.comm.reduce_scatter_calls) + " reduce-scatters, " +
                   std::to_string(m.comm.all_reduce_calls) + " all-reduces, expected " + std::to_string(ag) + ", " +
                   std::to_string(F > 1 ? N : 0) + ", " + std::to_string(R > 1 ? N : 0));
      for (const auto& [name, p] : model.named_parameters()) {
        c.expect(p.grad().defined() && torch::isfinite(p.grad()).all().item<bool>(), at + ": " + name + "'s gradient is finite");
      }
      optim.step();
      c.expect_near(at + " loss", global_mean(c, loss.item().toDouble()), tp_local_step(local, local_optim, step), 1e-5);
    }
    expect_like_local(c, "after three steps", tp_whole(model), *local, 1e-5);
  });
}

CONFORMANCE_CASE(DeferredInitAndTensorParallel, HybridShardingWithTensorParallelCheckpointRoundTrip, 4,
                 "#246: FSDP2 test_fully_shard_state_dict test_hsdp_tp_state_dict_save_load") {
  ScenarioDir dir(c, "hsdp-tp");
  auto tp = fsdp::TensorParallel::create(c.mesh, 2);
  int run = 0;
  for_each(c, dp_pair_strategies(c, true), [&](const Variant& v) {
    auto wrap = [&](TpNet& m, bool split, const fsdp::Options& base) {
      fsdp::Options o = base;
      o.auto_wrap_policy = fsdp::module_type_policy<TpBlockImpl>();
      if (split) {
        fsdp::parallelize(*m, tp, tp_plan());
        o.tensor_parallel = tp;
      }
      return std::make_unique<fsdp::FullyShardedDataParallel<TpNetImpl>>(m, split ? tp->data_parallel() : c.mesh, o);
    };
    torch::manual_seed(0);
    TpNet mine;
    torch::manual_seed(0);
    TpNet local;
    auto model = wrap(mine, true, v.options);
    torch::optim::AdamW optim(model->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW local_optim(local->parameters(), torch::optim::AdamWOptions(1e-2));
    std::vector<double> losses;
    for (int step = 0; step < 2; ++step) {
      losses.push_back(tp_step(c, *tp, *model, optim, step));
      c.expect_near("loss at step " + std::to_string(step), losses.back(), tp_local_step(local, local_optim, step), 1e-5);
    }
    std::string path;
    {
      fsdp::Checkpointer ckpt(tp->world(), dir.sub(std::to_string(run++)), {fsdp::StateDictKind::FULL});
      path = ckpt.save(*model, &optim, {2});
    }
    for (int step = 2; step < 4; ++step) {
      losses.push_back(tp_step(c, *tp, *model, optim, step));
      c.expect_near("loss at step " + std::to_string(step), losses.back(), tp_local_step(local, local_optim, step), 1e-5);
    }
    const auto straight = tp_whole(*model);
    expect_like_local(c, "after four steps", straight, *local, 1e-5);

    // Resumed at the same layout: the same bits. At TP 1 over all four ranks (full_shard): the
    // same run within rounding.
    for (const bool split : {true, false}) {
      const std::string what = split ? "resumed at the same layout" : "resumed at TP 1, full_shard over 4 ranks";
      torch::manual_seed(7);
      TpNet again;
      auto resumed = wrap(again, split, split ? v.options : strategy(c, "full_shard").options);
      torch::optim::AdamW resumed_optim(resumed->parameters(), torch::optim::AdamWOptions(1e-2));
      fsdp::load_checkpoint(path, *resumed, &resumed_optim);
      for (int step = 2; step < 4; ++step) {
        const double l = split ? tp_step(c, *tp, *resumed, resumed_optim, step) : [&] {
          const auto x = randn(100 + step, {8, 6}), y = randn(200 + step, {8, 3});
          resumed_optim.zero_grad();
          auto loss = torch::mse_loss((*resumed)(my_rows(c, x)), my_rows(c, y));
          loss.backward();
          resumed_optim.step();
          return global_mean(c, loss.item().toDouble());
        }();
        c.expect_near(what + ", loss at step " + std::to_string(step), l, losses[step], split ? 0.0 : 1e-5);
      }
      const auto got = tp_whole(*resumed);
      for (const auto& [name, t] : straight) expect_same_tensor(c, what + ": " + name, got.at(name), t, split ? 0.0 : 1e-5);
    }
  });
}

CONFORMANCE_CASE(DeferredInitAndTensorParallel, ShardedGradScalerOnATwoDimensionalMesh, 4,
                 "#252: FSDP1 test_fsdp_sharded_grad_scaler test_gradient_scaler [2-D: TP + FSDP] (an inf on one TP "
                 "rank skips every rank's step)") {
  auto tp = fsdp::TensorParallel::create(c.mesh, 2);
  std::vector<Variant> variants = dp_pair_strategies(c, true);
  for (auto& v : variants) {
    v.options.mixed_precision = fsdp::MixedPrecision{torch::kHalf, torch::kHalf, torch::kHalf, false};
    v.name += " fp16";
  }
  for_each(c, variants, [&](const Variant& v) {
    torch::manual_seed(0);
    TpNet mine;
    torch::manual_seed(0);
    TpNet local;
    fsdp::parallelize(*mine, tp, tp_plan());
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<TpBlockImpl>();
    o.tensor_parallel = tp;
    fsdp::FullyShardedDataParallel model(mine, tp->data_parallel(), o);
    fsdp::ShardedGradScaler scaler(tp->world(), fsdp::GradScalerOptions{1024.0, 2.0, 0.5, 2000});
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    const auto before = tp_whole(model);
    for (int step = 0; step < 3; ++step) {
      const std::string at = "step " + std::to_string(step);
      const auto x = randn(100 + step, {8, 6}), y = randn(200 + step, {8, 3});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(dp_rows(*tp, x)).to(torch::kFloat), dp_rows(*tp, y));
      scaler.scale(loss).backward();
      if (step == 0 && c.rank == 1) {
        // World rank 1 is TP rank 1 of the first DP rank: an overflow in one of its split parts.
        const torch::Tensor g = mine->b0->up->weight.grad();
        if (g.numel() > 0) g.view({-1})[0] = std::numeric_limits<float>::infinity();
        else c.fail("rank 1 holds no element of b0.up.weight to overflow");
      }
      const double scale_before = scaler.get_scale();
      const bool stepped = scaler.step(optim);
      scaler.update();
      c.expect(stepped == (step != 0), at + (step == 0 ? ": the step was taken" : ": the step was skipped"));
      if (step == 0) {
        c.expect(scaler.get_scale() == scale_before * 0.5, at + ": the scale backed off on every rank");
        const auto after = tp_whole(model);
        for (const auto& [name, t] : before) expect_same_tensor(c, at + " skipped: " + name, after.at(name), t, 0.0);
        continue;
      }
      // Local training skips the same first step.
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), y);
      local_loss.backward();
      local_optim.step();
      // fp16 compute (10 bits of mantissa) against fp32 local training.
      c.expect_near(at + " loss", global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-2);
    }
    expect_like_local(c, "after the skipped and two taken steps", tp_whole(model), *local, 1e-2);
  });
}

}  // namespace deferred_init_and_tensor_parallel
}  // namespace conformance
