// Checkpoints and optimizer state at their edges (PyTorch FSDP1's test_fsdp_state_dict,
// test_fsdp_optim_state, test_fsdp_checkpoint and FSDP2's test_fully_shard_state_dict): a save
// before the first step, between backward and step, with activation checkpointing on one side
// only, of a bf16 model, of parameters too small for every rank to hold a piece; optimizers built
// in another order on each rank, one that lacks a parameter, one without state; a load into
// another unit layout, a file that lacks a parameter, a model wrapped twice. Every resumed run is
// compared with the run that was never interrupted (bit for bit where the layout is the same) and
// with plain libtorch on the whole batch.
#include <algorithm>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>

#include "conformance.h"
#include "fsdp/activation_checkpoint.h"

namespace conformance {
namespace checkpoint_edge_cases {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

using fsdp::StateDictKind;

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

// A folder under /tmp made fresh for a scenario, the same path on every rank (from the launcher's
// port), removed at its end.
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

std::string kind_name(StateDictKind k) { return fsdp::to_string(k); }

// Some strategies by name: for peer tests that run one strategy (full sharding), the placements
// that differ for a checkpoint (sharded, replicated, sharded and replicated, kept after forward).
std::vector<Variant> strategies(const Ctx& c, const std::vector<std::string>& names) {
  std::vector<Variant> out;
  for (const auto& n : names) out.push_back(strategy(c, n));
  return out;
}

// A residual block with a buffer (a fixed shift, drawn at construction: sync_module_states and
// checkpoints must carry it).
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc = register_module("fc", torch::nn::Linear(8, 8));
    shift = register_buffer("shift", torch::randn({8}) * 0.1);
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(fc(x) + shift) + x; }
  torch::nn::Linear fc{nullptr};
  torch::Tensor shift;
};
TORCH_MODULE(Block);

// Input layer, two blocks (each checkpointed when marked), head. `head_bias` false: the same model
// without head.bias (a file of it lacks one parameter of the other).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool head_bias = true) {
    inp = register_module("inp", torch::nn::Linear(6, 8));
    b0 = register_module("b0", Block());
    b1 = register_module("b1", Block());
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(8, 3).bias(head_bias)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = inp(x);
    h = fsdp::checkpointable(*b0, [b = b0.ptr()](const torch::Tensor& t) { return b->forward(t); }, h);
    h = fsdp::checkpointable(*b1, [b = b1.ptr()](const torch::Tensor& t) { return b->forward(t); }, h);
    return head(h);
  }
  torch::nn::Linear inp{nullptr}, head{nullptr};
  Block b0{nullptr}, b1{nullptr};
};
TORCH_MODULE(Net);

using Wrapped = fsdp::FullyShardedDataParallel<NetImpl>;

fsdp::Options blocks_as_units(const Variant& v) {
  fsdp::Options o = v.options;
  o.auto_wrap_policy = fsdp::module_type_policy<BlockImpl>();
  return o;
}

// The global batch of step `step`, in the model's dtype.
std::pair<torch::Tensor, torch::Tensor> batch(int step, c10::ScalarType dtype = torch::kFloat) {
  return {randn(100 + step, {8, 6}).to(dtype), randn(200 + step, {8, 3})};
}

torch::Tensor loss_of(const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out.to(torch::kFloat), y); }

// One step of the loop under fsdp on this rank's rows; returns the global mean loss.
template <typename W>
double fsdp_step(const Ctx& c, W& model, torch::optim::Optimizer& optim, int step, c10::ScalarType dtype = torch::kFloat) {
  const auto [x, y] = batch(step, dtype);
  optim.zero_grad();
  auto loss = loss_of(model(my_rows(c, x)), my_rows(c, y));
  loss.backward();
  optim.step();
  return global_mean(c, loss.item().toDouble());
}

// The same step in plain libtorch on the whole batch.
template <typename M>
double local_step(M& model, torch::optim::Optimizer& optim, int step, c10::ScalarType dtype = torch::kFloat) {
  const auto [x, y] = batch(step, dtype);
  optim.zero_grad();
  auto loss = loss_of(model->forward(x), y);
  loss.backward();
  optim.step();
  return loss.item().toDouble();
}

// Every parameter and buffer of two wrapped models, whole, compared by name.
void expect_same_wrapped(Ctx& c, const std::string& what, fsdp::FullyShardedDataParallelBase& got, torch::nn::Module& got_m,
                         fsdp::FullyShardedDataParallelBase& want, torch::nn::Module& want_m, double tol) {
  const auto g = whole_state(got, got_m);
  const auto w = whole_state(want, want_m);
  c.expect(g.size() == w.size(), what + ": the two models have different numbers of tensors");
  for (const auto& [name, t] : w) {
    auto it = g.find(name);
    if (it == g.end()) {
      c.fail(what + ": no " + name);
      continue;
    }
    expect_same_tensor(c, what + ": " + name, it->second, t, tol);
  }
}

void expect_same_losses(Ctx& c, const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                        double tol) {
  c.expect(got.size() == want.size(), what + ": a different number of steps");
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    c.expect_near(what + ", loss at step " + std::to_string(i), got[i], want[i], tol);
  }
}

std::set<std::string> names_of(const std::vector<std::pair<std::string, torch::Tensor>>& sd) {
  std::set<std::string> out;
  for (const auto& [n, t] : sd) out.insert(n);
  return out;
}

