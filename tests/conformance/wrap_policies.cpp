// How a model is cut into units, and the parameters fsdp leaves to the user (PyTorch FSDP1's
// test_wrap, test_fsdp_ignored_modules, test_fsdp_misc and FSDP2's test_fully_shard_ignore_params):
// size_based_policy and its threshold, policies OR-ed together, fully_shard() marks as the only
// source of units, containers that are never units, ignored modules and parameters left out of the
// units and of the threshold, ignored modules that differ across ranks, and a replicated child the
// user reduces himself. Each layout is asserted through units() and trained against plain
// libtorch on the whole batch.
#include <algorithm>
#include <set>

#include "conformance.h"

namespace conformance {
namespace wrap_policies {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

std::string unit_names(const std::vector<fsdp::UnitInfo>& units) {
  std::vector<std::string> names;
  for (const auto& u : units) names.push_back("'" + u.name + "'");
  std::sort(names.begin(), names.end());
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return "{" + out + "}";
}

std::string set_text(std::set<std::string> names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + ("'" + n + "'");
  return "{" + out + "}";
}

void expect_units(Ctx& c, const std::vector<fsdp::UnitInfo>& units, const std::set<std::string>& want) {
  std::set<std::string> got;
  for (const auto& u : units) got.insert(u.name);
  c.expect(got == want, "the units are " + unit_names(units) + ", expected " + set_text(want));
}

// A copy: units() returns a new list each call.
std::optional<fsdp::UnitInfo> unit_named(const std::vector<fsdp::UnitInfo>& units, const std::string& name) {
  for (const auto& u : units) {
    if (u.name == name) return u;
  }
  return std::nullopt;
}

// Averages the gradients of parameters every rank holds whole (ignored by fsdp, replicated): what
// DDP would do for them. Sum over the world, divided by W.
void average_over_ranks(const Ctx& c, const std::vector<torch::Tensor>& params) {
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    std::vector<at::Tensor> g{p.grad()};
    c.mesh->world()->allreduce(g)->wait();
    p.grad().div_(c.world);
  }
}

// A Sequential that can sit inside another (libtorch's own cannot: its forward is a template).
struct InnerSequentialImpl : torch::nn::SequentialImpl {
  using SequentialImpl::SequentialImpl;
  torch::Tensor forward(const torch::Tensor& x) { return SequentialImpl::forward(x); }
};
TORCH_MODULE(InnerSequential);

// PyTorch's NestedSequentialModel: Sequential(Linear(5,5), Linear(5,5), Sequential(Linear(5,5),
// Linear(5,5))), 30 elements per Linear.
torch::nn::Sequential nested_sequential() {
  return torch::nn::Sequential(torch::nn::Linear(5, 5), torch::nn::Linear(5, 5),
                               InnerSequential(torch::nn::Linear(5, 5), torch::nn::Linear(5, 5)));
}

// Steps of a loop on any wrapped model and its local twin: global batch of 8 rows of `in` columns,
// targets of `out` columns, MSE, SGD with momentum. `before_step` runs on the fsdp side between
// backward and step (the user's own reductions); `local_before_step` on the local side.
template <typename W, typename L>
void train_like_local(Ctx& c, W& model, L& local, int64_t in, int64_t out, int steps,
                      const std::function<void()>& before_step = {}, const std::function<void()>& local_before_step = {},
                      std::vector<torch::Tensor> fsdp_params = {}, std::vector<torch::Tensor> local_params = {}) {
  if (fsdp_params.empty()) fsdp_params = model.parameters();
  if (local_params.empty()) local_params = unique_parameters(*local);
  torch::optim::SGD optim(fsdp_params, torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD local_optim(local_params, torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int step = 0; step < steps; ++step) {
    const auto x = randn(100 + step, {8, in}), y = randn(200 + step, {8, out});
    optim.zero_grad();
    auto loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, y));
    loss.backward();
    if (before_step) before_step();
    optim.step();
    local_optim.zero_grad();
    auto local_loss = torch::mse_loss(local->forward(x), y);
    local_loss.backward();
    if (local_before_step) local_before_step();
    local_optim.step();
    c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(),
                  1e-5);
  }
}

}  // namespace

// --- size_based_policy ---------------------------------------------------------------------------

