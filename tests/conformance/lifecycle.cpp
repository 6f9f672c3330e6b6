// A wrapped model's life, memory and the models fsdp must refuse or take as they are, as PyTorch
// FSDP1's test_fsdp_misc, test_fsdp_memory, test_fsdp_core and FSDP2's test_fully_shard_init,
// test_fully_shard_memory test them: a model without parameters; the memory of each phase of a
// step against the plan; a model built with deferred_init as one unit; a wrapped model destroyed
// and rebuilt; wrapping a model twice; a 0-dim and a channels_last parameter; a ModuleList as a
// unit; Module::clone() of a wrapped model; a submodule registered after wrapping.
#include <unistd.h>

#include <cstdlib>

#include "conformance.h"
#include "fsdp/activation_checkpoint.h"
#include "fsdp/deferred_init.h"
#include "fsdp/plan.h"
#include "fsdp/process_memory.h"
#include "live_bytes.h"

namespace conformance {
namespace lifecycle {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

const auto kSgd = torch::optim::SGDOptions(0.1).momentum(0.9);
double tolerance(const Variant& v) { return v.mixed_precision() ? 2e-2 : 1e-5; }  // as summon_full_params.cpp says

void expect_same_state(Ctx& c, const std::string& what, const std::map<std::string, torch::Tensor>& got,
                       const std::map<std::string, torch::Tensor>& want, double tol) {
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    if (it == got.end()) {
      c.fail(what + ": " + name + " is missing");
      continue;
    }
    expect_same_tensor(c, what + ": " + name, it->second, w, tol);
  }
}

// One SGD step on each side with `in` columns in and `out` columns out (or classes, with
// `classes`), the losses compared.
template <typename Wrapped, typename Local>
void train_step(Ctx& c, Wrapped& model, torch::optim::Optimizer& optim, Local& local, torch::optim::Optimizer& local_optim,
                int step, double tol, std::vector<int64_t> in_shape, int64_t out) {
  std::vector<int64_t> shape{8};
  shape.insert(shape.end(), in_shape.begin(), in_shape.end());
  const auto x = randn(3000 + step, shape);
  const auto y = randn(4000 + step, {8, out});
  optim.zero_grad();
  auto loss = torch::mse_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
  loss.backward();
  optim.step();
  local_optim.zero_grad();
  auto local_loss = torch::mse_loss(local->forward(x), y);
  local_loss.backward();
  local_optim.step();
  c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                local_loss.item().toDouble(), tol);
}

// A residual MLP block and a stack of them in a ModuleList, each block called through
// fsdp::checkpointable (recomputed in backward once marked by apply_activation_checkpointing).
// Cloneable, as a libtorch model that offers clone() is.
struct MlpBlockImpl : torch::nn::Cloneable<MlpBlockImpl> {
  explicit MlpBlockImpl(int64_t d = 16, int64_t hidden = 32) : d(d), hidden(hidden) { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(d, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, d));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(x))); }
  int64_t d, hidden;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(MlpBlock);

struct StackImpl : torch::nn::Cloneable<StackImpl> {
  explicit StackImpl(int64_t n = 3, int64_t d = 16, int64_t hidden = 32) : n(n), d(d), hidden(hidden) { reset(); }
  void reset() override {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < n; ++i) blocks->push_back(MlpBlock(d, hidden));
    head = register_module("head", torch::nn::Linear(d, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto block = blocks->ptr<MlpBlockImpl>(i);
      x = fsdp::checkpointable(*block, [block](const torch::Tensor& h) { return block->forward(h); }, x);
    }
    return head(x);
  }
  int64_t n, d, hidden;
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Stack);

}  // namespace

