// Activation checkpointing (include/fsdp/activation_checkpoint.h) beyond one checkpoint per unit,
// as PyTorch FSDP1's test_fsdp_checkpoint and test_checkpoint_wrapper test it: one checkpoint
// spanning several units, around the wrapped model's whole forward, finer than a unit, with
// several inputs and outputs, the memory it saves, and a policy applied to nested modules. Every
// result is compared bit for bit with the same fsdp loop without checkpointing (recomputation
// repeats the same operations on the same values) and with local training.
#include "conformance.h"
#include "fsdp/activation_checkpoint.h"
#include "fsdp/process_memory.h"
#include "live_bytes.h"

namespace conformance {
namespace activation_checkpoint {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

const auto kSgd = torch::optim::SGDOptions(0.1).momentum(0.9);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d = 16, int64_t hidden = 32) {
    fc1 = register_module("fc1", torch::nn::Linear(d, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, d));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

// Blocks in a ModuleList and a head. How its forward checkpoints is the scenario's: `forward`
// calls each block through fsdp::checkpointable.
struct TowerImpl : torch::nn::Module {
  explicit TowerImpl(int64_t n = 4, int64_t d = 16, int64_t hidden = 32) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < n; ++i) blocks->push_back(Block(d, hidden));
    head = register_module("head", torch::nn::Linear(d, 4));
  }
  torch::Tensor run_blocks(torch::Tensor x) {
    for (size_t i = 0; i < blocks->size(); ++i) x = blocks->ptr<BlockImpl>(i)->forward(x);
    return x;
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < blocks->size(); ++i) {
      auto block = blocks->ptr<BlockImpl>(i);
      x = fsdp::checkpointable(*block, [block](const torch::Tensor& h) { return block->forward(h); }, x);
    }
    return head(x);
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Tower);