CONFORMANCE_CASE(WrapPolicies, SizeBasedPolicyMergesSmallChildrenUpward, 4,
                 "#184: FSDP1 test_wrap test_auto_wrap_api (size_based_auto_wrap_policy, min_num_params=40)") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    auto mine = nested_sequential();
    torch::manual_seed(0);
    auto local = nested_sequential();
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::size_based_policy(40);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    // Bottom-up: no Linear (30) reaches 40; the inner Sequential (60) does; the rest is the root's.
    const auto units = model.units();
    expect_units(c, units, {"2", ""});
    if (const auto u = unit_named(units, "2")) c.expect(u->numel == 60, "unit '2' holds both inner Linears (60 elements)");
    if (const auto u = unit_named(units, "")) c.expect(u->numel == 60, "the root unit holds Linears 0 and 1 (60 elements)");
    train_like_local(c, model, local, 5, 5, 3);
    expect_same_model(c, model, *mine.ptr(), *local.ptr(), 1e-5);
  });
}

CONFORMANCE_CASE(WrapPolicies, SizeBasedPolicyOfZeroMakesEveryModuleWithParametersAUnit, 4,
                 "#179: FSDP1 test_wrap test_main_wrap_api (min_num_params=0 wraps every module, every prefetch "
                 "setting)") {
  std::vector<Variant> variants = every_strategy(c);
  for (const char* s : {"full_shard", "hybrid_shard"}) {
    for (const auto mode : {fsdp::BackwardPrefetch::NONE, fsdp::BackwardPrefetch::BACKWARD_POST}) {
      Variant v = strategy(c, s);
      v.options.backward_prefetch = mode;
      v.name += " backward_prefetch " + fsdp::to_string(mode);
      variants.push_back(v);
    }
    Variant v = strategy(c, s);
    v.options.forward_prefetch = true;
    v.name += " forward_prefetch";
    variants.push_back(v);
  }
  for_each(c, variants, [&](const Variant& v) {
    torch::manual_seed(0);
    auto mine = nested_sequential();
    torch::manual_seed(0);
    auto local = nested_sequential();
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::size_based_policy(0);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    // Every Linear; not the inner Sequential nor the root, which have no parameter left.
    expect_units(c, model.units(), {"0", "1", "2.0", "2.1"});
    train_like_local(c, model, local, 5, 5, 6);
    expect_same_model(c, model, *mine.ptr(), *local.ptr(), 1e-5);
  });
}

namespace {

// Linear layers in a ModuleList and a ModuleDict (containers without a forward of their own), and
// an attention.
struct ContainersImpl : torch::nn::Module {
  ContainersImpl() {
    layers = register_module("layers", torch::nn::ModuleList(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8)));
    torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>> d;
    d.insert("up", torch::nn::Linear(8, 8).ptr());
    d.insert("down", torch::nn::Linear(8, 8).ptr());
    branches = register_module("branches", torch::nn::ModuleDict(d));
    attn = register_module("attn", torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(8, 2)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x;
    for (const auto& m : *layers) h = torch::tanh(m->as<torch::nn::Linear>()->forward(h));
    h = branches["down"]->as<torch::nn::Linear>()->forward(torch::tanh(branches["up"]->as<torch::nn::Linear>()->forward(h)));
    auto s = h.unsqueeze(0);  // [1, batch, 8]: a sequence of one
    return std::get<0>(attn(s, s, s)).squeeze(0);
  }
  torch::nn::ModuleList layers{nullptr};
  torch::nn::ModuleDict branches{nullptr};
  torch::nn::MultiheadAttention attn{nullptr};
};
TORCH_MODULE(Containers);

}  // namespace