CONFORMANCE_CASE(Lifecycle, ModelWithoutParameters, 2,
                 "#27 #191: FSDP1 test_fsdp_misc test_no_params, FSDP2 test_fully_shard_init test_empty_module") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    // A model with no parameter at all: no units, the forward and the input's gradient unchanged.
    auto act = torch::nn::Sequential(torch::nn::ReLU(), torch::nn::Tanh());
    fsdp::FullyShardedDataParallel model(act, c.mesh, v.options);
    c.expect(model.units().empty(), "a model without parameters has no units");
    c.expect(model.parameters().empty(), "and no parameters");
    const auto x = randn(1, {4, 3});
    auto xin = my_rows(c, x).clone().requires_grad_(true);
    auto xl = my_rows(c, x).clone().requires_grad_(true);
    auto out = model(xin);
    auto want = act->forward(xl);
    // Mixed precision casts floating-point inputs to param_dtype, as PyTorch does.
    expect_same_tensor(c, "the output of a model without parameters", out.to(torch::kFloat), want,
                       v.mixed_precision() ? 1e-2 : 0.0);
    out.sum().backward();
    want.sum().backward();
    c.expect(xin.grad().defined(), "the input gets its gradient");
    if (xin.grad().defined()) {
      expect_same_tensor(c, "the input's gradient", xin.grad(), xl.grad(), v.mixed_precision() ? 1e-2 : 0.0);
    }
    c.expect_ok("summon_full_params of a model without parameters", [&] { model.summon_full_params(); });
    c.expect_ok("unshard() of a model without parameters", [&] { model.unshard(); });
    c.expect_ok("clip_grad_norm_ of a model without parameters",
                [&] { c.expect(model.clip_grad_norm_(1.0) == 0.0, "the norm of no gradients is 0"); });

    // A parameterless module marked as a unit inside a model that has parameters: it becomes no
    // unit, and the model trains as local.
    torch::manual_seed(11);
    Stack mine(2);
    torch::manual_seed(11);
    Stack local(2);
    auto relu = torch::nn::ReLU();
    mine->register_module("unused_activation", relu);
    local->register_module("unused_activation", torch::nn::ReLU());
    fsdp::fully_shard(*relu);
    fsdp::fully_shard(*mine->blocks[0]);
    fsdp::FullyShardedDataParallel wrapped(mine, c.mesh, v.options);
    c.expect(wrapped.units().size() == 2, "blocks.0 and the root are the units (the ReLU has no parameters)");
    torch::optim::SGD optim(wrapped.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    for (int step = 0; step < 3; ++step) train_step(c, wrapped, optim, local, local_optim, step, tolerance(v), {16}, 4);
    expect_same_model(c, wrapped, *mine, *local, tolerance(v));
  });
}

