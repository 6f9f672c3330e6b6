// Frozen and trainable parameters (PyTorch FSDP1 test_fsdp_use_orig_params, test_fsdp_fine_tune,
// test_wrap; FSDP2 test_fully_shard_frozen; DeepSpeed test_zero_autocast_mixed_dtype):
//   every bias frozen while the weights of the same unit train, and BitFit (only biases train),
//   frozen before or after wrapping, with activation checkpointing and hpZ;
//   LoRA adapters training beside frozen base weights in one unit;
//   a bf16 base weight and an fp32 adapter in one unit;
//   frozen units whose input needs no gradient (no autograd node ever reaches them), resharded
//   after every backward, and unfrozen later;
//   a frozen unit against the same unit trainable but left out of the optimizer.
#include "conformance.h"
#include "fsdp/activation_checkpoint.h"

namespace conformance {
namespace frozen_parameters {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

bool is_bias(const std::string& name) { return name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0; }

// FSDP2's test MLP (in_proj, relu, out_proj) with a residual, called through checkpointable() so
// that activation checkpointing can be switched on by policy.
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t d) {
    in_proj = register_module("in_proj", torch::nn::Linear(d, 2 * d));
    out_proj = register_module("out_proj", torch::nn::Linear(2 * d, d));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + out_proj(torch::relu(in_proj(x))); }
  torch::nn::Linear in_proj{nullptr}, out_proj{nullptr};
};
TORCH_MODULE(Mlp);

struct MlpNetImpl : torch::nn::Module {
  MlpNetImpl() {
    stem = register_module("stem", torch::nn::Linear(8, 16));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(Mlp(16));
    head = register_module("head", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = stem(x);
    for (const auto& b : *blocks) {
      auto block = std::dynamic_pointer_cast<MlpImpl>(b);
      h = fsdp::checkpointable(*block, [block](const torch::Tensor& t) { return block->forward(t); }, h);
    }
    return head(h);
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(MlpNet);

// Bytes of unsharded parameters still allocated: 0 after every backward, whatever was frozen.
void expect_nothing_gathered(Ctx& c, fsdp::FullyShardedDataParallelBase& model, const std::string& when) {
  const int64_t held = model.metrics().memory.unsharded_current;
  if (held != 0) c.fail(when + ": " + std::to_string(held) + " bytes of gathered parameters are still allocated");
}

// Every parameter's gradient is undefined where it is frozen.
void expect_frozen_grads_undefined(Ctx& c, const std::vector<std::pair<std::string, torch::Tensor>>& params,
                                   const std::string& when) {
  for (const auto& [name, p] : params) {
    if (!p.requires_grad() && p.grad().defined()) c.fail(when + ": frozen " + name + " has a gradient");
  }
}

// Frozen parameters are bitwise what they were built with.
void expect_frozen_unchanged(Ctx& c, fsdp::FullyShardedDataParallelBase& wrapped, torch::nn::Module& mine,
                             const std::map<std::string, torch::Tensor>& initial, const std::set<std::string>& frozen) {
  const auto now = whole_state(wrapped, mine, /*buffers=*/false);
  for (const auto& name : frozen) {
    auto it = now.find(name);
    if (it == now.end() || !it->second.equal(initial.at(name))) c.fail("frozen " + name + " changed in training");
  }
}

enum class Freeze { BIASES, ALL_BUT_BIASES };
enum class When { BEFORE_WRAPPING, AFTER_WRAPPING };

struct FreezeCase {
  Variant v;
  Freeze what;
  When when;
  bool checkpointing = false;
};

// Trains MlpNet with part of every unit frozen, against local training with the same parameters
// frozen. SGD with momentum, zero_grad to None on even steps and to zeros on odd ones (FSDP2's
// test); bf16 variants within 2e-2 (bf16 keeps 8 bits: each of the ~6 roundings on the way to a
// loss of about 1.5 is off by up to 0.4 %), fp32 within 1e-5.
void train_partly_frozen(Ctx& c, const FreezeCase& fc) {
  const auto freezes = [&](const std::string& name) { return is_bias(name) == (fc.what == Freeze::BIASES); };
  torch::manual_seed(3);
  MlpNet mine;
  torch::manual_seed(3);
  MlpNet local;
  std::set<std::string> frozen;
  for (const auto& p : local->named_parameters(true)) {
    if (freezes(p.key())) {
      frozen.insert(p.key());
      p.value().requires_grad_(false);
    }
  }
  if (fc.when == When::BEFORE_WRAPPING) {
    for (const auto& p : mine->named_parameters(true)) {
      if (freezes(p.key())) p.value().requires_grad_(false);
    }
  }
  if (fc.checkpointing) {
    fsdp::apply_activation_checkpointing(*mine, fsdp::checkpoint_modules_of_type<MlpImpl>());
    fsdp::apply_activation_checkpointing(*local, fsdp::checkpoint_modules_of_type<MlpImpl>());
  }
  const auto initial = state_of(*mine, false);
  fsdp::Options o = fc.v.options;
  o.auto_wrap_policy = fsdp::module_type_policy<MlpImpl>();
  fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
  if (fc.when == When::AFTER_WRAPPING) {
    for (auto& [name, p] : model.named_parameters()) {
      if (freezes(name)) p.requires_grad_(false);
    }
  }
  for (const auto& [name, p] : model.named_parameters()) {
    c.expect(p.requires_grad() == !frozen.count(name), name + ": requires_grad is not what the user set");
  }
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD optim(model.parameters(), sgd);
  torch::optim::SGD local_optim(unique_parameters(*local), sgd);
  const double tol = fc.v.mixed_precision() ? 2e-2 : 1e-5;
  for (int step = 0; step < 6; ++step) {
    const std::string at = " at step " + std::to_string(step);
    const auto x = randn(800 + step, {8, 8});
    const auto y = randint(900 + step, 4, {8});
    model.reset_step();
    optim.zero_grad(step % 2 == 0);
    auto loss = torch::cross_entropy_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
    loss.backward();
    expect_nothing_gathered(c, model, "after the backward" + at);
    expect_frozen_grads_undefined(c, model.named_parameters(), "after the backward" + at);
    c.figure("reduce_scatter_bytes_per_step", static_cast<double>(model.metrics().comm.reduce_scatter));
    optim.step();
    local_optim.zero_grad(step % 2 == 0);
    auto local_loss = torch::cross_entropy_loss(local->forward(x), y);
    local_loss.backward();
    local_optim.step();
    c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), tol);
  }
  expect_frozen_unchanged(c, model, *mine, initial, frozen);
  expect_same_model(c, model, *mine, *local, tol);
}

}  // namespace