std::string joined(const std::set<std::string>& s) {
  std::string out;
  for (const auto& n : s) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

// --- activation checkpointing on one side of a checkpoint only -------------------------------

CONFORMANCE_CASE(CheckpointEdgeCases, ActivationCheckpointingOnOneSideOfASaveChangesNothing, 4,
                 "#48, #49, #197: FSDP1 test_fsdp_state_dict test_fsdp_state_dict_with_activation_checkpoint, "
                 "test_state_dict_with_manual_ac_wrapper; FSDP1 test_fsdp_checkpoint test_load_activation_checkpointed_module, "
                 "test_fqn") {
  ScenarioDir dir(c, "ac-state");
  int run = 0;
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    Net local;
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<double> local_losses;
    for (int s = 0; s < 4; ++s) local_losses.push_back(local_step(local, local_optim, s));
    const auto local_names = state_of(*local);

    for (const bool ac_saved : {true, false}) {
      const std::string side = ac_saved ? "saved with activation checkpointing" : "saved without it";
      torch::manual_seed(0);
      Net mine;
      if (ac_saved) c.expect(fsdp::apply_activation_checkpointing(*mine, fsdp::checkpoint_modules_of_type<BlockImpl>()) == 2,
                             "both blocks are marked for activation checkpointing");
      Wrapped model(mine, c.mesh, blocks_as_units(v));
      torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      std::vector<double> losses;
      for (int s = 0; s < 2; ++s) losses.push_back(fsdp_step(c, model, optim, s));
      // The names a state dict holds do not depend on checkpointing (fsdp marks, never renames).
      std::set<std::string> want;
      for (const auto& [n, t] : local_names) want.insert(n);
      const auto got = names_of(fsdp::full_state_dict(model, /*rank0_only=*/false));
      c.expect(got == want, side + ": full_state_dict names {" + joined(got) + "}, the local model's {" + joined(want) + "}");
      // One kind each way: FULL from the checkpointed model, SHARDED from the plain one.
      std::map<StateDictKind, std::string> saved;
      for (const auto kind : {ac_saved ? StateDictKind::FULL : StateDictKind::SHARDED}) {
        fsdp::Checkpointer ckpt(c.mesh, dir.sub(std::to_string(run) + "-" + kind_name(kind)), {kind});
        saved[kind] = ckpt.save(model, &optim, {2});
      }
      ++run;
      for (int s = 2; s < 4; ++s) losses.push_back(fsdp_step(c, model, optim, s));
      expect_same_losses(c, side + ", against local training", losses, local_losses, 1e-5);
      expect_same_model(c, model, *mine, *local, 1e-5);

      // Resumed on the other side: a fresh model, built from another seed, with or without marks.
      for (const auto& [kind, path] : saved) {
        const std::string what = side + ", resumed from " + kind_name(kind) + (ac_saved ? " without" : " with") +
                                 " activation checkpointing";
        torch::manual_seed(7);
        Net again;
        if (!ac_saved) fsdp::apply_activation_checkpointing(*again, fsdp::checkpoint_modules_of_type<BlockImpl>());
        Wrapped resumed(again, c.mesh, blocks_as_units(v));
        torch::optim::SGD resumed_optim(resumed.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
        c.expect(fsdp::load_checkpoint(path, resumed, &resumed_optim).step == 2, what + ": the saved step is 2");
        std::vector<double> more;
        for (int s = 2; s < 4; ++s) more.push_back(fsdp_step(c, resumed, resumed_optim, s));
        // Recomputation is bitwise the forward it replays: the continuation is the same bits.
        expect_same_losses(c, what, more, {losses[2], losses[3]}, 0.0);
        expect_same_wrapped(c, what, resumed, *again, model, *mine, 0.0);
      }
    }
  });
}

// --- a FULL state dict on rank 0, into a plain model, then sync_module_states -------------------

CONFORMANCE_CASE(CheckpointEdgeCases, FullStateDictOnRankZeroIntoAPlainModelThenSyncModuleStates, 4,
                 "#51: FSDP1 test_fsdp_state_dict test_state_dict_rank0_offload_save_load_flow") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    Net mine;
    torch::manual_seed(0);
    Net local;
    Wrapped model(mine, c.mesh, blocks_as_units(v));
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int s = 0; s < 2; ++s) {
      c.expect_near("loss at step " + std::to_string(s), fsdp_step(c, model, optim, s), local_step(local, local_optim, s), 1e-5);
    }
    // Rank 0 alone holds the state dict; the other ranks get nothing.
    const auto sd = fsdp::full_state_dict(model, /*rank0_only=*/true);
    c.expect(c.rank == 0 ? !sd.empty() : sd.empty(), "full_state_dict(rank0_only) fills rank 0's list only");

    // A plain libtorch model, built from another seed on every rank (its buffers too); rank 0 loads
    // the state dict into it by name, as a user does.
    torch::manual_seed(100 + c.rank);
    Net plain;
    if (c.rank == 0) {
      torch::NoGradGuard no_grad;
      auto params = plain->named_parameters(true);
      auto buffers = plain->named_buffers(true);
      for (const auto& [name, t] : sd) {
        if (auto* p = params.find(name)) p->copy_(t);
        else if (auto* b = buffers.find(name)) b->copy_(t);
        else c.fail("the state dict holds " + name + ", which the plain model lacks");
      }
    }
    fsdp::Options o = blocks_as_units(v);
    o.sync_module_states = true;
    Wrapped synced(plain, c.mesh, o);
    // Every rank now holds rank 0's loaded values: the trained model's, parameters and buffers.
    expect_same_wrapped(c, "after sync_module_states", synced, *plain, model, *mine, 0.0);

    // Training on from there (a fresh optimizer on both sides) follows local training.
    torch::optim::SGD synced_optim(synced.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim2(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int s = 2; s < 4; ++s) {
      c.expect_near("loss at step " + std::to_string(s) + " after the sync", fsdp_step(c, synced, synced_optim, s),
                    local_step(local, local_optim2, s), 1e-5);
    }
    expect_same_model(c, synced, *plain, *local, 1e-5);
  });
}

// --- a save between backward and the optimizer step ---------------------------------------------

