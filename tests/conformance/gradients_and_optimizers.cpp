// What a user does to gradients and optimizers around fsdp (PyTorch FSDP1 test_fsdp_freezing_weights,
// test_fsdp_use_orig_params; FSDP2 test_fully_shard_autograd):
//   the gradients of one unit set to None between backward and step;
//   a gradient replaced, scaled in place or dropped, then accumulated onto by the next backward;
//   hooks registered on parameters (before and after wrapping), one of them changing the gradient;
//   two optimizers over the weights and the biases, only one of them setting gradients to None;
//   an optimizer built from the model's parameters before wrapping.
// Gradients are compared where they live: this rank's shard of each parameter against the same
// elements of local training's gradient.
#include "conformance.h"

namespace conformance {
namespace gradients_and_optimizers {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t d) {
    in_proj = register_module("in_proj", torch::nn::Linear(d, 2 * d));
    out_proj = register_module("out_proj", torch::nn::Linear(2 * d, d));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + out_proj(torch::tanh(in_proj(x))); }
  torch::nn::Linear in_proj{nullptr}, out_proj{nullptr};
};
TORCH_MODULE(Mlp);

// A stem and a head in the root unit, two MLP units between them.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    stem = register_module("stem", torch::nn::Linear(6, 12));
    blocks = register_module("blocks", torch::nn::Sequential(Mlp(12), Mlp(12)));
    head = register_module("head", torch::nn::Linear(12, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(blocks->forward(torch::relu(stem(x)))); }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  torch::nn::Sequential blocks{nullptr};
};
TORCH_MODULE(Net);

fsdp::Options wrap_options(const Variant& v) {
  fsdp::Options o = v.options;
  o.auto_wrap_policy = fsdp::module_type_policy<MlpImpl>();
  return o;
}

torch::Tensor loss_of(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::cross_entropy_loss(out.to(torch::kFloat), y);
}

// Which elements of each whole parameter this rank's shard holds: [begin, begin + numel) of the
// flattened parameter. Read at rest, right after wrapping.
using Layout = std::map<std::string, std::pair<int64_t, int64_t>>;
Layout layout_of(fsdp::FullyShardedDataParallelBase& model) {
  Layout out;
  for (const auto& [name, piece] : fsdp::sharded_state_dict(model)) out[name] = {piece.flat_begin, piece.local.numel()};
  return out;
}

// This rank's gradient of every parameter against the same elements of local training's: both
// undefined, or equal within tol.
void expect_same_shard_grads(Ctx& c, fsdp::FullyShardedDataParallelBase& model, const Layout& layout,
                             torch::nn::Module& local, double tol, const std::string& when) {
  std::map<std::string, torch::Tensor> local_params;
  for (const auto& p : local.named_parameters(true)) local_params[p.key()] = p.value();
  for (const auto& [name, p] : model.named_parameters()) {
    const auto lg = local_params.at(name).grad();
    const auto g = p.grad();
    const auto [begin, numel] = layout.at(name);
    if (!lg.defined()) {
      if (g.defined()) c.fail(when + ": " + name + " has a gradient under fsdp and none in local training");
      continue;
    }
    if (numel == 0) continue;  // none of its elements on this rank
    if (!g.defined()) {
      c.fail(when + ": " + name + " has no gradient under fsdp but one in local training");
      continue;
    }
    expect_same_tensor(c, when + ": the gradient of " + name, g.reshape(-1),
                       lg.reshape(-1).narrow(0, begin, numel), tol);
  }
}

}  // namespace

CONFORMANCE_CASE(GradientsAndOptimizers, GradientsOfOneUnitSetToNoneBeforeTheStep, 4,
                 "#99: FSDP1 test_fsdp_freezing_weights test_freezing_weights (FreezingMethod.GradToNone)") {
  // After backward the user drops the gradients of the first block (this rank's shards), then
  // steps: SGD leaves those parameters (and their momentum) alone; the next backward makes new
  // gradients for them.
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(11);
    Net mine;
    torch::manual_seed(11);
    Net local;
    fsdp::FullyShardedDataParallel model(mine, c.mesh, wrap_options(v));
    const Layout layout = layout_of(model);
    const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    const bool bf16 = v.mixed_precision();
    const double tol = bf16 ? 2e-2 : 1e-5;  // bf16: 8 bits kept, a few roundings on the way to a loss of ~1
    for (int step = 0; step < 5; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const auto x = randn(2000 + step, {8, 6});
      const auto y = randint(2100 + step, 3, {8});
      optim.zero_grad();
      auto loss = loss_of(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      local_optim.zero_grad();
      auto local_loss = loss_of(local->forward(x), y);
      local_loss.backward();
      if (!bf16) expect_same_shard_grads(c, model, layout, *local, 1e-5, "after the backward" + at);
      if (step % 2 == 0) {
        for (auto& p : mine->blocks[0]->parameters()) p.mutable_grad().reset();
        for (auto& p : local->blocks[0]->parameters()) p.mutable_grad().reset();
      }
      optim.step();
      local_optim.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), tol);
    }
    expect_same_model(c, model, *mine, *local, tol);
  });
}