// One training run of a wrapped Tower: `forward(model, tower, x)` is the user's forward; returns
// the global losses, and leaves the model trained.
using TowerForward = std::function<torch::Tensor(fsdp::FullyShardedDataParallel<TowerImpl>&, Tower&, const torch::Tensor&)>;
struct Run {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> whole;  // the parameters at the end
  int64_t all_gathers = 0;                     // over the run
};
Run train_tower(Ctx& c, const Variant& v, int steps, uint64_t seed, const TowerForward& forward,
                const std::function<void(Tower&)>& prepare = {}) {
  torch::manual_seed(seed);
  Tower mine;
  if (prepare) prepare(mine);
  fsdp::Options o = v.options;
  o.auto_wrap_policy = fsdp::module_type_policy<BlockImpl>();
  fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
  torch::optim::SGD optim(model.parameters(), kSgd);
  Run run;
  for (int step = 0; step < steps; ++step) {
    const auto x = randn(9000 + step, {8, 16});
    const auto y = randn(9100 + step, {8, 4});
    model.reset_step();
    optim.zero_grad();
    auto loss = torch::mse_loss(forward(model, mine, my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
    loss.backward();
    optim.step();
    run.all_gathers += model.metrics().comm.all_gather_calls;
    run.losses.push_back(global_mean(c, loss.item().toDouble()));
  }
  run.whole = whole_state(model, *mine);
  return run;
}

// The oracle: the same steps in plain libtorch on the whole batch.
Run train_local(int steps, uint64_t seed) {
  torch::manual_seed(seed);
  Tower local;
  torch::optim::SGD optim(local->parameters(), kSgd);
  Run run;
  for (int step = 0; step < steps; ++step) {
    const auto x = randn(9000 + step, {8, 16});
    const auto y = randn(9100 + step, {8, 4});
    optim.zero_grad();
    auto loss = torch::mse_loss(local->head(local->run_blocks(x)), y);
    loss.backward();
    optim.step();
    run.losses.push_back(loss.item().toDouble());
  }
  run.whole = state_of(*local);
  return run;
}

// `got` bitwise equal to `plain` (the same fsdp loop without checkpointing) and within `tol` of
// local training.
void expect_runs(Ctx& c, const std::string& what, const Run& got, const Run& plain, const Run& local, double tol) {
  for (size_t s = 0; s < got.losses.size(); ++s) {
    c.expect(got.losses[s] == plain.losses[s], what + ": the loss at step " + std::to_string(s) +
                                                   " is not bitwise the loss without checkpointing");
    c.expect_near(what + ": loss at step " + std::to_string(s), got.losses[s], local.losses[s], tol);
  }
  for (const auto& [name, w] : local.whole) {
    if (!got.whole.count(name) || !plain.whole.count(name)) {
      c.fail(what + ": " + name + " is missing");
      continue;
    }
    expect_same_tensor(c, what + ": " + name + " against the same loop without checkpointing", got.whole.at(name),
                       plain.whole.at(name), 0.0);
    expect_same_tensor(c, what + ": " + name + " against local training", got.whole.at(name), w, tol);
  }
}

torch::Tensor plain_forward(fsdp::FullyShardedDataParallel<TowerImpl>& model, Tower&, const torch::Tensor& x) {
  return model(x);
}

}  // namespace

CONFORMANCE_CASE(ActivationCheckpoint, OneCheckpointSpanningSeveralUnits, 4,
                 "#65: FSDP1 test_fsdp_checkpoint test_checkpoint_fsdp_wrapping (checkpoint(FSDP(l1), FSDP(l2), FSDP(l3)))") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    const int steps = 3;
    const Run local = train_local(steps, 30);
    const Run plain = train_tower(c, v, steps, 30, plain_forward);
    // The four blocks, four units, recomputed together from one saved input.
    const Run spanning = train_tower(c, v, steps, 30, [](auto& model, Tower& tower, const torch::Tensor& x) {
      return model.forward_with([&] {
        auto h = fsdp::checkpoint([tw = tower.ptr()](const torch::Tensor& t) { return tw->run_blocks(t); }, x);
        return tower->head(h);
      });
    });
    expect_runs(c, "one checkpoint over four units", spanning, plain, local, 1e-5);
    c.figure("all-gathers per step without checkpointing", static_cast<double>(plain.all_gathers) / steps);
    c.figure("all-gathers per step with one checkpoint over four units", static_cast<double>(spanning.all_gathers) / steps);
    c.expect(spanning.all_gathers <= plain.all_gathers,
             "the recomputation gathers no more than plain backward (" + std::to_string(spanning.all_gathers) + " all-gathers against " +
                 std::to_string(plain.all_gathers) + ")");
  });
}

CONFORMANCE_CASE(ActivationCheckpoint, AroundTheWholeWrappedModel, 4,
                 "#67: FSDP1 test_fsdp_checkpoint test_basic_checkpoint_end_to_end (checkpoint_wrapper(FSDP(seq)), "
                 "checkpoint(fsdp_model, inp))") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    const int steps = 6;
    const Run local = train_local(steps, 31);
    const Run plain = train_tower(c, v, steps, 31, plain_forward);
    // The wrapped model's forward itself inside fsdp::checkpoint: recomputed, whole, in backward.
    const Run outside = train_tower(c, v, steps, 31, [](auto& model, Tower&, const torch::Tensor& x) {
      auto* wrapped = &model;
      return fsdp::checkpoint([wrapped](const torch::Tensor& t) { return wrapped->forward(t); }, x);
    });
    expect_runs(c, "fsdp::checkpoint around the wrapped model's forward", outside, plain, local, 1e-5);
    // The top module marked by a policy, called through checkpointable inside the root's forward.
    const Run marked = train_tower(
        c, v, steps, 31,
        [](auto& model, Tower& tower, const torch::Tensor& x) {
          return model.forward_with([&] {
            auto top = tower.ptr();
            return fsdp::checkpointable(*top, [top](const torch::Tensor& t) { return top->forward(t); }, x);
          });
        },
        [&](Tower& tower) {
          c.expect(fsdp::apply_activation_checkpointing(*tower, fsdp::checkpoint_modules_of_type<TowerImpl>()) == 1,
                   "the policy marks the top module alone");
        });
    expect_runs(c, "the root module checkpointed by apply_activation_checkpointing", marked, plain, local, 1e-5);
  });
}