CONFORMANCE_CASE(CheckpointEdgeCases, SaveBetweenBackwardAndStepKeepsTheGradients, 4,
                 "#52: FSDP1 test_fsdp_state_dict test_basic_save_and_load_state_dict (saved after forward and "
                 "backward, gradients populated)") {
  ScenarioDir dir(c, "grads-state");
  int run = 0;
  for_each(c, strategies(c, {"full_shard", "shard_grad_op", "hybrid_shard"}), [&](const Variant& v) {
    torch::manual_seed(0);
    Net mine;
    torch::manual_seed(0);
    Net local;
    Wrapped model(mine, c.mesh, blocks_as_units(v));
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<double> losses, local_losses;
    for (int s = 0; s < 2; ++s) {
      losses.push_back(fsdp_step(c, model, optim, s));
      local_losses.push_back(local_step(local, local_optim, s));
    }
    // Step 2: forward, backward, then saves of every kind with the gradients on the parameters,
    // then the optimizer step, which must use those gradients untouched.
    const auto [x, y] = batch(2);
    optim.zero_grad();
    auto loss = loss_of(model(my_rows(c, x)), my_rows(c, y));
    loss.backward();
    std::map<StateDictKind, std::string> saved;
    for (const auto kind : {StateDictKind::FULL, StateDictKind::SHARDED, StateDictKind::LOCAL}) {
      fsdp::Checkpointer ckpt(c.mesh, dir.sub(std::to_string(run) + "-" + kind_name(kind)), {kind});
      saved[kind] = ckpt.save(model, &optim, {2});
    }
    ++run;
    optim.step();
    losses.push_back(global_mean(c, loss.item().toDouble()));
    local_losses.push_back(local_step(local, local_optim, 2));
    losses.push_back(fsdp_step(c, model, optim, 3));
    local_losses.push_back(local_step(local, local_optim, 3));
    expect_same_losses(c, "saved between backward and step, against local training", losses, local_losses, 1e-5);
    expect_same_model(c, model, *mine, *local, 1e-5);

    for (const auto& [kind, path] : saved) {
      const std::string what = "resumed from " + kind_name(kind);
      torch::manual_seed(7);
      Net again;
      Wrapped resumed(again, c.mesh, blocks_as_units(v));
      torch::optim::SGD resumed_optim(resumed.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      fsdp::load_checkpoint(path, resumed, &resumed_optim);
      // The saved state is the one before step 2's update: step 2 runs again from its batch.
      std::vector<double> more;
      for (int s = 2; s < 4; ++s) more.push_back(fsdp_step(c, resumed, resumed_optim, s));
      expect_same_losses(c, what, more, {losses[2], losses[3]}, 0.0);
      expect_same_wrapped(c, what, resumed, *again, model, *mine, 0.0);
    }
  });
}

// --- a model whose parameters are bf16 (no mixed precision) -----------------------------------

CONFORMANCE_CASE(CheckpointEdgeCases, ModelInBFloat16WithoutMixedPrecisionRoundTrips, 4,
                 "#52: FSDP1 test_fsdp_state_dict test_basic_save_and_load_state_dict (a model.half() model)") {
  ScenarioDir dir(c, "bf16-state");
  int run = 0;
  for_each(c, strategies(c, {"full_shard", "no_shard", "hybrid_shard"}), [&](const Variant& v) {
    torch::manual_seed(0);
    Net mine;
    mine->to(torch::kBFloat16);
    torch::manual_seed(0);
    Net local;
    local->to(torch::kBFloat16);
    Wrapped model(mine, c.mesh, blocks_as_units(v));
    for (const auto& u : model.units()) c.expect(u.element_size == 2, "unit '" + u.name + "' holds 2-byte elements");
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    std::vector<double> losses, local_losses;
    for (int s = 0; s < 2; ++s) {
      losses.push_back(fsdp_step(c, model, optim, s, torch::kBFloat16));
      local_losses.push_back(local_step(local, local_optim, s, torch::kBFloat16));
    }
    std::map<StateDictKind, std::string> saved;
    for (const auto kind : {StateDictKind::FULL, StateDictKind::SHARDED, StateDictKind::LOCAL}) {
      fsdp::Checkpointer ckpt(c.mesh, dir.sub(std::to_string(run) + "-" + kind_name(kind)), {kind});
      saved[kind] = ckpt.save(model, &optim, {2});
    }
    ++run;
    for (int s = 2; s < 4; ++s) {
      losses.push_back(fsdp_step(c, model, optim, s, torch::kBFloat16));
      local_losses.push_back(local_step(local, local_optim, s, torch::kBFloat16));
    }
    // bf16 keeps 8 bits of mantissa: the gradient fsdp averages over ranks in bf16 and the one
    // local training sums over the whole batch round differently (2^-9 relative each), and the
    // momentum carries it: 2e-2 over four steps of O(1) values, where fp32 gives 1e-7.
    expect_same_losses(c, "a bf16 model, against local training", losses, local_losses, 2e-2);
    expect_same_model(c, model, *mine, *local, 2e-2);

    for (const auto& [kind, path] : saved) {
      const std::string what = "resumed from " + kind_name(kind);
      torch::manual_seed(7);
      Net again;
      again->to(torch::kBFloat16);
      Wrapped resumed(again, c.mesh, blocks_as_units(v));
      torch::optim::SGD resumed_optim(resumed.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      fsdp::load_checkpoint(path, resumed, &resumed_optim);
      for (const auto& [name, t] : whole_state(resumed, *again)) {
        c.expect(t.scalar_type() == torch::kBFloat16, what + ": " + name + " is bf16 after the load");
      }
      std::vector<double> more;
      for (int s = 2; s < 4; ++s) more.push_back(fsdp_step(c, resumed, resumed_optim, s, torch::kBFloat16));
      expect_same_losses(c, what, more, {losses[2], losses[3]}, 0.0);
      expect_same_wrapped(c, what, resumed, *again, model, *mine, 0.0);
    }
  });
}

namespace {

// Parameters of 1, 6 + 3, 12 + 4 and 20 + 5 elements, each its own unit: at F = 4 the scale's
// unit leaves ranks 1 to 3 nothing and fc1's leaves rank 3 nothing (9 = 3 + 3 + 3 + 0).
struct ScaleImpl : torch::nn::Module {
  ScaleImpl() { w = register_parameter("w", torch::ones({1}) * 1.5); }
  torch::Tensor w;
};
TORCH_MODULE(Scale);

struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl() {
    scale = register_module("scale", Scale());
    fc1 = register_module("fc1", torch::nn::Linear(2, 3));
    fc2 = register_module("fc2", torch::nn::Linear(3, 4));
    fc3 = register_module("fc3", torch::nn::Linear(4, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::tanh(fc2(torch::tanh(fc1(x))))) * scale->w;
  }
  Scale scale{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(TinyNet);

fsdp::Options tiny_units(const Variant& v, TinyNet& m) {
  fsdp::fully_shard(*m->scale);
  fsdp::Options o = v.options;
  o.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
  return o;
}

template <typename W>
double tiny_step(const Ctx& c, W& model, torch::optim::Optimizer& optim, int step) {
  const auto x = randn(300 + step, {8, 2}), y = randn(400 + step, {8, 5});
  optim.zero_grad();
  auto loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, y));
  loss.backward();
  optim.step();
  return global_mean(c, loss.item().toDouble());
}

double tiny_local_step(TinyNet& model, torch::optim::Optimizer& optim, int step) {
  const auto x = randn(300 + step, {8, 2}), y = randn(400 + step, {8, 5});
  optim.zero_grad();
  auto loss = torch::mse_loss(model->forward(x), y);
  loss.backward();
  optim.step();
  return loss.item().toDouble();
}

// This rank's AdamW state by parameter name: step and moments (empty tensors for an empty shard).
struct AdamWEntry {
  int64_t step = 0;
  torch::Tensor exp_avg, exp_avg_sq;
};
std::map<std::string, AdamWEntry> adamw_state(fsdp::FullyShardedDataParallelBase& model, torch::optim::AdamW& optim) {
  std::map<std::string, AdamWEntry> out;
  for (const auto& [name, p] : model.named_parameters()) {
    auto it = optim.state().find(p.unsafeGetTensorImpl());
    if (it == optim.state().end()) continue;
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    out[name] = {st.step(), st.exp_avg().clone(), st.exp_avg_sq().clone()};
  }
  return out;
}

void expect_same_adamw_state(Ctx& c, const std::string& what, const std::map<std::string, AdamWEntry>& got,
                             const std::map<std::string, AdamWEntry>& want) {
  c.expect(got.size() == want.size(), what + ": AdamW state for " + std::to_string(got.size()) + " parameters, saved " +
                                          std::to_string(want.size()));
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    if (it == got.end()) {
      c.fail(what + ": no AdamW state for " + name);
      continue;
    }
    c.expect(it->second.step == w.step, what + ": " + name + "'s AdamW step");
    expect_same_tensor(c, what + ": " + name + ".exp_avg", it->second.exp_avg, w.exp_avg, 0.0);
    expect_same_tensor(c, what + ": " + name + ".exp_avg_sq", it->second.exp_avg_sq, w.exp_avg_sq, 0.0);
  }
}

torch::optim::AdamWOptions tiny_adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.01); }

}  // namespace