CONFORMANCE_CASE(WrapPolicies, SizeBasedPolicyNeverMakesAContainerAUnit, 4,
                 "#185: FSDP1 test_wrap test_auto_wrap_preset_exclude_wrap, test_auto_wrap_preset_exclude_wrap_include_children, "
                 "test_auto_wrap_preset_force_leaf, test_auto_wrap_preset_force_leaf_custom") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    Containers mine;
    torch::manual_seed(0);
    Containers local;
    fsdp::Options o = v.options;
    // Each Linear (72) is under 100; each container (144) is over it, and is not a unit: its
    // Linears go up to the root. The attention's out_proj (72) stays with it, a unit (288).
    o.auto_wrap_policy = fsdp::size_based_policy(100);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    expect_units(c, model.units(), {"attn", ""});
    if (const auto u = unit_named(model.units(), "")) c.expect(u->numel == 4 * 72, "the root holds the containers' four Linears");
    // A threshold the Linears reach: each becomes a unit, the containers never.
    torch::manual_seed(0);
    Containers small;
    fsdp::Options o2 = v.options;
    o2.auto_wrap_policy = fsdp::size_based_policy(50);
    fsdp::FullyShardedDataParallel model2(small, c.mesh, o2);
    std::set<std::string> names;
    for (const auto& u : model2.units()) names.insert(u.name);
    for (const auto* container : {"layers", "branches"}) {
      c.expect(!names.count(container), std::string("'") + container + "' is a unit under size_based_policy(50)");
    }
    for (const auto* linear : {"layers.0", "layers.1", "branches.up", "branches.down"}) {
      c.expect(names.count(linear) == 1, std::string("'") + linear + "' is not a unit under size_based_policy(50)");
    }
    train_like_local(c, model, local, 8, 8, 3);
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

namespace {

struct BnBlockImpl : torch::nn::Module {
  BnBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(8, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(bn(fc(x))) + x; }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(BnBlock);

struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    inp = register_module("inp", torch::nn::Linear(4, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    b0 = register_module("b0", BnBlock());
    b1 = register_module("b1", BnBlock());
    head = register_module("head", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(b1(b0(bn(inp(x))))); }
  torch::nn::Linear inp{nullptr}, head{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  BnBlock b0{nullptr}, b1{nullptr};
};
TORCH_MODULE(BnNet);

}  // namespace

CONFORMANCE_CASE(WrapPolicies, CombinedPoliciesMakeEveryBatchNormItsOwnUnit, 4,
                 "#178: FSDP1 test_wrap test_wrap_batchnorm_individually, test_bn_always_wrapped_individually "
                 "(_or_policy)") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    BnNet mine;
    torch::manual_seed(0);
    BnNet local;
    fsdp::Options o = v.options;
    const auto batch_norms = fsdp::module_type_policy<torch::nn::BatchNorm1dImpl>();
    const auto blocks = fsdp::module_type_policy<BnBlockImpl>();
    o.auto_wrap_policy = [=](const std::string& fqn, const torch::nn::Module& m, int64_t numel) {
      return batch_norms(fqn, m, numel) || blocks(fqn, m, numel);
    };
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    // Every BatchNorm, also inside a block the other policy picks; the blocks keep their Linear.
    expect_units(c, model.units(), {"bn", "b0.bn", "b0", "b1.bn", "b1", ""});
    if (const auto u = unit_named(model.units(), "b0")) c.expect(u->numel == 72, "block b0's unit holds its Linear only");
    // Each rank normalizes its own rows, as DDP does: local training runs each rank's rows through
    // the BatchNorms apart and averages the W losses (the running statistics, updated W times
    // there, are not compared).
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      const auto x = randn(100 + step, {16, 4}), y = randn(200 + step, {16, 2});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      optim.step();
      local_optim.zero_grad();
      const int64_t per = 16 / c.world;
      torch::Tensor local_loss;
      for (int r = 0; r < c.world; ++r) {
        auto l = torch::mse_loss(local->forward(x.narrow(0, r * per, per)), y.narrow(0, r * per, per)) / c.world;
        local_loss = local_loss.defined() ? local_loss + l : l;
      }
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                    local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 1e-5, /*buffers=*/false);
  });
}

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl() { fc = register_module("fc", torch::nn::Linear(8, 8)); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(fc(x)) + x; }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