// What libtorch's CPU allocator holds after each phase of four Adam steps, against the memory plan
// (plan.h) of the same model and options: after construction the sharded parameters, after
// backward those and the sharded gradients, after the step Adam's two moments of this rank's
// parameter slices (the plan counts them on the padded shard: at most F - 1 elements per unit
// more), after zero_grad (to None) no gradients; fsdp's counters say the same. With activation
// checkpointing (the blocks recomputed in backward) the same state, less memory held between
// forward and backward, and bitwise the same losses. Within live::kNoise (live_bytes.h) of a
// state of 25 to 400 KB.
CONFORMANCE_CASE(Lifecycle, MemoryOfEachPhaseMatchesThePlan, 4,
                 "#162: FSDP1 test_fsdp_memory test_fsdp_memory (ckpt True/False)") {
  fsdp::install_host_allocator();
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    std::map<bool, std::vector<double>> losses;
    std::map<bool, int64_t> held_between;  // live bytes between forward and backward, last step
    for (const bool ac : {false, true}) {
      const std::string with = ac ? " (activation checkpointing)" : "";
      const int64_t base = live::settled();
      torch::manual_seed(12);
      Stack mine(3, 32, 128);
      fsdp::Options o = v.options;
      o.auto_wrap_policy = fsdp::module_type_policy<MlpBlockImpl>();
      const fsdp::MemoryPlan plan = fsdp::plan_memory(*mine, c.world, o, c.world);
      fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
      // Planned again once wrapped, its parameters would be this rank's shards: refused, not a
      // plan of a model W times smaller (issue 35 review).
      c.expect_refused("plan_memory of the wrapped model", [&] { fsdp::plan_memory(*mine, c.world, o, c.world); },
                       {"belongs to a FullyShardedDataParallel", "Plan the model before wrapping it"});
      if (ac) c.expect(fsdp::apply_activation_checkpointing(*mine, fsdp::checkpoint_modules_of_type<MlpBlockImpl>()) == 3, "three blocks checkpointed");
      // `want` bytes above base (and `io`, the step's inputs), or a failure naming the phase.
      int64_t io = 0;
      std::string at = with;
      auto expect_held = [&](const std::string& phase, int64_t want) {
        const int64_t got = live::near(base + io + want) - base - io;
        c.expect(std::abs(got - want) <= live::kNoise,
                 phase + " the allocator holds " + live::str(got) + " (besides the inputs), the plan " + live::str(want) + at);
      };
      expect_held("after construction", plan.sharded_params);
      c.expect(std::abs(model.metrics().memory.sharded_params - plan.sharded_params) == 0,
               "fsdp counts the plan's sharded parameters" + with);
      torch::optim::Adam optim(model.parameters(), torch::optim::AdamOptions(1e-3));
      int64_t my_numel = 0;
      for (const auto& p : model.parameters()) my_numel += p.numel();
      const int64_t adam = 2 * my_numel * 4;
      c.expect(adam <= plan.adam_state && plan.adam_state - adam <= 2 * 4 * c.world * static_cast<int64_t>(plan.units.size()),
               "Adam's moments of this rank's slices (" + live::str(adam) + ") are the plan's " +
                   live::str(plan.adam_state) + " less the padding");
      for (int step = 0; step < 4; ++step) {
        at = " at step " + std::to_string(step) + with;
        const int64_t before_inputs = live::bytes();
        const auto x = randn(5000 + step, {64, 32});
        const auto y = randn(6000 + step, {64, 4});
        io = live::bytes() - before_inputs;
        const int64_t state = live::bytes() - base - io;
        auto loss = torch::mse_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
        held_between[ac] = live::bytes() - base - io - state;
        c.figure(std::string("held between forward and backward") + with, static_cast<double>(held_between[ac]));
        c.expect(model.metrics().memory.unsharded_peak <= plan.peak_unsharded_params,
                 "the gathered parameters' peak (" + live::str(model.metrics().memory.unsharded_peak) +
                     ") within the plan's " + live::str(plan.peak_unsharded_params) + at);
        loss.backward();
        losses[ac].push_back(global_mean(c, loss.item().toDouble()));
        loss = torch::Tensor();
        expect_held("after backward", plan.sharded_params + plan.sharded_grads + (step > 0 ? adam : 0));
        c.expect(model.metrics().memory.sharded_grads == plan.sharded_grads, "fsdp counts the plan's sharded gradients" + at);
        c.expect(model.metrics().memory.unsharded_current == 0, "nothing stays gathered after backward" + at);
        optim.step();
        expect_held("after the step", plan.sharded_params + plan.sharded_grads + adam);
        optim.zero_grad();  // to None: the gradients' memory goes
        expect_held("after zero_grad", plan.sharded_params + adam);
        c.expect(model.metrics().memory.sharded_grads == 0, "fsdp counts no sharded gradients after zero_grad" + at);
      }
    }
    c.expect(held_between[true] < held_between[false],
             "activation checkpointing holds less between forward and backward (" + live::str(held_between[true]) +
                 " against " + live::str(held_between[false]) + ")");
    for (size_t s = 0; s < losses[false].size(); ++s) {
      c.expect(losses[true][s] == losses[false][s], "the loss at step " + std::to_string(s) +
                                                        " is bitwise the same with activation checkpointing");
    }
  });
}

// fp32 and bf16: deferred_init's replay is exact in the parameters' own dtype (fp32 master).
CONFORMANCE_CASE(Lifecycle, DeferredInitAsOneUnitEqualsNormalConstruction, 4,
                 "#165: FSDP1 test_fsdp_memory / test_fsdp_misc, all submodules in a single FSDP unit (no auto wrap)") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(13);
    auto mine = fsdp::deferred_init([] { return Stack(3); });
    torch::manual_seed(13);
    Stack local(3);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);  // no auto_wrap_policy: the root unit only
    c.expect(model.units().size() == 1 && model.units()[0].is_root, "one unit, the root, holding every parameter");
    expect_same_model(c, model, *mine, *local, 0.0);
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    for (int step = 0; step < 3; ++step) train_step(c, model, optim, local, local_optim, step, tolerance(v), {16}, 4);
    expect_same_model(c, model, *mine, *local, tolerance(v));
  });
}