// --- parameters too small for every rank, in every kind of checkpoint ----------------------------

CONFORMANCE_CASE(CheckpointEdgeCases, ParametersTooSmallForEveryRankRoundTripInEveryKind, 4,
                 "#60, #241: FSDP1 test_fsdp_state_dict test_local_state_dict_with_empty_ranks; FSDP2 "
                 "test_fully_shard_state_dict test_dp_state_dict_save_load (tiny dims 2..5, empty shards)") {
  ScenarioDir dir(c, "tiny-state");
  int run = 0;
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    TinyNet local;
    torch::optim::AdamW local_optim(local->parameters(), tiny_adamw());
    std::vector<double> local_losses;
    for (int s = 0; s < 4; ++s) local_losses.push_back(tiny_local_step(local, local_optim, s));

    // The run never interrupted.
    torch::manual_seed(0);
    TinyNet straight;
    fsdp::FullyShardedDataParallel straight_model(straight, c.mesh, tiny_units(v, straight));
    const int F = straight_model.shard_size();
    for (const auto& u : straight_model.units()) {
      if (u.name == "scale") {
        c.expect(u.numel == 1 && u.padded_numel == F && u.shard_numel == 1,
                 "the scale's unit holds 1 element, padded to F, a shard of 1 (empty past rank 0 of each shard group)");
      }
    }
    torch::optim::AdamW straight_optim(straight_model.parameters(), tiny_adamw());
    std::vector<double> losses;
    for (int s = 0; s < 4; ++s) losses.push_back(tiny_step(c, straight_model, straight_optim, s));
    // AdamW divides by the root of its second moment: rounding differences of O(1e-8) in a
    // gradient near zero grow, so the comparison with local training allows 1e-5 (measured ~1e-7);
    // the resumed runs below are compared with the uninterrupted one bit for bit.
    expect_same_losses(c, "against local training", losses, local_losses, 1e-5);
    expect_same_model(c, straight_model, *straight, *local, 1e-5);

    // One model saved at step 2 in every kind; then, for each kind, every parameter overwritten
    // (summon_full_params, written back into the shards) and one more step taken (the optimizer
    // state moves too), and the checkpoint loaded: each brings back the saved bits, the empty
    // pieces included. The last load is trained on against the uninterrupted run.
    torch::manual_seed(0);
    TinyNet mine;
    fsdp::FullyShardedDataParallel model(mine, c.mesh, tiny_units(v, mine));
    torch::optim::AdamW optim(model.parameters(), tiny_adamw());
    for (int s = 0; s < 2; ++s) tiny_step(c, model, optim, s);
    const auto before = whole_state(model, *mine);
    const auto optim_before = adamw_state(model, optim);
    std::vector<std::pair<StateDictKind, std::string>> saved;
    for (const auto kind : {StateDictKind::FULL, StateDictKind::SHARDED, StateDictKind::LOCAL}) {
      fsdp::Checkpointer ckpt(c.mesh, dir.sub(std::to_string(run++)), {kind});
      saved.emplace_back(kind, ckpt.save(model, &optim, {2}));
    }
    for (const auto& [kind, path] : saved) {
      const std::string what = kind_name(kind) + " checkpoint";
      {
        auto whole = model.summon_full_params();
        torch::NoGradGuard no_grad;
        for (auto& p : mine->parameters()) p.fill_(-3.0);
      }
      tiny_step(c, model, optim, 9);
      fsdp::load_checkpoint(path, model, &optim);
      const auto after = whole_state(model, *mine);
      for (const auto& [name, t] : before) expect_same_tensor(c, what + ": " + name + " after the load", after.at(name), t, 0.0);
      expect_same_adamw_state(c, what, adamw_state(model, optim), optim_before);
    }
    std::vector<double> more;
    for (int s = 2; s < 4; ++s) more.push_back(tiny_step(c, model, optim, s));
    expect_same_losses(c, "resumed", more, {losses[2], losses[3]}, 0.0);
    expect_same_wrapped(c, "resumed", model, *mine, straight_model, *straight, 0.0);
  });
}

// --- sharded_state_dict: views of the shards that tile every tensor once -------------------------