CONFORMANCE_CASE(Frozen, BiasesFrozenWhileWeightsOfTheSameUnitTrain, 4,
                 "#117: FSDP1 test_fsdp_use_orig_params test_diff_trainability / test_non_uniform_requires_grad") {
  // The peer freezes the biases of the wrapped model (after wrapping); every strategy, and bf16.
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    train_partly_frozen(c, {v, Freeze::BIASES, When::AFTER_WRAPPING});
  });
}

CONFORMANCE_CASE(Frozen, OnlyBiasesTrainAsInBitFit, 4,
                 "#228: FSDP2 test_fully_shard_frozen test_train_mixed_requires_grad_per_group") {
  // Frozen before and after wrapping, every strategy; with activation checkpointing, and with
  // hpZ (FSDP2's reshard_after_forward=2).
  std::vector<FreezeCase> cases;
  for (const auto& v : every_strategy(c)) {
    cases.push_back({v, Freeze::ALL_BUT_BIASES, When::BEFORE_WRAPPING});
    cases.push_back({v, Freeze::ALL_BUT_BIASES, When::AFTER_WRAPPING});
  }
  for (const char* s : {"full_shard", "shard_grad_op", "hybrid_shard"}) {
    FreezeCase fc{strategy(c, s), Freeze::ALL_BUT_BIASES, When::AFTER_WRAPPING, /*checkpointing=*/true};
    fc.v.name += " checkpointed";
    cases.push_back(fc);
  }
  FreezeCase hpz{strategy(c, "full_shard"), Freeze::ALL_BUT_BIASES, When::BEFORE_WRAPPING};
  hpz.v.options.reshard_after_forward_to = 2;
  hpz.v.name += " reshard_after_forward_to=2";
  cases.push_back(hpz);
  std::vector<Variant> variants;
  for (auto& fc : cases) {
    if (fc.when == When::AFTER_WRAPPING) fc.v.name += " frozen after wrapping";
    variants.push_back(fc.v);
  }
  size_t i = 0;
  for_each(c, variants, [&](const Variant&) { train_partly_frozen(c, cases[i++]); });
}