// An embedding, three blocks in a ModuleList, a head.
struct MarkedNetImpl : torch::nn::Module {
  MarkedNetImpl() {
    emb = register_module("emb", torch::nn::Embedding(20, 8));
    blocks = register_module("blocks", torch::nn::ModuleList(Block(), Block(), Block()));
    head = register_module("head", torch::nn::Linear(8, 4));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    auto h = emb(ids).mean(1);
    for (const auto& b : *blocks) h = b->as<BlockImpl>()->forward(h);
    return head(h);
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(MarkedNet);

}  // namespace

CONFORMANCE_CASE(WrapPolicies, FullyShardMarksAreTheOnlySourceOfUnits, 4,
                 "#181: FSDP1 test_wrap test_wrap / test_wrap_disabled_outside_context (manual wrap(); fsdp's "
                 "analogue: fully_shard() marks with no auto_wrap_policy)") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    MarkedNet mine;
    torch::manual_seed(0);
    MarkedNet local;
    fsdp::fully_shard(*mine->blocks[1]);
    fsdp::fully_shard(*mine->emb);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);  // no auto_wrap_policy
    const auto units = model.units();
    expect_units(c, units, {"emb", "blocks.1", ""});
    if (const auto u = unit_named(units, "blocks.1")) {
      c.expect(u->fqns == std::vector<std::string>{"blocks.1.fc.weight", "blocks.1.fc.bias"}, "blocks.1 holds its Linear");
    }
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      const auto ids = randint(100 + step, 20, {8, 3});
      const auto y = randn(200 + step, {8, 4});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(my_rows(c, ids)), my_rows(c, y));
      loss.backward();
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(ids), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                    local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

// --- ignored modules and parameters --------------------------------------------------------------

CONFORMANCE_CASE(WrapPolicies, IgnoredModulesDoNotCountTowardTheSizeThreshold, 4,
                 "#187: FSDP1 test_wrap test_auto_wrap_with_ignored_modules, test_always_wrap_with_ignored_modules") {
  std::vector<Variant> variants;
  for (const bool always : {false, true}) {
    for (auto v : every_strategy(c)) {
      v.name += always ? ", every module a unit" : ", size_based_policy(40)";
      variants.push_back(v);
    }
  }
  for_each(c, variants, [&](const Variant& v) {
    const bool always = v.name.find("every module") != std::string::npos;
    torch::manual_seed(0);
    auto mine = nested_sequential();
    torch::manual_seed(0);
    auto local = nested_sequential();
    fsdp::Options o = v.options;
    o.ignored_modules = {mine->ptr(1), mine->ptr(2)->as<torch::nn::SequentialImpl>()->ptr(0)};
    o.auto_wrap_policy = always ? fsdp::WrapPolicy([](const std::string&, const torch::nn::Module&, int64_t) { return true; })
                                : fsdp::size_based_policy(40);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    if (always) {
      // Every module with a parameter fsdp manages: Linears 0 and 2.1.
      expect_units(c, model.units(), {"0", "2.1"});
    } else {
      // Without the ignored 2.0, the inner Sequential holds 30 < 40: everything is the root's.
      expect_units(c, model.units(), {""});
      if (const auto u = unit_named(model.units(), "")) {
        c.expect(u->fqns == std::vector<std::string>{"0.weight", "0.bias", "2.1.weight", "2.1.bias"},
                 "the root unit holds Linears 0 and 2.1 only");
      }
    }
    // The ignored Linears are the user's, whole on every rank: he averages their gradients.
    std::vector<torch::Tensor> ignored;
    for (const auto& m : o.ignored_modules) {
      for (const auto& p : m->parameters()) ignored.push_back(p);
    }
    train_like_local(c, model, local, 5, 5, 3, [&] { average_over_ranks(c, ignored); });
    expect_same_model(c, model, *mine.ptr(), *local.ptr(), 1e-5);
  });
}