CONFORMANCE_CASE(CheckpointEdgeCases, ShardedStateDictIsViewsOfTheShardsTilingEveryTensorOnce, 4,
                 "#241: FSDP2 test_fully_shard_state_dict test_dp_state_dict_save_load (views of the shards, "
                 "keys == parameter names, loading writes into the shards, a state dict after a forward)") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    TinyNet mine;
    torch::manual_seed(0);
    TinyNet local;
    fsdp::FullyShardedDataParallel model(mine, c.mesh, tiny_units(v, mine));
    const int F = model.shard_size();
    auto sd = fsdp::sharded_state_dict(model);
    std::set<std::string> keys, want;
    for (const auto& [name, piece] : sd) keys.insert(name);
    for (const auto& p : local->named_parameters(true)) want.insert(p.key());
    c.expect(keys == want, "sharded_state_dict's keys {" + joined(keys) + "} are the parameter names {" + joined(want) + "}");

    // Each rank's pieces: where they start and how many elements, gathered from every rank.
    const std::vector<std::string> names(want.begin(), want.end());
    auto mine_t = torch::zeros({static_cast<int64_t>(2 * names.size())}, torch::kLong);
    std::map<std::string, const fsdp::ShardedTensor*> by_name;
    for (const auto& [name, piece] : sd) by_name[name] = &piece;
    for (size_t i = 0; i < names.size(); ++i) {
      const auto* p = by_name.count(names[i]) ? by_name[names[i]] : nullptr;
      if (!p) continue;
      const auto expected_shape = local->named_parameters(true)[names[i]].sizes().vec();
      c.expect(p->shape == expected_shape, names[i] + ": the piece names the whole tensor's shape");
      mine_t[2 * i] = p->flat_begin;
      mine_t[2 * i + 1] = p->local.numel();
    }
    std::vector<std::vector<at::Tensor>> out{std::vector<at::Tensor>(c.world)};
    for (auto& t : out[0]) t = torch::zeros_like(mine_t);
    std::vector<at::Tensor> in{mine_t};
    c.mesh->world()->allgather(out, in)->wait();
    // Within each group of F ranks that shards a parameter, the pieces tile it exactly once, some
    // of them empty.
    for (size_t i = 0; i < names.size(); ++i) {
      const int64_t numel = local->named_parameters(true)[names[i]].numel();
      for (int g = 0; g < c.world / F; ++g) {
        std::vector<std::pair<int64_t, int64_t>> ranges;
        int empty = 0;
        for (int r = g * F; r < (g + 1) * F; ++r) {
          const int64_t b = out[0][r][2 * i].item<int64_t>(), n = out[0][r][2 * i + 1].item<int64_t>();
          if (n == 0) ++empty;
          else ranges.emplace_back(b, n);
        }
        std::sort(ranges.begin(), ranges.end());
        int64_t at = 0;
        bool tiles = true;
        for (const auto& [b, n] : ranges) {
          tiles = tiles && b == at;
          at = b + n;
        }
        c.expect(tiles && at == numel, names[i] + ": the pieces of shard group " + std::to_string(g) +
                                           " tile its " + std::to_string(numel) + " elements exactly once");
        if (F == 4 && names[i] == "scale.w") c.expect(empty == 3, "scale.w: three ranks of four hold an empty piece");
      }
    }

    // The pieces are views of the shards: writing element k's index into each piece is a write
    // into the model, which every rank then sees whole.
    {
      torch::NoGradGuard no_grad;
      for (auto& [name, piece] : sd) {
        if (piece.local.numel() == 0) continue;
        piece.local.copy_(torch::arange(piece.flat_begin, piece.flat_begin + piece.local.numel(), torch::kFloat)
                              .mul_(0.01)
                              .view(piece.local.sizes()));
      }
      for (auto& p : local->parameters()) p.copy_(torch::arange(p.numel(), torch::kFloat).mul_(0.01).view(p.sizes()));
    }
    expect_same_model(c, model, *mine, *local, 0.0);

    // A state dict after a forward that waits for its backward is refused (shard_grad_op keeps
    // the units gathered then); after an evaluation forward it is the one before it.
    const auto before = fsdp::full_state_dict(model, /*rank0_only=*/false);
    {
      torch::NoGradGuard no_grad;
      model(my_rows(c, randn(500, {8, 2})));
    }
    const auto after_eval = fsdp::full_state_dict(model, /*rank0_only=*/false);
    c.expect(before.size() == after_eval.size(), "the state dict after an evaluation forward has every tensor");
    for (size_t i = 0; i < std::min(before.size(), after_eval.size()); ++i) {
      expect_same_tensor(c, "after an evaluation forward: " + before[i].first, after_eval[i].second, before[i].second, 0.0);
    }
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    const auto x = randn(301, {8, 2}), y = randn(401, {8, 5});
    optim.zero_grad();
    auto loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, y));
    c.expect_refused("full_state_dict between a forward and its backward", [&] { fsdp::full_state_dict(model, false); },
                     {"full_state_dict", "between a forward and its backward"});
    c.expect_refused("sharded_state_dict between a forward and its backward", [&] { fsdp::sharded_state_dict(model); },
                     {"sharded_state_dict", "between a forward and its backward"});
    loss.backward();
    optim.step();
    local_optim.zero_grad();
    auto local_loss = torch::mse_loss(local->forward(x), y);
    local_loss.backward();
    local_optim.step();
    c.expect_near("the step after the refusals", global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

namespace {

// Two groups (weights, biases), each listed in a rank-dependent order, the groups themselves in
// the opposite order on odd ranks.
std::vector<torch::optim::OptimizerParamGroup> permuted_groups(const std::vector<std::pair<std::string, torch::Tensor>>& named,
                                                              int rotate, bool swap) {
  std::vector<torch::Tensor> weights, biases;
  for (const auto& [n, p] : named) (n.find("bias") != std::string::npos ? biases : weights).push_back(p);
  for (auto* list : {&weights, &biases}) {
    std::rotate(list->begin(), list->begin() + (rotate % list->size()), list->end());
    if (rotate % 2) std::reverse(list->begin(), list->end());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(weights, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-2).weight_decay(0.1)));
  groups.emplace_back(biases, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(2e-2).weight_decay(0.0)));
  if (swap) std::swap(groups[0], groups[1]);
  return groups;
}

}  // namespace

// --- ranks that build their optimizer with the parameters in different orders -------------------

CONFORMANCE_CASE(CheckpointEdgeCases, RanksBuildTheirOptimizerWithParametersInDifferentOrders, 4,
                 "#149: FSDP1 test_fsdp_optim_state test_optim_state_dict_nested [use_diff_optim_inputs]") {
  ScenarioDir dir(c, "order-state");
  int run = 0;
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    Net local;
    std::vector<std::pair<std::string, torch::Tensor>> local_named;
    for (const auto& p : local->named_parameters(true)) local_named.emplace_back(p.key(), p.value());
    torch::optim::AdamW local_optim(permuted_groups(local_named, 0, false), torch::optim::AdamWOptions(1e-2));
    std::vector<double> local_losses;
    for (int s = 0; s < 4; ++s) local_losses.push_back(local_step(local, local_optim, s));

    torch::manual_seed(0);
    Net mine;
    Wrapped model(mine, c.mesh, blocks_as_units(v));
    torch::optim::AdamW optim(permuted_groups(model.named_parameters(), c.rank, c.rank % 2 == 1),
                              torch::optim::AdamWOptions(1e-2));
    std::vector<double> losses;
    for (int s = 0; s < 2; ++s) losses.push_back(fsdp_step(c, model, optim, s));
    std::map<StateDictKind, std::string> saved;
    for (const auto kind : {StateDictKind::FULL, StateDictKind::SHARDED}) {
      fsdp::Checkpointer ckpt(c.mesh, dir.sub(std::to_string(run) + "-" + kind_name(kind)), {kind});
      saved[kind] = ckpt.save(model, &optim, {2});
    }
    ++run;
    for (int s = 2; s < 4; ++s) losses.push_back(fsdp_step(c, model, optim, s));
    // AdamW: see ParametersTooSmallForEveryRankRoundTripInEveryKind for the tolerance.
    expect_same_losses(c, "against local training", losses, local_losses, 1e-5);
    expect_same_model(c, model, *mine, *local, 1e-5);

    for (const auto& [kind, path] : saved) {
      const std::string what = "resumed from " + kind_name(kind) + " into optimizers in yet other orders";
      torch::manual_seed(7);
      Net again;
      Wrapped resumed(again, c.mesh, blocks_as_units(v));
      torch::optim::AdamW resumed_optim(permuted_groups(resumed.named_parameters(), c.rank + 1, c.rank % 2 == 0),
                                        torch::optim::AdamWOptions(1e-2));
      fsdp::load_checkpoint(path, resumed, &resumed_optim);
      std::vector<double> more;
      for (int s = 2; s < 4; ++s) more.push_back(fsdp_step(c, resumed, resumed_optim, s));
      expect_same_losses(c, what, more, {losses[2], losses[3]}, 0.0);
      expect_same_wrapped(c, what, resumed, *again, model, *mine, 0.0);
    }
  });
}

// --- one rank's optimizer lacks a parameter ------------------------------------------------------