namespace {

// A LoRA linear layer: the base layer frozen, a rank-r update B·A beside it (B starts at zero).
struct LoraLinearImpl : torch::nn::Module {
  LoraLinearImpl(int64_t in, int64_t out, int64_t r) {
    base = register_module("base", torch::nn::Linear(in, out));
    lora_a = register_module("lora_a", torch::nn::Linear(torch::nn::LinearOptions(in, r).bias(false)));
    lora_b = register_module("lora_b", torch::nn::Linear(torch::nn::LinearOptions(r, out).bias(false)));
    torch::NoGradGuard no_grad;
    lora_b->weight.zero_();
    for (auto& p : base->parameters()) p.requires_grad_(false);
  }
  torch::Tensor forward(const torch::Tensor& x) { return base(x) + lora_b(lora_a(x)) * 2.0; }
  torch::nn::Linear base{nullptr}, lora_a{nullptr}, lora_b{nullptr};
};
TORCH_MODULE(LoraLinear);

struct LoraBlockImpl : torch::nn::Module {
  LoraBlockImpl() {
    fc1 = register_module("fc1", LoraLinear(16, 32, 4));
    fc2 = register_module("fc2", LoraLinear(32, 16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(x))); }
  LoraLinear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(LoraBlock);

// A frozen stem, LoRA blocks, a trainable head: fine-tuning a classifier.
struct LoraNetImpl : torch::nn::Module {
  LoraNetImpl() {
    stem = register_module("stem", torch::nn::Linear(8, 16));
    for (auto& p : stem->parameters()) p.requires_grad_(false);
    b0 = register_module("b0", LoraBlock());
    b1 = register_module("b1", LoraBlock());
    head = register_module("head", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(b1(b0(stem(x)))); }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  LoraBlock b0{nullptr}, b1{nullptr};
};
TORCH_MODULE(LoraNet);

std::vector<torch::Tensor> trainable(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

}  // namespace

CONFORMANCE_CASE(Frozen, LoRAAdaptersTrainBesideFrozenBaseWeightsInOneUnit, 4,
                 "#188: FSDP1 test_wrap TestWrapUtils.test_validate_frozen_params (LoRA: frozen base and trainable "
                 "lora_A/lora_B in one unit)") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(4);
    LoraNet mine;
    torch::manual_seed(4);
    LoraNet local;
    std::set<std::string> frozen;
    for (const auto& p : local->named_parameters(true)) {
      if (!p.value().requires_grad()) frozen.insert(p.key());
    }
    c.expect(frozen.size() == 10, "the stem's and the 4 base layers' weights and biases are frozen");
    const auto initial = state_of(*mine, false);
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<LoraBlockImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    // The optimizer over the trainable parameters only, as LoRA fine-tuning builds it.
    const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
    torch::optim::SGD optim(trainable(model.parameters()), sgd);
    torch::optim::SGD local_optim(trainable(unique_parameters(*local)), sgd);
    const double tol = v.mixed_precision() ? 2e-2 : 1e-5;  // as in train_partly_frozen
    for (int step = 0; step < 5; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const auto x = randn(1000 + step, {8, 8});
      const auto y = randint(1100 + step, 4, {8});
      model.reset_step();
      optim.zero_grad();
      auto loss = torch::cross_entropy_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
      loss.backward();
      expect_nothing_gathered(c, model, "after the backward" + at);
      expect_frozen_grads_undefined(c, model.named_parameters(), "after the backward" + at);
      c.figure("reduce_scatter_bytes_per_step", static_cast<double>(model.metrics().comm.reduce_scatter));
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::cross_entropy_loss(local->forward(x), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), tol);
    }
    expect_frozen_unchanged(c, model, *mine, initial, frozen);
    expect_same_model(c, model, *mine, *local, tol);
  });
}

