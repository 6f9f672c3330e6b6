// Units called several times, outputs left out of the loss, parameters shared or used outside
// their unit (PyTorch FSDP1 test_fsdp_misc, test_fsdp_multiple_forward, test_fsdp_fine_tune,
// test_fsdp_state_dict, test_fsdp_flatten_params; FSDP2 test_fully_shard_training,
// test_fully_shard_frozen, test_fully_shard_autograd; DeepSpeed test_zero_leaf_module,
// test_zero_context_return, test_zero_context):
//   a unit whose output the loss uses on some steps only;
//   a unit called twice in one forward with another unit in between;
//   a frozen and a trainable unit called many times, the trainable one also under NoGradGuard;
//   one module registered under two names; one parameter used by two units; a unit's parameter
//   used by code outside it; a unit returning its own parameter to the caller;
//   one inner unit run on its own after a full step;
//   each rank routing through a different expert of one unit.
#include <optional>

#include "conformance.h"

namespace conformance {
namespace shared_and_reused_units {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

void expect_nothing_gathered(Ctx& c, fsdp::FullyShardedDataParallelBase& model, const std::string& when) {
  const int64_t held = model.metrics().memory.unsharded_current;
  if (held != 0) c.fail(when + ": " + std::to_string(held) + " bytes of gathered parameters are still allocated");
}

int unit_index(Ctx& c, const fsdp::FullyShardedDataParallelBase& model, const std::string& name) {
  const auto units = model.units();
  for (size_t i = 0; i < units.size(); ++i) {
    if (units[i].name == name) return static_cast<int>(i);
  }
  c.fail("no unit named '" + name + "'");
  return -1;
}

// All-gathers of unit `u` in this step's forward (or backward).
int gathers_of(const fsdp::FullyShardedDataParallelBase& model, int u, bool backward) {
  int n = 0;
  for (const auto& s : model.timeline()) {
    if (s.kind == fsdp::SpanKind::ALL_GATHER && s.unit == u && s.backward_pass == backward) ++n;
  }
  return n;
}

bool reshards_after_forward(fsdp::ShardingStrategy s) {
  return s == fsdp::ShardingStrategy::FULL_SHARD || s == fsdp::ShardingStrategy::HYBRID_SHARD;
}

std::vector<std::pair<std::string, torch::Tensor>> named(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : m.named_parameters(true)) out.emplace_back(p.key(), p.value());
  return out;
}

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t d) {
    fc1 = register_module("fc1", torch::nn::Linear(d, 2 * d));
    fc2 = register_module("fc2", torch::nn::Linear(2 * d, d));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

// A stem in the root, then two towers a and b (units) on the same features.
struct TwoTowersImpl : torch::nn::Module {
  TwoTowersImpl() {
    stem = register_module("stem", torch::nn::Linear(6, 8));
    a = register_module("a", Mlp(8));
    b = register_module("b", Mlp(8));
  }
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x) {
    auto h = torch::relu(stem(x));
    return {a(h), b(h)};
  }
  torch::nn::Linear stem{nullptr};
  Mlp a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoTowers);

}  // namespace