// Built, wrapped, trained two steps with Adam, checkpointed, destroyed: three times in a row,
// libtorch's CPU allocator back where it was each time (no shard, gathered buffer, gradient,
// hook or prefetch state kept alive by the mesh or the library).
CONFORMANCE_CASE(Lifecycle, DestroyedAndRebuiltThreeTimesReturnsItsMemory, 4,
                 "#256: FSDP2 test_fully_shard_memory test_fully_shard_del_memory") {
  fsdp::install_host_allocator();
  const std::string dir = "/tmp/fsdp-conformance-rebuild-" + std::to_string(::getppid());
  int variant = 0;
  for_each(c, every_strategy(c), [&](const Variant& v) {
    ++variant;
    const int64_t base = live::settled();
    for (int round = 0; round < 3; ++round) {
      {
        torch::manual_seed(14);
        Stack mine(3, 32, 128);  // 100 KB
        fsdp::Options o = v.options;
        o.auto_wrap_policy = fsdp::module_type_policy<MlpBlockImpl>();
        fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
        torch::optim::Adam optim(model.parameters(), torch::optim::AdamOptions(1e-3));
        for (int step = 0; step < 2; ++step) {
          optim.zero_grad();
          auto loss = torch::mse_loss(model(my_rows(c, randn(7000 + step, {8, 32}))).to(torch::kFloat),
                                      my_rows(c, randn(7100 + step, {8, 4})));
          loss.backward();
          optim.step();
        }
        { auto whole = model.summon_full_params(); }
        fsdp::Checkpointer ckpt(c.mesh, dir + "/" + std::to_string(variant) + "-" + std::to_string(round));
        ckpt.save(model, &optim, {2});
      }
      const int64_t left = live::near(base) - base;
      c.figure("bytes left after round " + std::to_string(round), static_cast<double>(left));
      c.expect(std::abs(left) <= live::kNoise, "after round " + std::to_string(round) + " the allocator holds " +
                                                   live::str(left) + " more than before the model was built");
    }
  });
  // Not std::filesystem::remove_all: the one libtorch.so exports crashes when called from here.
  if (c.rank == 0) c.expect(std::system(("rm -rf '" + dir + "'").c_str()) == 0, "the checkpoints are removed");
}

CONFORMANCE_CASE(Lifecycle, WrappingTwiceIsRefused, 4,
                 "#177 #297: FSDP1 test_fsdp_misc test_error_already_wrapped (test_fsdp_multiple_wrapping), "
                 "FSDP2 test_fully_shard_init test_fully_shard_reapply") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    // A second FullyShardedDataParallel over a model already wrapped: refused; the first goes on.
    torch::manual_seed(15);
    Stack mine(3);
    torch::manual_seed(15);
    Stack local(3);
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<MlpBlockImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    c.expect_refused("wrapping an already wrapped model again", [&] { fsdp::FullyShardedDataParallel again(mine, c.mesh, o); },
                     {"already", "FullyShardedDataParallel"});
    // A model one of whose blocks is wrapped on its own: refused, pointing to fully_shard().
    torch::manual_seed(15);
    Stack other(3);
    fsdp::FullyShardedDataParallel<torch::nn::Module> inner(other->blocks[1], c.mesh, v.options);
    c.expect_refused("wrapping a model one of whose submodules is wrapped already",
                     [&] { fsdp::FullyShardedDataParallel outer(other, c.mesh, o); },
                     {"already", "blocks.1", "fully_shard"});
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    for (int step = 0; step < 3; ++step) train_step(c, model, optim, local, local_optim, step, 1e-5, {16}, 4);
    expect_same_model(c, model, *mine, *local, 1e-5);

    // fully_shard() on one module twice marks it once: the same units as marking it once.
    torch::manual_seed(16);
    Stack twice(3);
    torch::manual_seed(16);
    Stack local2(3);
    fsdp::fully_shard(*twice->blocks[0]);
    fsdp::fully_shard(*twice->blocks[0]);
    fsdp::FullyShardedDataParallel marked(twice, c.mesh, v.options);
    c.expect(marked.units().size() == 2, "blocks.0 marked twice is one unit, besides the root");
    torch::optim::SGD optim2(marked.parameters(), kSgd);
    torch::optim::SGD local_optim2(local2->parameters(), kSgd);
    for (int step = 0; step < 3; ++step) train_step(c, marked, optim2, local2, local_optim2, step, 1e-5, {16}, 4);
    expect_same_model(c, marked, *twice, *local2, 1e-5);
  });
}