namespace {

// DeepSpeed's MixedDtypeAdapterModule: a frozen bf16 base weight and an fp32 low-rank adapter.
struct MixedDtypeAdapterImpl : torch::nn::Module {
  MixedDtypeAdapterImpl() {
    base_weight = register_parameter("base_weight", (torch::randn({16, 16}) * 0.25).to(torch::kBFloat16), false);
    adapter = register_module("adapter", torch::nn::Sequential(torch::nn::Linear(torch::nn::LinearOptions(16, 4).bias(false)),
                                                               torch::nn::Linear(torch::nn::LinearOptions(4, 16).bias(false))));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::linear(x.to(torch::kBFloat16), base_weight).to(torch::kFloat) + adapter->forward(x) / 4.0;
  }
  torch::Tensor base_weight;
  torch::nn::Sequential adapter{nullptr};
};
TORCH_MODULE(MixedDtypeAdapter);

struct MixedDtypeNetImpl : torch::nn::Module {
  MixedDtypeNetImpl() {
    b0 = register_module("b0", MixedDtypeAdapter());
    b1 = register_module("b1", MixedDtypeAdapter());
  }
  torch::Tensor forward(const torch::Tensor& x) { return b1(torch::tanh(b0(x))); }
  MixedDtypeAdapter b0{nullptr}, b1{nullptr};
};
TORCH_MODULE(MixedDtypeNet);

}  // namespace

CONFORMANCE_CASE(Frozen, Bf16BaseWeightBesideAnFp32AdapterInOneUnit, 4,
                 "#313: DeepSpeed test_zero_autocast_mixed_dtype test_fp32_adapter_with_bf16_base_params") {
  // One unit holding both dtypes is refused by name (a FlatParameter has one dtype), with what to
  // do: give the adapter a unit of its own. Done so, it trains as local training does, each
  // parameter keeping its dtype.
  for_each(c, every_strategy(c), [&](const Variant& v) {
    {
      torch::manual_seed(5);
      MixedDtypeNet mine;
      fsdp::Options o = v.options;
      o.auto_wrap_policy = fsdp::module_type_policy<MixedDtypeAdapterImpl>();
      c.expect_refused("a unit holding a bf16 base weight and an fp32 adapter",
                       [&] { fsdp::FullyShardedDataParallel model(mine, c.mesh, o); },
                       {"mixes dtypes", "b0.base_weight", "BFloat16", "float", "different units"});
    }
    torch::manual_seed(5);
    MixedDtypeNet mine;
    torch::manual_seed(5);
    MixedDtypeNet local;
    const auto initial = state_of(*mine, false);
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<MixedDtypeAdapterImpl, torch::nn::SequentialImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    bool adapter_unit = false;
    for (const auto& u : model.units()) adapter_unit = adapter_unit || u.name == "b0.adapter";
    c.expect(adapter_unit, "b0.adapter is a unit of its own");
    for (const auto& [name, p] : model.named_parameters()) {
      const auto want = name.find("base_weight") != std::string::npos ? torch::kBFloat16 : torch::kFloat;
      c.expect(p.scalar_type() == want, name + " lost its dtype in wrapping");
    }
    torch::optim::AdamW optim(trainable(model.parameters()), torch::optim::AdamWOptions(0.01));
    torch::optim::AdamW local_optim(trainable(unique_parameters(*local)), torch::optim::AdamWOptions(0.01));
    for (int step = 0; step < 4; ++step) {
      const auto x = randn(1200 + step, {8, 16});
      const auto target = randn(1300 + step, {8, 16});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, target));
      loss.backward();
      expect_nothing_gathered(c, model, "after the backward at step " + std::to_string(step));
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), target);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                    local_loss.item().toDouble(), 1e-5);
    }
    expect_frozen_unchanged(c, model, *mine, initial, {"b0.base_weight", "b1.base_weight"});
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

namespace {

// FSDP1 test_fsdp_fine_tune's model: 6 Linear(5, 5) layers with ReLUs, every other one (0, 2, 4)
// frozen, each Linear its own unit.
torch::nn::Sequential make_six_linears() {
  torch::nn::Sequential seq;
  for (int i = 0; i < 6; ++i) {
    seq->push_back(torch::nn::Linear(5, 5));
    seq->push_back(torch::nn::ReLU());
  }
  return seq;
}
void set_even_linears_requires_grad(const std::vector<std::pair<std::string, torch::Tensor>>& params, bool on) {
  for (const auto& [name, p] : params) {
    const int layer = std::stoi(name.substr(0, name.find('.'))) / 2;
    if (layer % 2 == 0) p.requires_grad_(on);
  }
}
std::vector<std::pair<std::string, torch::Tensor>> named(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : m.named_parameters(true)) out.emplace_back(p.key(), p.value());
  return out;
}

}  // namespace