CONFORMANCE_CASE(CheckpointEdgeCases, OptimizerLackingAParameterOnOneRankIsRefused, 4,
                 "#151: FSDP1 test_fsdp_optim_state test_full_optim_state_dict_nested_invalid") {
  ScenarioDir dir(c, "lacking-state");
  int run = 0;
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    Net mine;
    Wrapped model(mine, c.mesh, blocks_as_units(v));
    std::vector<torch::Tensor> all_but_head_bias;
    for (const auto& [n, p] : model.named_parameters()) {
      if (n != "head.bias") all_but_head_bias.push_back(p);
    }
    // A good checkpoint first, from optimizers that hold every parameter.
    torch::optim::AdamW optim(model.parameters(), torch::optim::AdamWOptions(1e-2));
    fsdp_step(c, model, optim, 0);
    std::string good;
    {
      fsdp::Checkpointer ckpt(c.mesh, dir.sub(std::to_string(run++)), {StateDictKind::SHARDED});
      good = ckpt.save(model, &optim, {1});
    }
    const auto before = whole_state(model, *mine);

    // Rank 1 builds its optimizer without head.bias: a load into it is refused on every rank,
    // naming the parameter, and changes nothing.
    torch::optim::AdamW partial(c.rank == 1 ? all_but_head_bias : model.parameters(), torch::optim::AdamWOptions(1e-2));
    c.expect_refused("a load into optimizers of which rank 1's lacks head.bias",
                     [&] { fsdp::load_checkpoint(good, model, &partial); }, {"head.bias", "nothing was changed"});
    c.expect(partial.state().empty(), "the refused load gave the optimizer no state");
    const auto after = whole_state(model, *mine);
    for (const auto& [name, t] : before) expect_same_tensor(c, "after the refused load: " + name, after.at(name), t, 0.0);

    // A save from such optimizers is refused on every rank, naming the parameter and the rank,
    // and writes nothing.
    fsdp_step(c, model, partial, 1);
    for (const auto kind : {StateDictKind::FULL, StateDictKind::SHARDED, StateDictKind::LOCAL}) {
      const std::string folder = dir.sub(std::to_string(run++));
      {
        fsdp::Checkpointer ckpt(c.mesh, folder, {kind});
        c.expect_refused("a " + kind_name(kind) + " save of optimizers of which rank 1's lacks head.bias",
                         [&] { ckpt.save(model, &partial, {2}); }, {"head.bias", "rank 1"});
        c.expect(!fsdp::find_checkpoint(*c.mesh, folder), "the refused " + kind_name(kind) + " save left a checkpoint");
      }
      if (c.rank == 0) {
        for (const auto& name : entries_of(folder)) {
          c.expect(name == ".lock", "the refused " + kind_name(kind) + " save left " + name + " in its folder");
        }
      }
    }
    // Rank 2's optimizer also steps a tensor that is not the model's: refused on every rank at once
    // (not after the others waited out a collective timeout), nothing written.
    torch::Tensor stray = torch::zeros({3}, torch::requires_grad());
    std::vector<torch::Tensor> with_stray = model.parameters();
    if (c.rank == 2) with_stray.push_back(stray);
    torch::optim::AdamW odd(with_stray, torch::optim::AdamWOptions(1e-2));
    {
      const std::string folder = dir.sub(std::to_string(run++));
      {
        fsdp::Checkpointer ckpt(c.mesh, folder, {StateDictKind::SHARDED});
        c.expect_refused("a save of optimizers of which rank 2's steps a tensor that is not the model's",
                         [&] { ckpt.save(model, &odd, {2}); }, {"rank 2", "not a parameter of this wrapped model"});
      }
      if (c.rank == 0) {
        for (const auto& name : entries_of(folder)) {
          c.expect(name == ".lock", "the refused save left " + name + " in its folder");
        }
      }
    }
  });
}

// --- a load into another unit layout -----------------------------------------------------------

CONFORMANCE_CASE(CheckpointEdgeCases, ResumesIntoAnotherUnitLayout, 4,
                 "#153: FSDP1 test_fsdp_optim_state test_optim_state_dict_nested [wrap_alt=True], "
                 "test_load_optim_state_dict (the loading model wrapped into different units)") {
  ScenarioDir dir(c, "layout-state");
  int run = 0;
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    Net mine;
    Wrapped model(mine, c.mesh, blocks_as_units(v));
    c.expect(model.units().size() == 3, "saved with the two blocks and the root as units");
    torch::optim::AdamW optim(model.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    std::vector<double> losses;
    for (int s = 0; s < 2; ++s) losses.push_back(fsdp_step(c, model, optim, s));
    std::map<StateDictKind, std::string> saved;
    for (const auto kind : {StateDictKind::FULL, StateDictKind::SHARDED, StateDictKind::LOCAL}) {
      fsdp::Checkpointer ckpt(c.mesh, dir.sub(std::to_string(run) + "-" + kind_name(kind)), {kind});
      saved[kind] = ckpt.save(model, &optim, {2});
    }
    ++run;
    for (int s = 2; s < 4; ++s) losses.push_back(fsdp_step(c, model, optim, s));

    for (const auto& [kind, path] : saved) {
      const std::string what = "resumed from " + kind_name(kind) + " with every Linear a unit";
      torch::manual_seed(7);
      Net again;
      fsdp::Options o = v.options;
      o.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
      Wrapped resumed(again, c.mesh, o);
      c.expect(resumed.units().size() == 4, "resumed with the four Linears as units (the root keeps the buffers)");
      torch::optim::AdamW resumed_optim(resumed.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      if (kind == StateDictKind::LOCAL) {
        // A LOCAL checkpoint holds flat shards of the saved units: refused, saying what to do.
        c.expect_refused(what, [&] { fsdp::load_checkpoint(path, resumed, &resumed_optim); },
                         {"LOCAL checkpoints load only into the same layout", "save FULL or SHARDED checkpoints"});
        continue;
      }
      fsdp::load_checkpoint(path, resumed, &resumed_optim);
      std::vector<double> more;
      for (int s = 2; s < 4; ++s) more.push_back(fsdp_step(c, resumed, resumed_optim, s));
      // Other units reduce other flat buffers: the gradients' sums may round differently.
      expect_same_losses(c, what, more, {losses[2], losses[3]}, 1e-5);
      expect_same_wrapped(c, what, resumed, *again, model, *mine, 1e-5);
    }
  });
}

namespace {

// The first parameter never gets a gradient: a Linear the forward never calls, or a frozen one.
struct FirstQuietNetImpl : torch::nn::Module {
  explicit FirstQuietNetImpl(bool frozen) : frozen(frozen) {
    first = register_module("first", torch::nn::Linear(6, 6));
    if (frozen) {
      for (auto& p : first->parameters()) p.requires_grad_(false);
    }
    body = register_module("body", torch::nn::Linear(6, 8));
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = frozen ? first(x) : x;
    return head(torch::tanh(body(h)));
  }
  bool frozen;
  torch::nn::Linear first{nullptr}, body{nullptr}, head{nullptr};
};
TORCH_MODULE(FirstQuietNet);

}  // namespace

// --- AdamW state where the first parameter has none ---------------------------------------------