namespace {
// A learned 0-dim temperature inside a unit (a contrastive loss's logit scale).
struct TemperatureImpl : torch::nn::Module {
  TemperatureImpl() {
    proj = register_module("proj", torch::nn::Linear(6, 4));
    temperature = register_parameter("temperature", torch::tensor(0.7));
  }
  torch::Tensor forward(const torch::Tensor& x) { return proj(x) * temperature; }
  torch::nn::Linear proj{nullptr};
  torch::Tensor temperature;
};
TORCH_MODULE(Temperature);

struct ScaledNetImpl : torch::nn::Module {
  ScaledNetImpl() {
    scaled = register_module("scaled", Temperature());
    head = register_module("head", torch::nn::Linear(4, 3));
    bias = register_parameter("bias", torch::tensor(0.1));  // a 0-dim parameter of the root unit
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::tanh(scaled(x))) + bias; }
  Temperature scaled{nullptr};
  torch::nn::Linear head{nullptr};
  torch::Tensor bias;
};
TORCH_MODULE(ScaledNet);
}  // namespace

CONFORMANCE_CASE(Lifecycle, ZeroDimParameterTrainsLikeLocal, 4,
                 "#270: FSDP2 test_fully_shard_init test_raise_scalar_parameter") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(17);
    ScaledNet mine;
    torch::manual_seed(17);
    ScaledNet local;
    fsdp::fully_shard(*mine->scaled);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    {
      auto whole = model.summon_full_params();
      c.expect(mine->scaled->temperature.dim() == 0 && mine->bias.dim() == 0, "0-dim parameters are 0-dim inside summon");
    }
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    for (int step = 0; step < 4; ++step) train_step(c, model, optim, local, local_optim, step, tolerance(v), {6}, 3);
    expect_same_model(c, model, *mine, *local, tolerance(v));
  });
}

namespace {
struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)));
    head = register_module("head", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(conv2(torch::relu(conv1(x))));
    return head(h.mean({2, 3}));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(ConvNet);

// The convolutions' weights laid out channels_last (non-contiguous in the default order), as a
// vision model prepared for channels_last kernels has them.
void to_channels_last(ConvNet& net) {
  torch::NoGradGuard no_grad;
  for (auto* conv : {&net->conv1, &net->conv2}) {
    (*conv)->weight.set_data((*conv)->weight.contiguous(at::MemoryFormat::ChannelsLast));
  }
}
}  // namespace

CONFORMANCE_CASE(Lifecycle, ChannelsLastParameterTrainsLikeLocal, 4,
                 "#271: FSDP2 test_fully_shard_init test_raise_noncontiguous_parameter") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(18);
    ConvNet mine;
    torch::manual_seed(18);
    ConvNet local;
    to_channels_last(mine);
    to_channels_last(local);
    c.expect(!mine->conv1->weight.is_contiguous(), "the weight is channels_last");
    fsdp::fully_shard(*mine->conv1);
    fsdp::fully_shard(*mine->conv2);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    expect_same_model(c, model, *mine, *local, 0.0);
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    for (int step = 0; step < 3; ++step) train_step(c, model, optim, local, local_optim, step, tolerance(v), {3, 6, 6}, 2);
    expect_same_model(c, model, *mine, *local, tolerance(v));
  });
}

CONFORMANCE_CASE(Lifecycle, ModuleListAsOneUnit, 4,
                 "#298: FSDP2 test_fully_shard_init test_fully_shard_unsupported_module_cls") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(19);
    Stack mine(3);
    torch::manual_seed(19);
    Stack local(3);
    fsdp::fully_shard(*mine->blocks);  // a ModuleList: no forward of its own
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    const auto units = model.units();
    c.expect(units.size() == 2 && units[0].name == "blocks" && units[0].fqns.size() == 12,
             "the ModuleList is one unit holding the three blocks' twelve parameters, the head is the root's");
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    for (int step = 0; step < 3; ++step) train_step(c, model, optim, local, local_optim, step, tolerance(v), {16}, 4);
    expect_same_model(c, model, *mine, *local, tolerance(v));
  });
}