CONFORMANCE_CASE(WrapPolicies, IgnoredParametersAreLeftOutOfTheirUnits, 4,
                 "#91, #93: FSDP1 test_fsdp_ignored_modules test_ignored_modules_transformer (ignored_modules or "
                 "ignored_states, with and without auto wrap), test_ignored_states_auto_wrap (a weight ignored, its "
                 "bias not)") {
  std::vector<Variant> variants;
  for (const bool as_module : {false, true}) {
    for (auto v : every_strategy(c)) {
      v.name += as_module ? ", blocks.0.fc ignored as a module, no auto wrap" : ", blocks.0.fc.weight ignored, blocks units";
      variants.push_back(v);
    }
  }
  for_each(c, variants, [&](const Variant& v) {
    const bool as_module = v.name.find("as a module") != std::string::npos;
    torch::manual_seed(0);
    MarkedNet mine;
    torch::manual_seed(0);
    MarkedNet local;
    auto* fc = mine->blocks[0]->as<BlockImpl>();
    const torch::Tensor weight = fc->fc->weight;
    fsdp::Options o = v.options;
    if (as_module) {
      o.ignored_modules = {fc->fc.ptr()};
    } else {
      o.ignored_parameters = {weight};
      o.auto_wrap_policy = fsdp::module_type_policy<BlockImpl>();
    }
    int64_t total = 0;
    for (const auto& p : local->parameters()) total += p.numel();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    int64_t managed = 0;
    for (const auto& u : model.units()) managed += u.numel;
    const int64_t ignored_numel = as_module ? 72 : 64;
    c.expect(managed == total - ignored_numel, "the units hold " + std::to_string(managed) + " elements: every one but the " +
                                                   std::to_string(ignored_numel) + " ignored");
    if (!as_module) {
      // The weight's own unit keeps its bias, and only that.
      if (const auto u = unit_named(model.units(), "blocks.0")) {
        c.expect(u->fqns == std::vector<std::string>{"blocks.0.fc.bias"} && u->numel == 8,
                 "blocks.0's unit holds blocks.0.fc.bias alone");
      } else {
        c.fail("blocks.0 is no unit");
      }
    }
    // The ignored weight's gradient is whole and this rank's own: local training's on its rows.
    const auto ids = randint(100, 20, {8, 3});
    const auto y = randn(200, {8, 4});
    torch::manual_seed(0);
    MarkedNet twin;
    torch::mse_loss(twin->forward(my_rows(c, ids)), my_rows(c, y)).backward();
    torch::mse_loss(model(my_rows(c, ids)), my_rows(c, y)).backward();
    expect_same_tensor(c, "the ignored weight's gradient against local training's on this rank's rows", weight.grad(),
                       twin->blocks[0]->as<BlockImpl>()->fc->weight.grad(), 1e-6);
    model.module()->zero_grad();
    // Averaged by the user, it trains as in local training.
    std::vector<torch::Tensor> ignored{weight};
    if (as_module) ignored.push_back(fc->fc->bias);
    auto ids_of = [](int step) { return randint(100 + step, 20, {8, 3}); };
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      const auto yy = randn(200 + step, {8, 4});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(my_rows(c, ids_of(step))), my_rows(c, yy));
      loss.backward();
      average_over_ranks(c, ignored);
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(ids_of(step)), yy);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                    local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

CONFORMANCE_CASE(WrapPolicies, IgnoringTheWrappedModelItselfIsRefused, 2,
                 "#94: FSDP1 test_fsdp_ignored_modules test_ignored_modules_invalid") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    MarkedNet mine;
    fsdp::Options o = v.options;
    o.ignored_modules = {mine.ptr()};
    c.expect_refused("Options::ignored_modules holding the wrapped model itself",
                     [&] { fsdp::FullyShardedDataParallel model(mine, c.mesh, o); },
                     {"ignored_modules", "the wrapped model itself", "nothing would be sharded"});
    torch::manual_seed(0);
    MarkedNet other;
    fsdp::fully_shard(*other->emb);
    fsdp::Options o2 = v.options;
    o2.ignored_modules = {other->emb.ptr()};
    c.expect_refused("a module both marked with fully_shard() and ignored",
                     [&] { fsdp::FullyShardedDataParallel model(other, c.mesh, o2); }, {"fully_shard()", "ignored_modules"});
    // Neither refusal left anything behind: the model wraps and trains as usual.
    torch::manual_seed(0);
    MarkedNet local;
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    const auto ids = randint(100, 20, {8, 3});
    const auto y = randn(200, {8, 4});
    auto loss = torch::mse_loss(model(my_rows(c, ids)), my_rows(c, y));
    loss.backward();
    optim.step();
    auto local_loss = torch::mse_loss(local->forward(ids), y);
    local_loss.backward();
    local_optim.step();
    c.expect_near("loss after the refusals", global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

namespace {

// PyTorch's Model of test_fsdp_ignored_modules: layer0 Linear(3,5), layer1 Sequential(Linear(5,4),
// Linear(4,4), <ignored>, Linear(4,4)), layer2 Linear(4,2), layer3 Linear(2,2). The ignored part
// is `layers` stacked 4x4 matrices, x @ w[0] @ w[1] ..., each rank its own.
struct IgnoredStackImpl : torch::nn::Module {
  IgnoredStackImpl(int64_t layers, uint64_t seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    weight = register_parameter("weight", at::randn({layers, 4, 4}, gen, at::kFloat) * 0.3 + torch::eye(4));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (int64_t k = 0; k < weight.size(0); ++k) x = x.matmul(weight[k]);
    return x;
  }
  torch::Tensor weight;
};
TORCH_MODULE(IgnoredStack);

struct PeerModelImpl : torch::nn::Module {
  // `stack`: the ignored part, or null for none (local training runs each rank's own apart).
  explicit PeerModelImpl(IgnoredStack stack) {
    layer0 = register_module("layer0", torch::nn::Linear(3, 5));
    layer1 = register_module("layer1", torch::nn::Sequential(torch::nn::Linear(5, 4), torch::nn::Linear(4, 4)));
    if (!stack.is_empty()) layer1->push_back("2", stack);
    layer1->push_back("3", torch::nn::Linear(4, 4));
    layer2 = register_module("layer2", torch::nn::Linear(4, 2));
    layer3 = register_module("layer3", torch::nn::Linear(2, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return forward_with(x, nullptr); }
  // With rank r's own stack in place of the model's (local training).
  torch::Tensor forward_with(const torch::Tensor& x, IgnoredStackImpl* stack) {
    auto z = torch::relu(layer0(x));
    for (const auto& item : layer1->named_children()) {
      if (item.key() == "3" && stack) z = stack->forward(z);
      if (auto* linear = item.value()->as<torch::nn::LinearImpl>()) z = linear->forward(z);
      else z = item.value()->as<IgnoredStackImpl>()->forward(z);
    }
    z = torch::relu(z);
    z = torch::relu(layer2(z));
    return torch::relu(layer3(z));
  }
  torch::nn::Linear layer0{nullptr}, layer2{nullptr}, layer3{nullptr};
  torch::nn::Sequential layer1{nullptr};
};
TORCH_MODULE(PeerModel);

}  // namespace

CONFORMANCE_CASE(WrapPolicies, RanksIgnoringDifferentModules, 4,
                 "#95: FSDP1 test_fsdp_ignored_modules test_diff_ignored_modules_across_ranks") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    // PyTorch's own form: rank r has r + 1 ignored modules, so the names after them shift. fsdp
    // compares the models' structure at construction: refused on every rank, before any
    // collective on parameters.
    {
      torch::manual_seed(0);
      PeerModel mine(IgnoredStack(nullptr));
      std::vector<std::shared_ptr<torch::nn::Module>> ignored;
      auto seq = torch::nn::Sequential(torch::nn::Linear(5, 4), torch::nn::Linear(4, 4));
      for (int k = 0; k <= c.rank; ++k) {
        auto s = IgnoredStack(1, 50 + k);
        seq->push_back(s);
        ignored.push_back(s.ptr());
      }
      seq->push_back(torch::nn::Linear(4, 4));
      mine->layer1 = mine->replace_module("layer1", seq);
      fsdp::fully_shard(*mine->layer1);
      fsdp::fully_shard(*mine->layer3);
      fsdp::Options o = v.options;
      o.ignored_modules = ignored;
      c.expect_refused("a different number of ignored modules on each rank",
                       [&] { fsdp::FullyShardedDataParallel model(mine, c.mesh, o); },
                       {"differs across ranks", "ignored"});
    }
    // The form fsdp takes: the same ignored module on every rank, its shape each rank's own (rank
    // r's stack has r + 1 layers). Each rank's rows run through its own stack; the user scales
    // its gradient by 1/W, the share of its rows in the global mean loss.
    torch::manual_seed(0);
    PeerModel mine(IgnoredStack(c.rank + 1, 50 + c.rank));
    fsdp::fully_shard(*mine->layer1);
    fsdp::fully_shard(*mine->layer3);
    fsdp::Options o = v.options;
    o.ignored_modules = {mine->layer1->ptr(2)};
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    expect_units(c, model.units(), {"layer1", "layer3", ""});

    torch::manual_seed(0);
    PeerModel local(IgnoredStack(nullptr));
    std::vector<IgnoredStack> stacks;
    std::vector<torch::Tensor> local_params = local->parameters();
    for (int r = 0; r < c.world; ++r) {
      stacks.push_back(IgnoredStack(r + 1, 50 + r));
      for (const auto& p : stacks.back()->parameters()) local_params.push_back(p);
    }
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local_params, torch::optim::SGDOptions(0.05).momentum(0.9));
    const torch::Tensor own = mine->layer1->ptr(2)->as<IgnoredStackImpl>()->weight;
    for (int step = 0; step < 3; ++step) {
      const auto x = randn(100 + step, {8, 3}), y = randn(200 + step, {8, 2});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      own.grad().div_(c.world);
      optim.step();
      local_optim.zero_grad();
      const int64_t per = 8 / c.world;
      torch::Tensor local_loss;
      for (int r = 0; r < c.world; ++r) {
        auto l = torch::mse_loss(local->forward_with(x.narrow(0, r * per, per), stacks[r].get()), y.narrow(0, r * per, per)) /
                 c.world;
        local_loss = local_loss.defined() ? local_loss + l : l;
      }
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                    local_loss.item().toDouble(), 1e-5);
    }
    // The shared part against local training's, and this rank's stack against its twin there.
    const auto got = whole_state(model, *mine);
    for (const auto& p : local->named_parameters(true)) {
      std::string name = p.key();
      if (name == "layer1.2.weight") continue;  // the local model has no stack in the Sequential
      expect_same_tensor(c, name, got.at(name), p.value(), 1e-5);
    }
    expect_same_tensor(c, "this rank's ignored stack", own, stacks[c.rank]->weight, 1e-5);
  });
}