namespace {
// A unit (the whole block) whose MLP alone is checkpointed: finer than the unit.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    up = register_module("up", torch::nn::Linear(16, 48));
    down = register_module("down", torch::nn::Linear(48, 16));
  }
  torch::Tensor forward(const torch::Tensor& x) { return down(torch::gelu(up(x))); }
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(Mlp);

struct MixerBlockImpl : torch::nn::Module {
  MixerBlockImpl() {
    mix = register_module("mix", torch::nn::Linear(16, 16));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    mlp = register_module("mlp", Mlp());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x + torch::tanh(mix(norm(x)));
    auto m = mlp.ptr();
    return h + fsdp::checkpointable(*m, [m](const torch::Tensor& t) { return m->forward(t); }, h);
  }
  torch::nn::Linear mix{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(MixerBlock);

struct MixerImpl : torch::nn::Module {
  MixerImpl() {
    b0 = register_module("b0", MixerBlock());
    b1 = register_module("b1", MixerBlock());
    head = register_module("head", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(b1(b0(x))); }
  MixerBlock b0{nullptr}, b1{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Mixer);

// Trains a wrapped Mixer (units: the blocks) with its MLPs checkpointed or not; the local oracle
// when `mesh` is null.
Run train_mixer(Ctx& c, const Variant* v, bool checkpointed) {
  torch::manual_seed(32);
  Mixer mine;
  if (checkpointed) {
    c.expect(fsdp::apply_activation_checkpointing(*mine, fsdp::checkpoint_modules_of_type<MlpImpl>()) == 2,
             "the two MLPs are marked");
  }
  std::unique_ptr<fsdp::FullyShardedDataParallel<MixerImpl>> model;
  if (v) {
    fsdp::Options o = v->options;
    o.auto_wrap_policy = fsdp::module_type_policy<MixerBlockImpl>();
    model = std::make_unique<fsdp::FullyShardedDataParallel<MixerImpl>>(mine, c.mesh, o);
  }
  torch::optim::SGD optim(model ? model->parameters() : mine->parameters(), kSgd);
  Run run;
  for (int step = 0; step < 3; ++step) {
    const auto x = randn(9200 + step, {8, 16});
    const auto y = randn(9300 + step, {8, 4});
    optim.zero_grad();
    auto loss = model ? torch::mse_loss((*model)(my_rows(c, x)), my_rows(c, y)) : torch::mse_loss(mine->forward(x), y);
    loss.backward();
    optim.step();
    run.losses.push_back(model ? global_mean(c, loss.item().toDouble()) : loss.item().toDouble());
  }
  run.whole = model ? whole_state(*model, *mine) : state_of(*mine);
  return run;
}
}  // namespace

CONFORMANCE_CASE(ActivationCheckpoint, FinerThanAUnit, 4,
                 "#68: FSDP1 test_fsdp_checkpoint test_checkpoint_submodule (checkpointed submodules inside an FSDP unit)") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    const Run local = train_mixer(c, nullptr, false);
    const Run plain = train_mixer(c, &v, false);
    const Run finer = train_mixer(c, &v, true);
    expect_runs(c, "each block's MLP checkpointed inside its unit", finer, plain, local, 1e-5);
  });
}