CONFORMANCE_CASE(Lifecycle, CloneOfAWrappedModel, 4, "#299: FSDP2 test_fully_shard_init test_fully_shard_deepcopy") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(20);
    Stack mine(3);
    torch::manual_seed(20);
    Stack local(3);
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<MlpBlockImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    train_step(c, model, optim, local, local_optim, 0, tolerance(v), {16}, 4);
    const auto x = randn(8000, {8, 16});
    // Inside summon_full_params a clone is a plain libtorch copy of the whole model (an EMA or a
    // teacher): whole parameters, its own storage, computing what the local model computes.
    std::shared_ptr<StackImpl> copy;
    {
      auto whole = model.summon_full_params({/*writeback=*/false});
      copy = std::dynamic_pointer_cast<StackImpl>(mine->clone());
    }
    c.expect(copy != nullptr, "clone() returns a Stack");
    if (!copy) return;
    const double tol = tolerance(v);
    expect_same_state(c, "the clone made inside summon_full_params", state_of(*copy), state_of(*local), tol);
    const auto want = local->forward(x).detach();
    expect_same_tensor(c, "the clone's forward", copy->forward(x).detach(), want, tol);
    train_step(c, model, optim, local, local_optim, 1, tol, {16}, 4);
    expect_same_tensor(c, "the clone after the wrapped model trained on", copy->forward(x).detach(), want, tol);
    // Outside it, the parameters are this rank's shards: a clone would copy them.
    if (model.shard_size() > 1) {
      c.expect_refused("clone() of a wrapped model outside summon_full_params, then its forward",
                       [&] { std::dynamic_pointer_cast<StackImpl>(mine->clone())->forward(x); },
                       {"clone", "summon_full_params"});
    } else {
      auto plain = std::dynamic_pointer_cast<StackImpl>(mine->clone());
      expect_same_tensor(c, "a clone of a replicated (F = 1) model, outside summon_full_params",
                         plain->forward(x).detach(), local->forward(x).detach(), tol);
    }
    train_step(c, model, optim, local, local_optim, 2, tol, {16}, 4);
    expect_same_model(c, model, *mine, *local, tol);
  });
}

namespace {
// A model with an optional adapter (LoRA-style), attached by the user's code at any time.
struct AdaptedImpl : torch::nn::Module {
  AdaptedImpl() {
    base = register_module("base", torch::nn::Linear(6, 6));
    head = register_module("head", torch::nn::Linear(6, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(base(x));
    if (adapter) h = h + adapter(h);
    return head(h);
  }
  torch::nn::Linear base{nullptr}, head{nullptr}, adapter{nullptr};
};
TORCH_MODULE(Adapted);
}  // namespace

CONFORMANCE_CASE(Lifecycle, SubmoduleRegisteredAfterWrappingIsRefused, 4,
                 "#309: FSDP2 test_fully_shard_init test_forward_after_late_submodule_attach; DeepSpeed "
                 "test_zero_context test_idempotent_on_already_injected_modules") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(21);
    Adapted mine;
    torch::manual_seed(21);
    Adapted local;
    fsdp::fully_shard(*mine->base);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    train_step(c, model, optim, local, local_optim, 0, 1e-5, {6}, 3);
    // Attached after wrapping, its parameters are in no unit: every rank would train its own copy
    // on its own rows, never reduced. Refused at the next forward, naming them.
    mine->adapter = mine->register_module("adapter", torch::nn::Linear(6, 6));
    c.expect_refused("a forward after a submodule was registered on the wrapped model",
                     [&] { model(my_rows(c, randn(1, {8, 6}))); }, {"adapter.weight", "after", "before wrapping"});
    // Taken away again, the model trains on as before.
    mine->unregister_module("adapter");
    mine->adapter = nullptr;
    for (int step = 1; step < 4; ++step) train_step(c, model, optim, local, local_optim, step, 1e-5, {6}, 3);
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

}  // namespace lifecycle
}  // namespace conformance