CONFORMANCE_CASE(SharedAndReusedUnits, OutputOfOneUnitLeftOutOfTheLossAfterTwoSteps, 4,
                 "#17 #18 #257: FSDP1 test_fsdp_misc test_fsdp_module_no_compute_grad, "
                 "test_fsdp_not_all_outputs_used_in_loss; FSDP2 test_fully_shard_autograd test_unused_forward_output") {
  // forward returns (a(h), b(h)); the loss takes both for 2 steps, then a's only. The pair lives
  // on through the step, as a C++ loop's structured binding keeps it. b is gathered in forward and
  // never backwarded: nothing may stay gathered, b's gradient stays None, and the parameters are
  // those of local training.
  std::vector<Variant> variants = every_strategy(c);
  Variant hpz = strategy(c, "full_shard");
  hpz.options.reshard_after_forward_to = 2;
  hpz.name += " reshard_after_forward_to=2";
  variants.push_back(hpz);
  for_each(c, variants, [&](const Variant& v) {
    torch::manual_seed(21);
    TwoTowers mine;
    torch::manual_seed(21);
    TwoTowers local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<MlpImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    for (int step = 0; step < 6; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const bool both = step < 2;
      const auto x = randn(3000 + step, {8, 6});
      const auto ya = randn(3100 + step, {8, 8}), yb = randn(3200 + step, {8, 8});
      optim.zero_grad();
      auto [out_a, out_b] = model(my_rows(c, x));
      auto loss = torch::mse_loss(out_a, my_rows(c, ya));
      if (both) loss = loss + torch::mse_loss(out_b, my_rows(c, yb));
      loss.backward();
      expect_nothing_gathered(c, model, "after the backward" + at);
      if (!both) {
        for (const auto& p : mine->b->parameters()) c.expect(!p.grad().defined(), "b has a gradient" + at);
      }
      c.expect_ok("the optimizer step" + at + " with b's output alive", [&] { optim.step(); });
      local_optim.zero_grad();
      auto [local_a, local_b] = local->forward(x);
      auto local_loss = torch::mse_loss(local_a, ya);
      if (both) local_loss = local_loss + torch::mse_loss(local_b, yb);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

namespace {
// blockA, blockB, blockA again (FSDP2 test_multi_forward_module; FSDP1 test_multi_forward).
struct ThereAndBackImpl : torch::nn::Module {
  ThereAndBackImpl() {
    stem = register_module("stem", torch::nn::Linear(6, 8));
    block_a = register_module("block_a", Mlp(8));
    block_b = register_module("block_b", Mlp(8));
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(block_a(block_b(block_a(stem(x))))); }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  Mlp block_a{nullptr}, block_b{nullptr};
};
TORCH_MODULE(ThereAndBack);
}  // namespace

CONFORMANCE_CASE(SharedAndReusedUnits, UnitCalledTwiceWithAnotherUnitBetween, 4,
                 "#100 #214: FSDP1 test_fsdp_multiple_forward test_multi_forward; FSDP2 test_fully_shard_training "
                 "test_multi_forward_module") {
  // Every strategy (a strategy that reshards after forward gathers block_a twice in forward), each
  // backward prefetch mode, forward prefetch, and hpZ (FSDP2's reshard_after_forward=2).
  std::vector<Variant> variants = every_strategy(c);
  for (const auto mode : {fsdp::BackwardPrefetch::NONE, fsdp::BackwardPrefetch::BACKWARD_POST}) {
    Variant v = strategy(c, "full_shard");
    v.options.backward_prefetch = mode;
    v.name += " " + fsdp::to_string(mode);
    variants.push_back(v);
  }
  for (const char* s : {"full_shard", "shard_grad_op"}) {
    Variant v = strategy(c, s);
    v.options.forward_prefetch = true;
    v.name += " forward_prefetch";
    variants.push_back(v);
  }
  Variant hpz = strategy(c, "full_shard");
  hpz.options.reshard_after_forward_to = 2;
  hpz.name += " reshard_after_forward_to=2";
  variants.push_back(hpz);
  for_each(c, variants, [&](const Variant& v) {
    torch::manual_seed(22);
    ThereAndBack mine;
    torch::manual_seed(22);
    ThereAndBack local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<MlpImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    const int a = unit_index(c, model, "block_a");
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    for (int step = 0; step < 4; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const auto x = randn(3300 + step, {8, 6});
      const auto y = randint(3400 + step, 3, {8});
      model.reset_step();
      optim.zero_grad();
      auto loss = torch::cross_entropy_loss(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      expect_nothing_gathered(c, model, "after the backward" + at);
      if (c.world > 1 && v.options.strategy != fsdp::ShardingStrategy::NO_SHARD) {
        const int want = reshards_after_forward(v.options.strategy) ? 2 : 1;
        const int got = gathers_of(model, a, false);
        if (got != want && !v.options.forward_prefetch) {
          c.fail("block_a was gathered " + std::to_string(got) + " times in the forward" + at + ", not " +
                 std::to_string(want));
        }
        c.figure("block_a_gathers_in_forward", got);
        c.figure("block_a_gathers_in_backward", gathers_of(model, a, true));
      }
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::cross_entropy_loss(local->forward(x), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

namespace {
// FSDP1 test_hooks_multi_traversal's / FSDP2 test_multi_forward_mixed_requires_grad's module.
struct MultiTraversalImpl : torch::nn::Module {
  explicit MultiTraversalImpl(int rounds) : rounds(rounds) {
    layer_0 = register_module("layer_0", torch::nn::Linear(5, 5));
    layer_no_grad = register_module("layer_no_grad", torch::nn::Linear(5, 5));
    layer_with_grad = register_module("layer_with_grad", torch::nn::Linear(5, 5));
    for (auto& p : layer_no_grad->parameters()) p.requires_grad_(false);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = layer_0(x);
    for (int i = 0; i < rounds; ++i) {
      x = layer_no_grad(torch::relu(layer_with_grad(x)));
      // The same unit again, without grad, adding into x in place.
      torch::NoGradGuard no_grad;
      x.add_(torch::relu(layer_with_grad(x)));
    }
    return x;
  }
  int rounds;
  torch::nn::Linear layer_0{nullptr}, layer_no_grad{nullptr}, layer_with_grad{nullptr};
};
TORCH_MODULE(MultiTraversal);
}  // namespace

CONFORMANCE_CASE(SharedAndReusedUnits, FrozenAndTrainableUnitsCalledManyTimesAlsoUnderNoGrad, 4,
                 "#130 #230: FSDP1 test_fsdp_fine_tune test_hooks_multi_traversal; FSDP2 test_fully_shard_frozen "
                 "test_multi_forward_mixed_requires_grad") {
  // Each Linear its own unit, called 1 + 10 x (1 frozen, 2 trainable, 1 of them under NoGradGuard)
  // times in one forward; every strategy, and the peers' full_shard, shard_grad_op and no_shard
  // with forward prefetch and with an input that requires grad.
  std::vector<Variant> variants = every_strategy(c);
  for (const char* s : {"full_shard", "shard_grad_op", "no_shard"}) {
    for (const bool prefetch : {false, true}) {
      for (const bool input_grad : {false, true}) {
        if (!prefetch && !input_grad) continue;
        Variant v = strategy(c, s);
        v.options.forward_prefetch = prefetch;
        v.name += std::string(prefetch ? " forward_prefetch" : "") + (input_grad ? " input requires grad" : "");
        variants.push_back(v);
      }
    }
  }
  for_each(c, variants, [&](const Variant& v) {
    const bool input_grad = v.name.find("requires grad") != std::string::npos;
    torch::manual_seed(23);
    MultiTraversal mine(10);
    torch::manual_seed(23);
    MultiTraversal local(10);
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    const auto sgd = torch::optim::SGDOptions(0.01).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    for (int step = 0; step < 4; ++step) {
      const std::string at = " at step " + std::to_string(step);
      auto x = randn(3500 + step, {8, 5});
      if (input_grad) x.requires_grad_(true);
      auto loss = model(my_rows(c, x)).sum();
      loss.backward();
      expect_nothing_gathered(c, model, "after the backward" + at);
      optim.step();
      optim.zero_grad(step % 2 == 0);
      auto local_loss = local->forward(x).sum() / c.world;  // each rank's loss sums its rows
      local_loss.backward();
      local_optim.step();
      local_optim.zero_grad(step % 2 == 0);
      const double want = local_loss.item().toDouble();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), want, 1e-5 * std::max(1.0, std::abs(want)));
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

namespace {
// One Linear registered under two names (and applied twice), one parameter registered under two
// names (FSDP1 test_fsdp_state_dict test_shared_module_and_shared_parameter).
struct TwiceRegisteredImpl : torch::nn::Module {
  TwiceRegisteredImpl() {
    stem = register_module("stem", torch::nn::Linear(6, 8));
    torch::nn::Linear shared(8, 8);
    first = register_module("first", shared);
    second = register_module("second", shared);
    block = register_module("block", Mlp(8));
    gate = register_parameter("gate", torch::randn({8}));
    register_parameter("gate_alias", gate);
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(first(torch::relu(stem(x))));
    h = block(torch::tanh(second(h)) * gate);
    return head(h);
  }
  torch::nn::Linear stem{nullptr}, first{nullptr}, second{nullptr}, head{nullptr};
  Mlp block{nullptr};
  torch::Tensor gate;
};
TORCH_MODULE(TwiceRegistered);
}  // namespace

CONFORMANCE_CASE(SharedAndReusedUnits, ModuleAndParameterRegisteredUnderTwoNames, 4,
                 "#62: FSDP1 test_fsdp_state_dict test_shared_module_and_shared_parameter") {
  // Trains as local training does (the optimizer over fsdp's parameters() steps the shared ones
  // once), and full_state_dict gives both names of each shared tensor, equal.
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(24);
    TwiceRegistered mine;
    torch::manual_seed(24);
    TwiceRegistered local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<MlpImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    c.expect(model.parameters().size() == unique_parameters(*local).size(),
             "parameters() lists each shared tensor once");
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    for (int step = 0; step < 4; ++step) {
      const auto x = randn(3600 + step, {8, 6});
      const auto y = randint(3700 + step, 3, {8});
      optim.zero_grad();
      auto loss = torch::cross_entropy_loss(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::cross_entropy_loss(local->forward(x), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                    local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
    std::map<std::string, torch::Tensor> full;
    for (auto& [name, t] : fsdp::full_state_dict(model, /*rank0_only=*/false)) full[name] = t;
    for (const auto& [name, want] : state_of(*local)) {
      auto it = full.find(name);
      if (it == full.end()) {
        c.fail("full_state_dict has no " + name);
        continue;
      }
      expect_same_tensor(c, "full_state_dict's " + name, it->second, want, 1e-5);
    }
    for (const auto& [a, b] : {std::pair<std::string, std::string>{"first.weight", "second.weight"},
                               {"first.bias", "second.bias"}, {"gate", "gate_alias"}}) {
      if (full.count(a) && full.count(b)) c.expect(full.at(a).equal(full.at(b)), a + " and " + b + " differ");
    }
  });
}

namespace {
// An encoder and a decoder of 2 blocks each; decoder block i's feed-forward weight IS encoder
// block i's (FSDP1 test_fsdp_flatten_params *_with_shared_params: one parameter, two units).
struct FfnBlockImpl : torch::nn::Module {
  explicit FfnBlockImpl(torch::Tensor shared = {}) {
    w = register_parameter("w", shared.defined() ? shared : torch::randn({8, 8}) * 0.3);
    bias = register_parameter("bias", torch::zeros({8}));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::tanh(torch::linear(norm(x), w, bias)); }
  torch::Tensor w, bias;
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(FfnBlock);

struct EncoderDecoderImpl : torch::nn::Module {
  EncoderDecoderImpl() {
    stem = register_module("stem", torch::nn::Linear(6, 8));
    enc0 = register_module("enc0", FfnBlock());
    enc1 = register_module("enc1", FfnBlock());
    dec0 = register_module("dec0", FfnBlock(enc0->w));
    dec1 = register_module("dec1", FfnBlock(enc1->w));
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto memory = enc1(enc0(torch::relu(stem(x))));
    return head(dec1(dec0(memory)) + memory);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  FfnBlock enc0{nullptr}, enc1{nullptr}, dec0{nullptr}, dec1{nullptr};
};
TORCH_MODULE(EncoderDecoder);

// FSDP1 test_fsdp_flatten_params' / DeepSpeed's ExtLinear: the root's code uses linear1's weight
// after linear2 ran (an "external parameter": a unit's parameter used outside it).
struct ExtLinearImpl : torch::nn::Module {
  ExtLinearImpl() {
    linear1 = register_module("linear1", torch::nn::Linear(8, 8));
    linear2 = register_module("linear2", torch::nn::Linear(8, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto b = linear2(torch::tanh(linear1(x)));
    return torch::linear(torch::tanh(b), linear1->weight);
  }
  torch::nn::Linear linear1{nullptr}, linear2{nullptr};
};
TORCH_MODULE(ExtLinear);

template <typename Net>
void train_against_local(Ctx& c, const Variant& v, fsdp::WrapPolicy policy, uint64_t seed, int64_t in,
                         const std::function<void(fsdp::FullyShardedDataParallel<typename Net::Impl>&)>& check = {}) {
  torch::manual_seed(seed);
  Net mine;
  torch::manual_seed(seed);
  Net local;
  fsdp::Options o = v.options;
  o.auto_wrap_policy = std::move(policy);
  fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
  if (check) check(model);
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD optim(model.parameters(), sgd);
  torch::optim::SGD local_optim(unique_parameters(*local), sgd);
  for (int step = 0; step < 5; ++step) {
    const std::string at = " at step " + std::to_string(step);
    const auto x = randn(seed * 100 + step, {8, in});
    const auto y = randint(seed * 100 + 50 + step, 3, {8});
    optim.zero_grad();
    auto out = model(my_rows(c, x));
    auto loss = torch::cross_entropy_loss(out.narrow(1, 0, 3), my_rows(c, y));
    loss.backward();
    expect_nothing_gathered(c, model, "after the backward" + at);
    optim.step();
    local_optim.zero_grad();
    auto local_loss = torch::cross_entropy_loss(local->forward(x).narrow(1, 0, 3), y);
    local_loss.backward();
    local_optim.step();
    c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
  }
  expect_same_model(c, model, *mine, *local, 1e-5);
}
}  // namespace

CONFORMANCE_CASE(SharedAndReusedUnits, ParameterSharedByAnEncoderAndADecoderUnit, 4,
                 "#193: FSDP1 test_fsdp_flatten_params test_numel_with_shared_params, test_output_with_shared_params, "
                 "test_pnorm_after_step_with_shared_params") {
  // Each block its own unit: the shared weight belongs to one of them and is gathered with it
  // wherever it is used; dec0's linear reads its own bias and enc0's weight in one operator, so
  // neither unit may be freed for the other before that operator ran. units() counts it once.
  // Both ways of knowing when a unit runs.
  std::vector<Variant> variants = every_strategy(c);
  for (const char* s : {"full_shard", "hybrid_shard"}) {
    Variant v = strategy(c, s);
    v.options.unit_detection = fsdp::UnitDetection::RECORD_FUNCTION;
    v.name += " record_function";
    variants.push_back(v);
  }
  for_each(c, variants, [&](const Variant& v) {
    int64_t want = 0;
    {
      torch::manual_seed(25);
      EncoderDecoder whole;
      for (const auto& p : unique_parameters(*whole)) want += p.numel();
    }
    train_against_local<EncoderDecoder>(c, v, fsdp::module_type_policy<FfnBlockImpl>(), 25, 6, [&](auto& model) {
      int64_t numel = 0;
      for (const auto& u : model.units()) numel += u.numel;
      c.expect(numel == want, "the units hold " + std::to_string(numel) + " elements, the model " +
                                  std::to_string(want) + " (the shared weight counted once)");
    });
  });
}

CONFORMANCE_CASE(SharedAndReusedUnits, UnitParameterUsedByTheRootAfterTheUnitRan, 4,
                 "#317: DeepSpeed test_zero_context test_ext_param_getattr") {
  for_each(c, every_strategy(c, /*bf16=*/false), [&](const Variant& v) {
    train_against_local<ExtLinear>(c, v, fsdp::module_type_policy<torch::nn::LinearImpl>(), 26, 8);
  });
}

namespace {
// DeepSpeed test_zero_context_return's models: a Linear whose forward returns its output and its
// own bias; an attention-like unit around it handing that bias on; the root adding it after both
// units finished. As a pair, and inside a struct ("returnobj"), and as a view of the bias.
struct OutAndBias {
  torch::Tensor out, bias;
};
enum class Hand { PARAMETER, VIEW };
struct DanglingBiasImpl : torch::nn::LinearImpl {
  explicit DanglingBiasImpl(Hand hand) : torch::nn::LinearImpl(8, 8), hand(hand) {}
  OutAndBias forward(const torch::Tensor& x) {
    return {torch::nn::LinearImpl::forward(x), hand == Hand::PARAMETER ? bias : bias.view({1, 8})};
  }
  Hand hand;
};
TORCH_MODULE(DanglingBias);

struct DanglingAttentionImpl : torch::nn::LinearImpl {
  explicit DanglingAttentionImpl(Hand hand) : torch::nn::LinearImpl(8, 8) {
    d_linear = register_module("d_linear", DanglingBias(hand));
  }
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x) {
    auto obj = d_linear(torch::nn::LinearImpl::forward(x));
    return {obj.out, obj.bias};
  }
  DanglingBias d_linear{nullptr};
};
TORCH_MODULE(DanglingAttention);

struct ModelContainerImpl : torch::nn::Module {
  explicit ModelContainerImpl(Hand hand = Hand::PARAMETER) {
    linear1 = register_module("linear1", torch::nn::Linear(8, 8));
    dangler = register_module("dangler", DanglingAttention(hand));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto [act2, bias] = dangler(torch::tanh(linear1(x)));
    return torch::tanh(act2 + bias * 2);
  }
  torch::nn::Linear linear1{nullptr};
  DanglingAttention dangler{nullptr};
};
TORCH_MODULE(ModelContainer);
}  // namespace

CONFORMANCE_CASE(SharedAndReusedUnits, UnitReturnsItsOwnBiasToTheCaller, 4,
                 "#308: DeepSpeed test_zero_context_return test_ext_param_return, test_ext_param_returnobj, "
                 "test_stage_3_output_type") {
  // linear1, dangler and dangler.d_linear are units: d_linear's bias reaches the root after
  // d_linear (and dangler) resharded; it must hold the bias's values, and its gradient from the
  // root's use must reach d_linear's shard. Returned as the parameter itself (every strategy, fp32
  // and bf16), and as a view made inside the unit (every strategy).
  std::vector<Variant> variants;
  for (const Hand hand : {Hand::PARAMETER, Hand::VIEW}) {
    for (auto v : every_strategy(c, /*bf16=*/hand == Hand::PARAMETER)) {
      v.name += hand == Hand::PARAMETER ? " the bias itself" : " a view of the bias";
      variants.push_back(v);
    }
  }
  for_each(c, variants, [&](const Variant& v) {
    const Hand hand = v.name.find("view") != std::string::npos ? Hand::VIEW : Hand::PARAMETER;
    torch::manual_seed(27);
    ModelContainer mine(hand);
    torch::manual_seed(27);
    ModelContainer local(hand);
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    c.expect(model.units().size() == 3, "linear1, dangler and dangler.d_linear are the units");
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    const double tol = v.mixed_precision() ? 2e-2 : 1e-5;  // bf16 keeps 8 bits
    for (int step = 0; step < 5; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const auto x = randn(3800 + step, {8, 8});
      const auto y = randn(3900 + step, {8, 8});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
      loss.backward();
      expect_nothing_gathered(c, model, "after the backward" + at);
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), tol);
    }
    expect_same_model(c, model, *mine, *local, tol);
  });
}

CONFORMANCE_CASE(SharedAndReusedUnits, OneInnerUnitRunOnItsOwnAfterAFullStep, 4,
                 "#213: FSDP2 test_fully_shard_training test_non_root_forward_backward") {
  // A full step, then a forward and backward through blocks.0 alone (inside forward_with), a step;
  // the units left out keep their values, get no gradient and stay resharded.
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(28);
    auto make = [] {
      return torch::nn::Sequential(torch::nn::Linear(6, 8), Mlp(8), Mlp(8), torch::nn::Linear(8, 3));
    };
    auto mine = make();
    torch::manual_seed(28);
    auto local = make();
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<MlpImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(local->parameters(), sgd);
    for (int step = 0; step < 4; ++step) {
      const std::string at = " at step " + std::to_string(step);
      optim.zero_grad();
      local_optim.zero_grad();
      torch::Tensor loss, local_loss;
      if (step % 2 == 0) {
        const auto x = randn(4000 + step, {8, 6});
        const auto y = randint(4100 + step, 3, {8});
        loss = torch::cross_entropy_loss(model(my_rows(c, x)), my_rows(c, y));
        local_loss = torch::cross_entropy_loss(local->forward(x), y);
      } else {
        const auto h = randn(4000 + step, {8, 8});
        auto block = mine[1]->as<MlpImpl>();
        loss = model.forward_with([&] { return block->forward(my_rows(c, h)); }).pow(2).mean();
        local_loss = local[1]->as<MlpImpl>()->forward(h).pow(2).mean();
      }
      loss.backward();
      expect_nothing_gathered(c, model, "after the backward" + at);
      if (step % 2 == 1) {
        for (const auto& [name, p] : model.named_parameters()) {
          if (name.rfind("1.", 0) != 0 && p.grad().defined()) c.fail(name + " has a gradient" + at);
        }
      }
      optim.step();
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine.ptr(), *local.ptr(), 1e-5);
  });
}

namespace {
// One unit holding 4 experts; the caller says which expert runs (DeepSpeed test_zero_leaf_module
// test_choose_module_by_rank).
struct ExpertsImpl : torch::nn::Module {
  ExpertsImpl() {
    for (int e = 0; e < 4; ++e) experts->push_back(torch::nn::Linear(8, 8));
    register_module("experts", experts);
  }
  torch::Tensor forward(const torch::Tensor& x, int64_t expert) {
    return torch::tanh(experts[static_cast<size_t>(expert)]->as<torch::nn::LinearImpl>()->forward(x));
  }
  torch::nn::ModuleList experts;
};
TORCH_MODULE(Experts);

struct RoutedImpl : torch::nn::Module {
  RoutedImpl() {
    stem = register_module("stem", torch::nn::Linear(6, 8));
    moe = register_module("moe", Experts());
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x, int64_t expert) { return head(moe(torch::relu(stem(x)), expert)); }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  Experts moe{nullptr};
};
TORCH_MODULE(Routed);
}  // namespace

CONFORMANCE_CASE(SharedAndReusedUnits, EachRankRoutesThroughADifferentExpertOfOneUnit, 4,
                 "#303: DeepSpeed test_zero_leaf_module test_choose_module_by_rank") {
  // Rank r's rows go through expert r (every rank runs the same units in the same order); local
  // training sends each rank's rows through that rank's expert. Experts a rank did not run get
  // zero from it in the reduction.
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(29);
    Routed mine;
    torch::manual_seed(29);
    Routed local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<ExpertsImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(local->parameters(), sgd);
    for (int step = 0; step < 4; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const auto x = randn(4200 + step, {8, 6});
      const auto y = randint(4300 + step, 3, {8});
      optim.zero_grad();
      auto loss = torch::cross_entropy_loss(model(my_rows(c, x), static_cast<int64_t>(c.rank)), my_rows(c, y));
      loss.backward();
      expect_nothing_gathered(c, model, "after the backward" + at);
      optim.step();
      local_optim.zero_grad();
      const int64_t per = x.size(0) / c.world;
      torch::Tensor local_loss;
      for (int r = 0; r < c.world; ++r) {
        auto l = torch::cross_entropy_loss(local->forward(x.narrow(0, r * per, per), r), y.narrow(0, r * per, per));
        local_loss = local_loss.defined() ? local_loss + l : l;
      }
      local_loss = local_loss / c.world;
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

}  // namespace shared_and_reused_units
}  // namespace conformance