namespace {
// A block with several inputs and outputs (T5's: hidden states, a position bias that needs no
// gradient, a learned gate, token ids): returns the new hidden states, the attention-like scores,
// the ids it kept (integer) and the gate's contribution.
struct MultiImpl : torch::nn::Module {
  MultiImpl() {
    proj = register_module("proj", torch::nn::Linear(8, 8));
    out = register_module("out", torch::nn::Linear(8, 8));
  }
  std::vector<torch::Tensor> forward(const std::vector<torch::Tensor>& in) {
    const auto& x = in[0];
    const auto& bias = in[1];  // no gradient
    const auto& gate = in[2];
    const auto& ids = in[3];   // integer
    auto scores = torch::softmax(proj(x).matmul(x.transpose(0, 1)) + bias, -1);
    auto h = out(scores.matmul(x)) * torch::sigmoid(gate);
    auto kept = ids.remainder(5);
    return {x + h, scores, kept, gate.pow(2).sum() * h.mean()};
  }
  torch::nn::Linear proj{nullptr}, out{nullptr};
};
TORCH_MODULE(Multi);

// A learned gate in a unit of its own.
struct GateImpl : torch::nn::Module {
  GateImpl() { g = register_parameter("g", torch::linspace(-0.5, 0.5, 8)); }
  torch::Tensor g;
};
TORCH_MODULE(Gate);

// Each block gets a parameter as a direct input of the checkpointed call: block a the root's
// gate, block b the gate of another unit.
struct MultiNetImpl : torch::nn::Module {
  MultiNetImpl() {
    a = register_module("a", Multi());
    b = register_module("b", Multi());
    gates = register_module("gates", Gate());
    head = register_module("head", torch::nn::Linear(8, 2));
    gate = register_parameter("gate", torch::full({8}, 0.3));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias, const torch::Tensor& ids) {
    std::vector<torch::Tensor> h{x, bias, gate, ids};
    for (auto* m : {&a, &b}) {
      auto block = m->ptr();
      const auto& g = m == &a ? gate : gates->g;
      auto r = fsdp::checkpointable(*block, [block](const std::vector<torch::Tensor>& in) { return block->forward(in); },
                                    {h[0], bias, g, ids});
      h = {r[0] + r[3], bias, g, r[2]};
    }
    return head(h[0]) + h[3].to(torch::kFloat).mean();
  }
  Multi a{nullptr}, b{nullptr};
  Gate gates{nullptr};
  torch::nn::Linear head{nullptr};
  torch::Tensor gate;
};
TORCH_MODULE(MultiNet);
}  // namespace

