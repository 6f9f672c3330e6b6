// What a wrapped model manages: each parameter and buffer once, however often the model registers
// it, units nested in units, and a parameter's storage replaced behind fsdp's back.
#include "conformance.h"

namespace conformance {
namespace managed_state {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

// One Linear registered twice (as "first" and "again"), one buffer registered in two modules, and a
// block whose inner Linear is a unit of its own inside the block's unit.
struct InnerImpl : torch::nn::Module {
  explicit InnerImpl(torch::Tensor shared_scale) {
    fc = register_module("fc", torch::nn::Linear(6, 6));
    scale = register_buffer("scale", shared_scale);
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(fc(x)) * scale; }
  torch::nn::Linear fc{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(Inner);

struct OuterImpl : torch::nn::Module {
  explicit OuterImpl(torch::Tensor shared_scale) {
    inner = register_module("inner", Inner(shared_scale));
    out = register_module("out", torch::nn::Linear(6, 6));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out(inner(x)) + x; }
  Inner inner{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(Outer);

struct RegisteredTwiceImpl : torch::nn::Module {
  RegisteredTwiceImpl() {
    torch::Tensor scale = torch::full({6}, 0.5);
    first = register_module("first", torch::nn::Linear(6, 6));
    again = register_module("again", first);  // the same module under a second name
    outer = register_module("outer", Outer(scale));
    other = register_module("other", Inner(scale));  // the same buffer tensor as outer.inner.scale
  }
  torch::Tensor forward(const torch::Tensor& x) { return other(outer(again(first(x)))); }
  torch::nn::Linear first{nullptr}, again{nullptr};
  Outer outer{nullptr};
  Inner other{nullptr};
};
TORCH_MODULE(RegisteredTwice);

}  // namespace

CONFORMANCE_CASE(ManagedState, ModuleRegisteredTwiceAndNestedUnitsAreManagedOnce, 4,
                 "#268: FSDP2 test_fully_shard_state test_managed_modules_*, test_managed_states_shared_params_and_buffers, "
                 "test_get_param_module_infos_*") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(3);
    RegisteredTwice mine;
    torch::manual_seed(3);
    RegisteredTwice local;
    // The block and its inner module both marked: the inner one is a unit inside the outer's.
    fsdp::fully_shard(*mine->outer);
    fsdp::fully_shard(*mine->outer->inner);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    // Each parameter in exactly one unit, once; the inner unit's parameters not in the outer's.
    std::map<std::string, int> seen;
    std::map<std::string, std::vector<std::string>> by_unit;
    for (const auto& u : model.units()) {
      for (const auto& f : u.fqns) ++seen[f];
      by_unit[u.name] = u.fqns;
    }
    c.expect(model.units().size() == 3, "units: outer.inner, outer and the root (got " + std::to_string(model.units().size()) + ")");
    c.expect(by_unit["outer.inner"] == std::vector<std::string>{"outer.inner.fc.weight", "outer.inner.fc.bias"},
             "the inner unit holds the inner Linear");
    c.expect(by_unit["outer"] == std::vector<std::string>{"outer.out.weight", "outer.out.bias"},
             "the outer unit holds only what the inner unit does not");
    for (const auto& [name, n] : seen) c.expect(n == 1, name + " is in " + std::to_string(n) + " units");
    c.expect(!seen.count("again.weight"), "a module registered twice is managed under its first name only");
    c.expect(model.parameters().size() == unique_parameters(*local).size(),
             "parameters() lists each tensor once (" + std::to_string(model.parameters().size()) + " vs " +
                 std::to_string(unique_parameters(*local).size()) + ")");
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD local_optim(unique_parameters(*local), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 4; ++step) {
      const auto x = randn(10 + step, {8, 6}), y = randn(20 + step, {8, 6});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item<double>()), local_loss.item<double>(), 1e-6);
    }
    // Both names of the module and both names of the buffer, whole, equal to local training's.
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

namespace {
struct TwoLayersImpl : torch::nn::Module {
  TwoLayersImpl() {
    a = register_module("a", torch::nn::Linear(8, 8));
    b = register_module("b", torch::nn::Linear(8, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoLayers);
}  // namespace

CONFORMANCE_CASE(ManagedState, ParameterStorageReplacedBetweenForwardAndBackwardIsRefused, 4,
                 "#124: FSDP1 test_fsdp_use_orig_params test_writeback_between_fwd_and_bwd_for_no_reshard_raises") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(4);
    TwoLayers mine;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    const auto x = randn(30, {8, 8});
    auto loss = model(my_rows(c, x)).square().mean();
    // The user swaps a parameter's storage while the graph that saved it waits for its backward:
    // plain libtorch would backward through the old values and accumulate into the new tensor; under
    // fsdp the unit's gathered parameters and its shard part ways. Refused by name, on every rank.
    c.expect_refused("set_data on a wrapped parameter between forward and backward",
                     [&] {
                       torch::NoGradGuard no_grad;
                       mine->a->weight.set_data(torch::zeros({8, 8}));
                       loss.backward();
                     },
                     {"a.weight", "summon_full_params"});
  });
}

}  // namespace managed_state
}  // namespace conformance