CONFORMANCE_CASE(GradientsAndOptimizers, GradientReplacedScaledOrDroppedThenAccumulatedOnto, 4,
                 "#123: FSDP1 test_fsdp_use_orig_params test_grad_writeback") {
  // After the first backward the user replaces one gradient by 2 (a new tensor), doubles another
  // in place (as through .data), drops a third, and steps; the next backwards run without
  // zero_grad, so they accumulate onto what the user wrote.
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(12);
    Net mine;
    torch::manual_seed(12);
    Net local;
    fsdp::FullyShardedDataParallel model(mine, c.mesh, wrap_options(v));
    const Layout layout = layout_of(model);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    for (int step = 0; step < 4; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const auto x = randn(2200 + step, {8, 6});
      const auto y = randint(2300 + step, 3, {8});
      auto loss = loss_of(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      auto local_loss = loss_of(local->forward(x), y);
      local_loss.backward();
      expect_same_shard_grads(c, model, layout, *local, 1e-5, "after the backward" + at);
      if (step == 0) {
        for (Net* n : {&mine, &local}) {
          auto& net = **n;
          net.stem->weight.mutable_grad() = torch::ones_like(net.stem->weight) * 2;
          net.blocks[1]->as<MlpImpl>()->in_proj->bias.grad().mul_(2);
          net.head->weight.mutable_grad().reset();
        }
        expect_same_shard_grads(c, model, layout, *local, 1e-5, "after the user's edits" + at);
      }
      optim.step();
      local_optim.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

CONFORMANCE_CASE(GradientsAndOptimizers, GradientHooksOnParametersFireOncePerBackward, 4,
                 "#260: FSDP2 test_fully_shard_autograd test_post_acc_grad_hook_runs (C++: Tensor::register_hook on "
                 "parameters)") {
  // A hook doubling the gradient of one block's weight, registered before wrapping, and a
  // counting hook on every parameter, registered after: each fires once per backward, and the
  // reduced gradients are those of local training with the same hooks.
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(13);
    Net mine;
    torch::manual_seed(13);
    Net local;
    const auto twice = [](const torch::Tensor& g) { return g * 2; };
    mine->blocks[1]->as<MlpImpl>()->in_proj->weight.register_hook(twice);
    local->blocks[1]->as<MlpImpl>()->in_proj->weight.register_hook(twice);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, wrap_options(v));
    const Layout layout = layout_of(model);
    std::map<std::string, int> fired, local_fired;
    for (auto& [name, p] : model.named_parameters()) {
      p.register_hook([&fired, n = name](const torch::Tensor&) { ++fired[n]; });
    }
    for (const auto& p : local->named_parameters(true)) {
      p.value().register_hook([&local_fired, n = p.key()](const torch::Tensor&) { ++local_fired[n]; });
    }
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    const bool bf16 = v.mixed_precision();
    const double tol = bf16 ? 2e-2 : 1e-5;  // as above
    for (int step = 0; step < 4; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const auto x = randn(2400 + step, {8, 6});
      const auto y = randint(2500 + step, 3, {8});
      fired.clear();
      local_fired.clear();
      optim.zero_grad();
      auto loss = loss_of(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      local_optim.zero_grad();
      auto local_loss = loss_of(local->forward(x), y);
      local_loss.backward();
      for (const auto& [name, n] : local_fired) {
        const int got = fired.count(name) ? fired.at(name) : 0;
        if (got != n) {
          c.fail("the hook on " + name + " fired " + std::to_string(got) + " times in the backward" + at + ", " +
                 std::to_string(n) + " in local training");
        }
      }
      if (!bf16) expect_same_shard_grads(c, model, layout, *local, 1e-5, "after the backward" + at);
      optim.step();
      local_optim.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), tol);
    }
    expect_same_model(c, model, *mine, *local, tol);
  });
}

namespace {
bool is_bias(const std::string& name) { return name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0; }

std::vector<torch::Tensor> select(const std::vector<std::pair<std::string, torch::Tensor>>& params, bool biases) {
  std::vector<torch::Tensor> out;
  for (const auto& [name, p] : params) {
    if (is_bias(name) == biases) out.push_back(p);
  }
  return out;
}
std::vector<std::pair<std::string, torch::Tensor>> named(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : m.named_parameters(true)) out.emplace_back(p.key(), p.value());
  return out;
}
}  // namespace