CONFORMANCE_CASE(ActivationCheckpoint, SeveralInputsAndOutputs, 4,
                 "#198: FSDP1 test_checkpoint_wrapper test_checkpoint_wrapper_kwarg_support (several inputs, a tuple out)") {
  // Alone, without fsdp: fsdp::checkpoint over a TensorsFn of four inputs (one needs no gradient,
  // one is integer) returning four outputs gives the same outputs and gradients, bit for bit.
  {
    torch::manual_seed(33);
    Multi block;
    auto x = randn(1, {6, 8}).requires_grad_(true), gate = randn(2, {8}).requires_grad_(true);
    const auto bias = randn(3, {6, 6}), ids = randint(4, 100, {6});
    auto x2 = x.detach().clone().requires_grad_(true), gate2 = gate.detach().clone().requires_grad_(true);
    auto want = block->forward({x2, bias, gate2, ids});
    auto blk = block.ptr();
    auto got = fsdp::checkpoint([blk](const std::vector<torch::Tensor>& in) { return blk->forward(in); }, {x, bias, gate, ids});
    c.expect(got.size() == 4, "four outputs");
    for (size_t i = 0; i < std::min<size_t>(got.size(), 4); ++i) {
      expect_same_tensor(c, "output " + std::to_string(i) + " of the checkpointed call", got[i].detach(), want[i].detach(), 0.0);
    }
    c.expect(got[2].scalar_type() == torch::kLong && !got[2].requires_grad(), "the integer output needs no gradient");
    block->zero_grad();
    (want[0].sum() + want[1].pow(2).sum() + want[3]).backward();
    std::map<std::string, torch::Tensor> want_grads{{"x", x2.grad()}, {"gate", gate2.grad()}};
    for (const auto& p : block->named_parameters()) want_grads[p.key()] = p.value().grad().clone();
    block->zero_grad();
    (got[0].sum() + got[1].pow(2).sum() + got[3]).backward();
    std::map<std::string, torch::Tensor> got_grads{{"x", x.grad()}, {"gate", gate.grad()}};
    for (const auto& p : block->named_parameters()) got_grads[p.key()] = p.value().grad();
    for (const auto& [name, g] : want_grads) {
      expect_same_tensor(c, "the gradient of " + name + " through the checkpointed call", got_grads[name], g, 0.0);
    }
  }
  // Under fsdp: each Multi block a unit, called through checkpointable with four inputs, one of them
  // a parameter (of the root, of another unit).
  for_each(c, every_strategy(c), [&](const Variant& v) {
    std::map<bool, Run> runs;
    Run local;
    for (int side = 0; side < 3; ++side) {
      const bool wrapped = side > 0, checkpointed = side == 2;
      torch::manual_seed(34);
      MultiNet mine;
      if (checkpointed) fsdp::apply_activation_checkpointing(*mine, fsdp::checkpoint_modules_of_type<MultiImpl>());
      std::unique_ptr<fsdp::FullyShardedDataParallel<MultiNetImpl>> model;
      if (wrapped) {
        fsdp::Options o = v.options;
        o.auto_wrap_policy = fsdp::module_type_policy<MultiImpl, GateImpl>();
        model = std::make_unique<fsdp::FullyShardedDataParallel<MultiNetImpl>>(mine, c.mesh, o);
      }
      torch::optim::SGD optim(model ? model->parameters() : mine->parameters(), kSgd);
      Run run;
      for (int step = 0; step < 3; ++step) {
        // The bias and the ids are per row block: each rank's rows attend among themselves, as
        // the local model computes per rank's rows (below).
        const auto x = randn(9400 + step, {8, 8});
        const auto bias = randn(9500 + step, {2, 2});
        const auto ids = randint(9600 + step, 100, {8});
        const auto y = randn(9700 + step, {8, 2});
        optim.zero_grad();
        torch::Tensor loss;
        if (model) {
          loss = torch::mse_loss((*model)(my_rows(c, x), bias, my_rows(c, ids)), my_rows(c, y));
        } else {
          for (int r = 0; r < c.world; ++r) {
            auto part = torch::mse_loss(mine->forward(x.narrow(0, 2 * r, 2), bias, ids.narrow(0, 2 * r, 2)),
                                        y.narrow(0, 2 * r, 2)) / c.world;
            loss = loss.defined() ? loss + part : part;
          }
        }
        loss.backward();
        optim.step();
        run.losses.push_back(model ? global_mean(c, loss.item().toDouble()) : loss.item().toDouble());
      }
      run.whole = model ? whole_state(*model, *mine) : state_of(*mine);
      if (wrapped) runs[checkpointed] = run;
      else local = run;
    }
    expect_runs(c, "checkpointable(module, TensorsFn, four inputs)", runs[true], runs[false], local, 1e-5);
  });
}