CONFORMANCE_CASE(Frozen, FrozenUnitsAreReshardedAfterEveryBackwardThenUnfrozen, 4,
                 "#129: FSDP1 test_fsdp_fine_tune test_backward_reshard_hooks; FSDP2 test_fully_shard_frozen "
                 "test_train_mixed_requires_grad_across_groups") {
  // The first unit is frozen: with an input that needs no gradient no autograd node ever reaches
  // it, so only the end of backward can free it. Step 1 is a forward under NoGradGuard; the last
  // step unfreezes everything.
  std::vector<Variant> variants;
  for (const bool input_grad : {false, true}) {
    for (auto v : every_strategy(c)) {
      v.name += input_grad ? " input requires grad" : " input without grad";
      variants.push_back(v);
    }
  }
  for_each(c, variants, [&](const Variant& v) {
    const bool input_grad = v.name.find("requires grad") != std::string::npos;
    torch::manual_seed(6);
    auto mine = make_six_linears();
    torch::manual_seed(6);
    auto local = make_six_linears();
    set_even_linears_requires_grad(named(*mine.ptr()), false);
    set_even_linears_requires_grad(named(*local.ptr()), false);
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    c.expect(model.units().size() == 6, "each Linear is a unit");
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    const int steps = 4;
    for (int step = 0; step < steps; ++step) {
      const std::string at = " at step " + std::to_string(step);
      if (step == steps - 1) {
        set_even_linears_requires_grad(model.named_parameters(), true);
        set_even_linears_requires_grad(named(*local.ptr()), true);
      }
      auto x = randn(1400 + step, {8, 5});
      if (input_grad) x.requires_grad_(true);
      if (step == 1) {
        torch::NoGradGuard no_grad;
        auto out = model(my_rows(c, x));
        c.expect_near("no_grad forward" + at, global_mean(c, out.sum().item().toDouble()),
                      local->forward(x).sum().item().toDouble() / c.world, 1e-5);
        expect_nothing_gathered(c, model, "after the no_grad forward" + at);
        continue;
      }
      optim.zero_grad();
      auto out = model(my_rows(c, x));
      auto loss = out.sum();
      loss.backward();
      expect_nothing_gathered(c, model, "after the backward" + at);
      expect_frozen_grads_undefined(c, model.named_parameters(), "after the backward" + at);
      optim.step();
      local_optim.zero_grad();
      // Each rank's loss is the sum over its rows: local training's loss is their sum over ranks,
      // and its gradients W times the mean over ranks that fsdp reduces; the mean of the per-rank
      // losses is the local sum / W.
      auto local_loss = local->forward(x).sum() / c.world;
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
    }
    for (const auto& [name, p] : model.named_parameters()) c.expect(p.requires_grad(), name + " is still frozen");
    expect_same_model(c, model, *mine.ptr(), *local.ptr(), 1e-5);
  });
}

namespace {

// FSDP1's ModelUnusedInput: three Linear units fed the same input that needs no gradient; the
// middle one frozen (or not), the outputs concatenated.
struct LinearUnusedInputImpl : torch::nn::LinearImpl {
  LinearUnusedInputImpl() : torch::nn::LinearImpl(4, 4) {}
  torch::Tensor forward(const torch::Tensor& frozen_input, const torch::Tensor& /*learnable_input*/) {
    return torch::nn::LinearImpl::forward(frozen_input);
  }
};
TORCH_MODULE(LinearUnusedInput);

struct ModelUnusedInputImpl : torch::nn::Module {
  explicit ModelUnusedInputImpl(bool freeze) {
    layer0 = register_module("layer0", LinearUnusedInput());
    layer1_frozen = register_module("layer1_frozen", LinearUnusedInput());
    if (freeze) {
      for (auto& p : layer1_frozen->parameters()) p.requires_grad_(false);
    }
    layer2 = register_module("layer2", LinearUnusedInput());
  }
  torch::Tensor forward(const torch::Tensor& frozen_input, const torch::Tensor& learnable_input) {
    auto x = layer0(frozen_input, learnable_input);
    auto y = layer1_frozen(frozen_input, learnable_input);
    auto z = layer2(frozen_input, learnable_input);
    return torch::cat({x, y, z, learnable_input});
  }
  LinearUnusedInput layer0{nullptr}, layer1_frozen{nullptr}, layer2{nullptr};
};
TORCH_MODULE(ModelUnusedInput);

}  // namespace