namespace {

// DDP-A / FSDP-B / DDP-C: fsdp shards B but not its child C, whose parameters every rank holds
// whole; the user averages their gradients (as DDP would) and clips them himself.
struct InnerImpl : torch::nn::Module {
  InnerImpl() {
    fc = register_module("fc", torch::nn::Linear(8, 8));
    c = register_module("c", torch::nn::Linear(8, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(c(torch::tanh(fc(x)))) + x; }
  torch::nn::Linear fc{nullptr}, c{nullptr};
};
TORCH_MODULE(Inner);

struct ABCImpl : torch::nn::Module {
  ABCImpl() {
    a = register_module("a", torch::nn::Linear(4, 8));
    b = register_module("b", Inner());
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(b(a(x))); }
  torch::nn::Linear a{nullptr}, head{nullptr};
  Inner b{nullptr};
};
TORCH_MODULE(ABC);

}  // namespace

CONFORMANCE_CASE(WrapPolicies, ReplicatedIgnoredChildWhoseGradientsTheUserAverages, 4,
                 "#262: FSDP2 test_fully_shard_ignore_params test_ddp_A_fsdp_B_ddp_C") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    ABC mine;
    torch::manual_seed(0);
    ABC local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<InnerImpl>();
    o.ignored_modules = {mine->b->c.ptr()};
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    expect_units(c, model.units(), {"b", ""});
    const std::vector<torch::Tensor> ignored = mine->b->c->parameters();
    std::vector<torch::Tensor> local_ignored = local->b->c->parameters(), local_managed;
    for (const auto& p : local->named_parameters(true)) {
      if (p.key().rfind("b.c.", 0) != 0) local_managed.push_back(p.value());
    }
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    const double max_norm = 0.05;
    for (int step = 0; step < 3; ++step) {
      const auto x = randn(100 + step, {8, 4}), y = randn(200 + step, {8, 3});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      average_over_ranks(c, ignored);
      // fsdp clips what it shards (C listed nowhere: every rank holds it whole); C is the user's.
      std::vector<torch::Tensor> c_grads_before;
      for (const auto& p : ignored) c_grads_before.push_back(p.grad().clone());
      const double norm = model.clip_grad_norm_(max_norm);
      for (size_t i = 0; i < ignored.size(); ++i) {
        expect_same_tensor(c, "C's gradient after clip_grad_norm_ (left alone)", ignored[i].grad(), c_grads_before[i], 0.0);
      }
      torch::nn::utils::clip_grad_norm_(ignored, max_norm);
      optim.step();

      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), y);
      local_loss.backward();
      const double local_norm = torch::nn::utils::clip_grad_norm_(local_managed, max_norm);
      torch::nn::utils::clip_grad_norm_(local_ignored, max_norm);
      local_optim.step();
      const std::string at = " at step " + std::to_string(step);
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
      c.expect_near("the norm clip_grad_norm_ returns (fsdp's parameters only)" + at, norm, local_norm, 1e-5 * local_norm);
      c.expect(norm > max_norm, "the gradients were clipped" + at);
    }
    // fsdp's parameters and the ignored ones both follow local training.
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

}  // namespace wrap_policies
}  // namespace conformance