// What a step holds, measured by libtorch's CPU allocator: with every block checkpointed (by the
// policy, or by fsdp::checkpoint in the forward: the same memory between forward and backward) the
// peak of the step is lower than without, and what is held between forward and backward, besides
// the gathered parameters,
// is at most each block's saved input and the generator state it keeps for recomputation, plus
// the head's input, output and loss: (blocks + 3) rows x width x 4 bytes + blocks x the CPU
// generator's state. The losses are bitwise those without checkpointing.
CONFORMANCE_CASE(ActivationCheckpoint, PeakMemoryIsLower, 4,
                 "#200: FSDP1 test_checkpoint_wrapper test_checkpoint_wrapper_parity (peak memory lower, equal in the "
                 "wrapper and functional forms)") {
  fsdp::install_host_allocator();
  for_each(c, every_strategy(c), [&](const Variant& v) {
    // Activations well above the parameters, so that which collectives happen to be in flight at
    // the peak (gathered blocks, their Gloo staging copies, reductions: ~100 KB either way) cannot
    // hide what checkpointing saves (~1 MB).
    const int64_t rows = 256, width = 32, blocks = 4;  // rows per rank
    const int64_t rng_state = at::globalContext().defaultGenerator(c10::Device(c10::kCPU)).get_state().nbytes();
    std::map<std::string, int64_t> peak, held;
    std::map<std::string, std::vector<double>> losses;
    for (const std::string form : {"none", "policy", "functional"}) {
      torch::manual_seed(35);
      Tower mine(blocks, width, 4 * width);
      if (form == "policy") fsdp::apply_activation_checkpointing(*mine, fsdp::checkpoint_modules_of_type<BlockImpl>());
      fsdp::Options o = v.options;
      o.auto_wrap_policy = fsdp::module_type_policy<BlockImpl>();
      fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
      torch::optim::SGD optim(model.parameters(), kSgd);
      for (int step = 0; step < 2; ++step) {
        const auto x = randn(9800 + step, {rows * c.world, width});
        const auto y = randn(9900 + step, {rows * c.world, 4});
        optim.zero_grad();
        torch::Tensor loss;
        const int64_t start = live::settled();  // the last step's reductions let go
        fsdp::HostMemoryPeak measure;
        if (form == "functional") {
          loss = torch::mse_loss(model.forward_with([&] {
            torch::Tensor h = my_rows(c, x);
            for (size_t i = 0; i < mine->blocks->size(); ++i) {
              auto block = mine->blocks->ptr<BlockImpl>(i);
              h = fsdp::checkpoint([block](const torch::Tensor& t) { return block->forward(t); }, h);
            }
            return mine->head(h);
          }), my_rows(c, y));
        } else {
          loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, y));
        }
        held[form] = live::settled() - start - model.metrics().memory.unsharded_current;
        loss.backward();
        peak[form] = measure.peak_bytes();
        optim.step();
        losses[form].push_back(global_mean(c, loss.item().toDouble()));
      }
      c.figure("step peak bytes, checkpointing " + form, static_cast<double>(peak[form]));
      c.figure("activation bytes held between forward and backward, checkpointing " + form, static_cast<double>(held[form]));
    }
    const int64_t bound = (blocks + 3) * rows * width * 4 + blocks * rng_state;
    for (const std::string form : {"policy", "functional"}) {
      c.expect(peak[form] < peak["none"], "the step's peak with checkpointing (" + form + ", " + std::to_string(peak[form]) +
                                              " bytes) is lower than without (" + std::to_string(peak["none"]) + ")");
      c.expect(held[form] <= bound, "with checkpointing (" + form + ") forward leaves " + std::to_string(held[form]) +
                                        " bytes of activations for backward, more than the blocks' inputs allow (" +
                                        std::to_string(bound) + ")");
      for (size_t s = 0; s < losses[form].size(); ++s) {
        c.expect(losses[form][s] == losses["none"][s], "the loss at step " + std::to_string(s) + " with checkpointing (" +
                                                           form + ") is bitwise the loss without");
      }
    }
    c.expect(std::abs(held["policy"] - held["functional"]) <= live::kNoise,
             "the policy and the functional form hold the same memory between forward and backward (" +
                 std::to_string(held["policy"]) + " and " + std::to_string(held["functional"]) + " bytes)");
  });
}