CONFORMANCE_CASE(CheckpointEdgeCases, AdamWStateWhereTheFirstParameterHasNone, 4,
                 "#157: FSDP1 test_fsdp_optim_state test_save_load_without_0th_param_state (unused or frozen)") {
  ScenarioDir dir(c, "first-state");
  int run = 0;
  std::vector<Variant> variants;
  // PyTorch's test runs one strategy: the unused form here runs sharded, replicated and hybrid
  // placements, the frozen form full and hybrid sharding.
  for (const bool frozen : {false, true}) {
    for (auto v : strategies(c, frozen ? std::vector<std::string>{"full_shard", "hybrid_shard"}
                                       : std::vector<std::string>{"full_shard", "no_shard", "hybrid_shard"})) {
      v.name += frozen ? ", first Linear frozen" : ", first Linear unused";
      variants.push_back(v);
    }
  }
  for_each(c, variants, [&](const Variant& v) {
    const bool frozen = v.name.find("frozen") != std::string::npos;
    const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
    torch::manual_seed(0);
    FirstQuietNet local(frozen);
    torch::optim::AdamW local_optim(local->parameters(), adamw);
    torch::manual_seed(0);
    FirstQuietNet mine(frozen);
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    torch::optim::AdamW optim(model.parameters(), adamw);
    std::vector<double> losses, local_losses;
    for (int s = 0; s < 2; ++s) {
      losses.push_back(fsdp_step(c, model, optim, s));
      local_losses.push_back(local_step(local, local_optim, s));
    }
    // The first Linear has no gradient, so no AdamW state, and weight decay leaves it alone.
    for (const auto& p : mine->first->parameters()) {
      c.expect(!p.grad().defined(), "the first Linear has no gradient");
      c.expect(!optim.state().count(p.unsafeGetTensorImpl()), "the first Linear has no AdamW state");
    }
    // Every kind for the unused Linear; SHARDED, the one PyTorch's test saves, for the frozen one.
    std::map<StateDictKind, std::string> saved;
    const std::vector<StateDictKind> kinds = frozen ? std::vector<StateDictKind>{StateDictKind::SHARDED}
                                                    : std::vector<StateDictKind>{StateDictKind::FULL, StateDictKind::SHARDED,
                                                                                 StateDictKind::LOCAL};
    for (const auto kind : kinds) {
      fsdp::Checkpointer ckpt(c.mesh, dir.sub(std::to_string(run) + "-" + kind_name(kind)), {kind});
      saved[kind] = ckpt.save(model, &optim, {2});
    }
    ++run;
    for (int s = 2; s < 4; ++s) {
      losses.push_back(fsdp_step(c, model, optim, s));
      local_losses.push_back(local_step(local, local_optim, s));
    }
    // AdamW: see ParametersTooSmallForEveryRankRoundTripInEveryKind for the tolerance.
    expect_same_losses(c, "against local training", losses, local_losses, 1e-5);
    expect_same_model(c, model, *mine, *local, 1e-5);

    for (const auto& [kind, path] : saved) {
      const std::string what = "resumed from " + kind_name(kind);
      torch::manual_seed(7);
      FirstQuietNet again(frozen);
      fsdp::FullyShardedDataParallel resumed(again, c.mesh, o);
      torch::optim::AdamW resumed_optim(resumed.parameters(), adamw);
      // A trained optimizer's state must go where the checkpoint has none.
      fsdp_step(c, resumed, resumed_optim, 5);
      fsdp::load_checkpoint(path, resumed, &resumed_optim);
      for (const auto& p : again->first->parameters()) {
        c.expect(!resumed_optim.state().count(p.unsafeGetTensorImpl()), what + ": the first Linear has no AdamW state");
      }
      std::vector<double> more;
      for (int s = 2; s < 4; ++s) more.push_back(fsdp_step(c, resumed, resumed_optim, s));
      expect_same_losses(c, what, more, {losses[2], losses[3]}, 0.0);
      expect_same_wrapped(c, what, resumed, *again, model, *mine, 0.0);
    }
  });
}

// --- a save before the first optimizer step ------------------------------------------------------

CONFORMANCE_CASE(CheckpointEdgeCases, SaveBeforeTheFirstStepResumesLikeAFreshOptimizer, 4,
                 "#158: FSDP1 test_fsdp_optim_state test_with_empty_optimizer_state") {
  ScenarioDir dir(c, "empty-state");
  int run = 0;
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    Net local;
    torch::optim::AdamW local_optim(local->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::manual_seed(0);
    Net mine;
    Wrapped model(mine, c.mesh, blocks_as_units(v));
    torch::optim::AdamW optim(model.parameters(), torch::optim::AdamWOptions(1e-2));
    std::map<StateDictKind, std::string> saved;
    for (const auto kind : {StateDictKind::FULL, StateDictKind::SHARDED, StateDictKind::LOCAL}) {
      fsdp::Checkpointer ckpt(c.mesh, dir.sub(std::to_string(run) + "-" + kind_name(kind)), {kind});
      c.expect_ok("a " + kind_name(kind) + " save before the first step", [&] { saved[kind] = ckpt.save(model, &optim, {0}); });
    }
    ++run;
    std::vector<double> losses, local_losses;
    for (int s = 0; s < 2; ++s) {
      losses.push_back(fsdp_step(c, model, optim, s));
      local_losses.push_back(local_step(local, local_optim, s));
    }
    expect_same_losses(c, "against local training", losses, local_losses, 1e-5);

    for (const auto& [kind, path] : saved) {
      const std::string what = "a trained model and optimizer loaded from the " + kind_name(kind) + " save before step 0";
      torch::manual_seed(7);
      Net again;
      Wrapped resumed(again, c.mesh, blocks_as_units(v));
      torch::optim::AdamW resumed_optim(resumed.parameters(), torch::optim::AdamWOptions(1e-2));
      for (int s = 5; s < 7; ++s) fsdp_step(c, resumed, resumed_optim, s);
      c.expect(fsdp::load_checkpoint(path, resumed, &resumed_optim).step == 0, what + ": the saved step is 0");
      c.expect(resumed_optim.state().empty(), what + ": the optimizer has no state, as before its first step");
      std::vector<double> more;
      for (int s = 0; s < 2; ++s) more.push_back(fsdp_step(c, resumed, resumed_optim, s));
      expect_same_losses(c, what, more, losses, 0.0);
      expect_same_wrapped(c, what, resumed, *again, model, *mine, 0.0);
    }
  });
}

// --- SGD without momentum: no state at all -------------------------------------------------------