CONFORMANCE_CASE(GradientsAndOptimizers, TwoOptimizersOnlyOneSettingGradientsToNone, 4,
                 "#118: FSDP1 test_fsdp_use_orig_params test_multiple_optimizers") {
  // Adam over the weights, AdamW over the biases of the same units. Only the first optimizer's
  // zero_grad(set_to_none) runs, before some steps: the biases' gradients accumulate from the
  // start, the weights' are None (Adam takes no step, its step count stays) where dropped. Adam
  // moves a parameter by about lr whatever its gradient's size: these gradients are far from zero.
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(14);
    Net mine;
    torch::manual_seed(14);
    Net local;
    fsdp::FullyShardedDataParallel model(mine, c.mesh, wrap_options(v));
    const Layout layout = layout_of(model);
    torch::optim::Adam weights(select(model.named_parameters(), false), torch::optim::AdamOptions(5e-3));
    torch::optim::AdamW biases(select(model.named_parameters(), true), torch::optim::AdamWOptions(1e-2));
    torch::optim::Adam local_weights(select(named(*local), false), torch::optim::AdamOptions(5e-3));
    torch::optim::AdamW local_biases(select(named(*local), true), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 5; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const auto x = randn(2600 + step, {8, 6});
      const auto y = randint(2700 + step, 3, {8});
      if (step % 2 == 1) {
        weights.zero_grad(true);
        local_weights.zero_grad(true);
      }
      auto out = model(my_rows(c, x));
      auto local_out = local->forward(x);
      // Between forward and backward: None for dropped weights, the accumulated sums for biases.
      expect_same_shard_grads(c, model, layout, *local, 1e-5, "after the forward" + at);
      auto loss = loss_of(out, my_rows(c, y));
      loss.backward();
      auto local_loss = loss_of(local_out, y);
      local_loss.backward();
      expect_same_shard_grads(c, model, layout, *local, 1e-5, "after the backward" + at);
      weights.step();
      biases.step();
      local_weights.step();
      local_biases.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 2e-5);
  });
}

CONFORMANCE_CASE(GradientsAndOptimizers, OptimizerBuiltBeforeWrapping, 4,
                 "#115: FSDP1 test_fsdp_use_orig_params test_diff_hyperparams (init_optim_before_wrap=True)") {
  // AdamW with a group for the weights and one for the biases (different lr and weight decay),
  // built from the model's own parameters before wrapping: wrapping shards those very tensors, so
  // the optimizer steps the shards. zero_grad alternates before forward and before backward, to
  // zeros and to None.
  std::vector<Variant> variants;
  for (const bool to_none : {false, true}) {
    for (auto v : every_strategy(c)) {
      v.name += to_none ? " zero_grad to None" : " zero_grad to zeros";
      variants.push_back(v);
    }
  }
  for_each(c, variants, [&](const Variant& v) {
    const bool to_none = v.name.find("None") != std::string::npos;
    torch::manual_seed(15);
    Net mine;
    torch::manual_seed(15);
    Net local;
    const auto groups = [](torch::nn::Module& m) {
      std::vector<torch::optim::OptimizerParamGroup> g;
      g.emplace_back(select(named(m), false), std::make_unique<torch::optim::AdamWOptions>(
                                                   torch::optim::AdamWOptions(1e-2).weight_decay(0.1)));
      g.emplace_back(select(named(m), true), std::make_unique<torch::optim::AdamWOptions>(
                                                  torch::optim::AdamWOptions(1e-3).weight_decay(0.01)));
      return g;
    };
    torch::optim::AdamW optim(groups(*mine), torch::optim::AdamWOptions(5e-3));
    fsdp::FullyShardedDataParallel model(mine, c.mesh, wrap_options(v));
    torch::optim::AdamW local_optim(groups(*local), torch::optim::AdamWOptions(5e-3));
    for (int step = 0; step < 5; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const auto x = randn(2800 + step, {8, 6});
      const auto y = randint(2900 + step, 3, {8});
      if (step % 2 == 0) optim.zero_grad(to_none);
      auto out = model(my_rows(c, x));
      if (step % 2 == 1) optim.zero_grad(to_none);
      auto loss = loss_of(out, my_rows(c, y));
      loss.backward();
      optim.step();
      local_optim.zero_grad(to_none);
      auto local_loss = loss_of(local->forward(x), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 2e-5);
  });
}

}  // namespace gradients_and_optimizers
}  // namespace conformance