namespace {
// Linear layers nested two levels down (block -> inner -> a, b), each called through
// checkpointable: the policy picks them inside larger modules (the blocks are not marked).
struct NestedBlockImpl : torch::nn::Module {
  NestedBlockImpl() {
    a = torch::nn::Linear(12, 24);
    b = torch::nn::Linear(24, 12);
    inner = register_module("inner", torch::nn::Sequential());
    inner->push_back("a", a);
    inner->push_back("b", b);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto call = [](const torch::nn::Linear& l, const torch::Tensor& t) {
      auto m = l.ptr();
      return fsdp::checkpointable(*m, [m](const torch::Tensor& in) { return m->forward(in); }, t);
    };
    return x + call(b, torch::relu(call(a, x)));
  }
  torch::nn::Sequential inner{nullptr};
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(NestedBlock);

struct NestedNetImpl : torch::nn::Module {
  NestedNetImpl() {
    b0 = register_module("b0", NestedBlock());
    b1 = register_module("b1", NestedBlock());
    head = register_module("head", torch::nn::Linear(12, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = b1(b0(x));
    auto m = head.ptr();
    return fsdp::checkpointable(*m, [m](const torch::Tensor& in) { return m->forward(in); }, h);
  }
  NestedBlock b0{nullptr}, b1{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(NestedNet);
}  // namespace

CONFORMANCE_CASE(ActivationCheckpoint, PolicyAppliedToNestedModules, 4,
                 "#201: FSDP1 test_fsdp_checkpoint / test_checkpoint_wrapper test_apply_activation_checkpointing") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    std::map<std::string, Run> runs;
    for (const std::string side : {"local", "plain", "checkpointed", "removed"}) {
      torch::manual_seed(36);
      NestedNet mine;
      if (side == "checkpointed" || side == "removed") {
        const int marked = fsdp::apply_activation_checkpointing(*mine, fsdp::checkpoint_modules_of_type<torch::nn::LinearImpl>());
        c.expect(marked == 5, "the policy marks the five Linear layers (" + std::to_string(marked) + ")");
        for (const auto& m : mine->named_modules()) {
          const bool linear = dynamic_cast<torch::nn::LinearImpl*>(m.value().get()) != nullptr;
          c.expect(fsdp::is_checkpointed(*m.value()) == linear,
                   "'" + m.key() + "' is " + (linear ? "" : "not ") + "checkpointed");
        }
        if (side == "removed") {
          fsdp::remove_activation_checkpointing(*mine);
          for (const auto& m : mine->modules()) c.expect(!fsdp::is_checkpointed(*m), "no mark after remove_activation_checkpointing");
        }
      }
      std::unique_ptr<fsdp::FullyShardedDataParallel<NestedNetImpl>> model;
      if (side != "local") {
        fsdp::Options o = v.options;
        o.auto_wrap_policy = fsdp::module_type_policy<NestedBlockImpl>();
        model = std::make_unique<fsdp::FullyShardedDataParallel<NestedNetImpl>>(mine, c.mesh, o);
      }
      torch::optim::SGD optim(model ? model->parameters() : mine->parameters(), kSgd);
      Run run;
      for (int step = 0; step < 6; ++step) {
        const auto x = randn(10000 + step, {8, 12});
        const auto y = randn(10100 + step, {8, 3});
        optim.zero_grad();
        auto loss = model ? torch::mse_loss((*model)(my_rows(c, x)), my_rows(c, y)) : torch::mse_loss(mine->forward(x), y);
        loss.backward();
        // Every checkpointed parameter gets its gradient, every step.
        for (const auto& p : (model ? model->named_parameters() : std::vector<std::pair<std::string, torch::Tensor>>{})) {
          c.expect(p.second.grad().defined(), side + ": " + p.first + " has a gradient at step " + std::to_string(step));
        }
        optim.step();
        run.losses.push_back(model ? global_mean(c, loss.item().toDouble()) : loss.item().toDouble());
      }
      run.whole = model ? whole_state(*model, *mine) : state_of(*mine);
      runs[side] = run;
    }
    expect_runs(c, "Linear layers nested in blocks, checkpointed by a policy", runs["checkpointed"], runs["plain"],
                runs["local"], 1e-5);
    expect_runs(c, "after remove_activation_checkpointing", runs["removed"], runs["plain"], runs["local"], 1e-5);
  });
}

}  // namespace activation_checkpoint
}  // namespace conformance