CONFORMANCE_CASE(Frozen, FrozenUnitFedAnInputWithoutGradTrainsLikeOneLeftOutOfTheOptimizer, 4,
                 "#132: FSDP1 test_fsdp_fine_tune test_parity_with_non_frozen_fsdp") {
  // The peer compares two wrapped models with each other (exactly, under mixed precision too):
  // layer1 frozen, and layer1 trainable but not in the optimizer. Here both also against local
  // training; the peer's full_shard and shard_grad_op with both backward prefetch modes, fp32 and
  // bf16, and the other strategies once.
  std::vector<Variant> variants;
  for (const auto& base : every_strategy(c, /*bf16=*/true)) {
    const bool peers = base.options.strategy == fsdp::ShardingStrategy::FULL_SHARD ||
                       base.options.strategy == fsdp::ShardingStrategy::SHARD_GRAD_OP;
    if (!peers && base.mixed_precision()) continue;
    for (const auto prefetch : {fsdp::BackwardPrefetch::BACKWARD_PRE, fsdp::BackwardPrefetch::BACKWARD_POST}) {
      if (!peers && prefetch != fsdp::BackwardPrefetch::BACKWARD_PRE) continue;
      Variant v = base;
      v.options.backward_prefetch = prefetch;
      v.name += " " + fsdp::to_string(prefetch);
      variants.push_back(v);
    }
  }
  for_each(c, variants, [&](const Variant& v) {
    torch::manual_seed(7);
    ModelUnusedInput frozen(true);
    torch::manual_seed(7);
    ModelUnusedInput reference(false);
    torch::manual_seed(7);
    ModelUnusedInput local(false);
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<LinearUnusedInputImpl>();
    fsdp::FullyShardedDataParallel model(frozen, c.mesh, o);
    fsdp::FullyShardedDataParallel ref_model(reference, c.mesh, o);
    const auto not_layer1 = [](const std::vector<std::pair<std::string, torch::Tensor>>& params) {
      std::vector<torch::Tensor> out;
      for (const auto& [name, p] : params) {
        if (name.rfind("layer1_frozen.", 0) != 0) out.push_back(p);
      }
      return out;
    };
    torch::optim::Adam optim(model.parameters(), torch::optim::AdamOptions(1e-2));
    torch::optim::Adam ref_optim(not_layer1(ref_model.named_parameters()), torch::optim::AdamOptions(1e-2));
    torch::optim::Adam local_optim(not_layer1(named(*local)), torch::optim::AdamOptions(1e-2));
    // Against local training: fp32 within 1e-5 (these inputs give every element a gradient far
    // from zero, where Adam's sign-like steps do not amplify rounding); bf16 losses within 2 % of
    // their size (sums of 96 products rounded to 8 bits), and bf16 parameters only against the
    // reference run (Adam moves a parameter by about lr whatever the size of its gradient, so
    // bf16 rounding of small gradients is not bounded in the parameters).
    const bool bf16 = v.mixed_precision();
    for (int step = 0; step < 6; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const auto frozen_input = randn(1500 + step, {8, 4});
      auto run = [&](auto& m, torch::optim::Adam& opt) {
        auto loss = m(my_rows(c, frozen_input), my_rows(c, frozen_input)).sum();
        loss.backward();
        expect_nothing_gathered(c, m, "after the backward" + at);
        opt.step();
        opt.zero_grad();
        return global_mean(c, loss.item().toDouble());
      };
      const double loss = run(model, optim), ref_loss = run(ref_model, ref_optim);
      auto local_loss = local->forward(frozen_input, frozen_input).sum() / c.world;
      local_loss.backward();
      local_optim.step();
      local_optim.zero_grad();
      c.expect_near("loss against the trainable layer1 left out of the optimizer" + at, loss, ref_loss, 0.0);
      const double want = local_loss.item().toDouble();
      c.expect_near("loss" + at, loss, want, bf16 ? 2e-2 * std::max(1.0, std::abs(want)) : 1e-5);
    }
    const auto got = whole_state(model, *frozen, false), want = whole_state(ref_model, *reference, false);
    for (const auto& [name, t] : want) expect_same_tensor(c, name + " (against the reference run)", got.at(name), t, 0.0);
    if (!bf16) expect_same_model(c, model, *frozen, *local, 1e-5);
  });
}

}  // namespace frozen_parameters
}  // namespace conformance