CONFORMANCE_CASE(CheckpointEdgeCases, SGDWithoutMomentumHasNoStateAndResumesExactly, 4,
                 "#159: FSDP1 test_fsdp_optim_state test_state_dict_with_none_tensor_state (an optimizer "
                 "without tensor state)") {
  ScenarioDir dir(c, "sgd-state");
  int run = 0;
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    Net local;
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.1));
    torch::manual_seed(0);
    Net mine;
    Wrapped model(mine, c.mesh, blocks_as_units(v));
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.1));
    std::vector<double> losses, local_losses;
    for (int s = 0; s < 2; ++s) {
      losses.push_back(fsdp_step(c, model, optim, s));
      local_losses.push_back(local_step(local, local_optim, s));
    }
    c.expect(optim.state().empty(), "SGD without momentum keeps no state");
    std::map<StateDictKind, std::string> saved;
    for (const auto kind : {StateDictKind::FULL, StateDictKind::SHARDED, StateDictKind::LOCAL}) {
      fsdp::Checkpointer ckpt(c.mesh, dir.sub(std::to_string(run) + "-" + kind_name(kind)), {kind});
      saved[kind] = ckpt.save(model, &optim, {2});
    }
    ++run;
    for (int s = 2; s < 4; ++s) {
      losses.push_back(fsdp_step(c, model, optim, s));
      local_losses.push_back(local_step(local, local_optim, s));
    }
    expect_same_losses(c, "against local training", losses, local_losses, 1e-5);
    expect_same_model(c, model, *mine, *local, 1e-5);

    for (const auto& [kind, path] : saved) {
      const std::string what = "resumed from " + kind_name(kind);
      torch::manual_seed(7);
      Net again;
      Wrapped resumed(again, c.mesh, blocks_as_units(v));
      torch::optim::SGD resumed_optim(resumed.parameters(), torch::optim::SGDOptions(0.5));  // the saved lr wins
      fsdp::load_checkpoint(path, resumed, &resumed_optim);
      c.expect(resumed_optim.state().empty(), what + ": no state");
      c.expect(static_cast<torch::optim::SGDOptions&>(resumed_optim.param_groups()[0].options()).lr() == 0.1,
               what + ": the saved learning rate");
      std::vector<double> more;
      for (int s = 2; s < 4; ++s) more.push_back(fsdp_step(c, resumed, resumed_optim, s));
      expect_same_losses(c, what, more, {losses[2], losses[3]}, 0.0);
      expect_same_wrapped(c, what, resumed, *again, model, *mine, 0.0);
    }
  });
}

// --- the same model wrapped a second time, for inference ----------------------------------------

CONFORMANCE_CASE(CheckpointEdgeCases, WrappingTheSameModelAgainIsRefusedAndItsStateDictServesInference, 4,
                 "#172: FSDP1 test_fsdp_misc test_multiple_wrapping (the inner module wrapped again for inference)") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    Net mine;
    auto model = std::make_unique<Wrapped>(mine, c.mesh, blocks_as_units(v));
    torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int s = 0; s < 3; ++s) fsdp_step(c, *model, optim, s);
    const auto x = randn(600, {8, 6});
    torch::Tensor out;
    {
      torch::NoGradGuard no_grad;
      out = model->forward(my_rows(c, x));
    }
    // A second wrapper over the model, or over one of its units, while the first lives or after
    // it is gone: its parameters are the first wrapper's shards.
    const std::vector<std::string> says{"already", "FullyShardedDataParallel"};
    c.expect_refused("wrapping the wrapped model again", [&] { Wrapped again(mine, c.mesh, blocks_as_units(v)); }, says);
    c.expect_refused("wrapping one of its units again", [&] { fsdp::FullyShardedDataParallel again(mine->b0, c.mesh, v.options); },
                     says);
    // What serves inference instead: the whole parameters, in a fresh plain model.
    const auto sd = fsdp::full_state_dict(*model, /*rank0_only=*/false);
    model.reset();
    c.expect_refused("wrapping the model again after its wrapper is gone",
                     [&] { Wrapped again(mine, c.mesh, blocks_as_units(v)); }, says);
    torch::manual_seed(9);
    Net fresh;
    {
      torch::NoGradGuard no_grad;
      auto params = fresh->named_parameters(true);
      auto buffers = fresh->named_buffers(true);
      for (const auto& [name, t] : sd) {
        if (auto* p = params.find(name)) p->copy_(t);
        else buffers[name].copy_(t);
      }
    }
    torch::NoGradGuard no_grad;
    expect_same_tensor(c, "a plain model with the state dict, on this rank's rows", fresh->forward(my_rows(c, x)), out, 1e-6);
    Wrapped rewrapped(fresh, c.mesh, blocks_as_units(v));
    expect_same_tensor(c, "that model wrapped anew", rewrapped.forward(my_rows(c, x)), out, 1e-6);
  });
}

// --- a file that holds only some of the parameters -----------------------------------------------

CONFORMANCE_CASE(CheckpointEdgeCases, LoadingAFileThatLacksAParameterIsRefused, 2,
                 "#244: FSDP2 test_fully_shard_state_dict test_dp_state_dict_save_load (strict=False: a file "
                 "holding only some parameters)") {
  ScenarioDir dir(c, "partial-file");
  int run = 0;
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    Net mine;
    Wrapped model(mine, c.mesh, blocks_as_units(v));
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    fsdp_step(c, model, optim, 0);
    const auto before = whole_state(model, *mine);

    // The same model without head.bias, exported whole (safetensors); and a torch.save-style dict
    // of the trained model's tensors less head.bias, written by rank 0.
    torch::manual_seed(3);
    Net no_bias(false);
    Wrapped other(no_bias, c.mesh, blocks_as_units(v));
    const std::string safetensors = dir.sub(std::to_string(run) + "-no-bias.safetensors");
    fsdp::export_full(safetensors, other);
    const std::string pickled = dir.sub(std::to_string(run) + "-no-bias.pt");
    const auto sd = fsdp::full_state_dict(model, /*rank0_only=*/true);
    if (c.rank == 0) {
      c10::Dict<std::string, torch::Tensor> dict;
      for (const auto& [name, t] : sd) {
        if (name != "head.bias") dict.insert(name, t);
      }
      const auto bytes = torch::pickle_save(c10::IValue(dict));
      std::ofstream(pickled, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
    ++run;
    barrier(c);
    for (const auto& path : {safetensors, pickled}) {
      const std::string what = "load_model_file of " + file_name(path) + " (no head.bias)";
      c.expect_refused(what, [&] { fsdp::load_model_file(path, model); },
                       {"head.bias", "nothing was changed", "summon_full_params"});
      const auto after = whole_state(model, *mine);
      for (const auto& [name, t] : before) expect_same_tensor(c, what + ", then " + name, after.at(name), t, 0.0);
    }
    // The other way: a file with a tensor the model lacks.
    const std::string full = dir.sub(std::to_string(run++) + "-full.safetensors");
    fsdp::export_full(full, model);
    c.expect_refused("load_model_file of a file with head.bias into the model without it",
                     [&] { fsdp::load_model_file(full, other); }, {"head.bias", "nothing was changed"});
  });
}

}  // namespace checkpoint_edge_cases
}  // namespace conformance
