// Structured inputs and outputs (PyTorch FSDP1 test_fsdp_mixed_precision, test_fsdp_input; FSDP2
// test_fully_shard_mixed_precision, test_fully_shard_autograd):
//   an input that requires grad, cast to bf16 by mixed precision, gets its gradient in its own dtype;
//   a forward taking a std::vector or a c10::Dict of tensors, in fp32 and under bf16;
//   a forward taking a struct holding the tensor;
//   units handing each other vectors and dicts of tensors.
#include "conformance.h"

namespace conformance {
namespace structured_io {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

constexpr double kBf16Tol = 2e-2;  // bf16 keeps 8 bits: a few roundings of 0.4 % on the way to a loss of ~1

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t d) {
    fc1 = register_module("fc1", torch::nn::Linear(d, 2 * d));
    fc2 = register_module("fc2", torch::nn::Linear(2 * d, d));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    stem = register_module("stem", torch::nn::Linear(6, 8));
    block = register_module("block", Mlp(8));
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(block(torch::tanh(stem(x)))); }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  Mlp block{nullptr};
};
TORCH_MODULE(Net);

}  // namespace

CONFORMANCE_CASE(StructuredIO, InputThatRequiresGradGetsItsGradientInItsOwnDtype, 4,
                 "#43: FSDP1 test_fsdp_mixed_precision test_input_grads_with_param_mixed_precision") {
  // x.requires_grad_(): under bf16 the wrapper casts x for the model, and backward brings x's
  // gradient back through that cast, in fp32. Each rank's loss is the mean over its rows, so its
  // input gradient is W times local training's (no reduction touches inputs). Under bf16 it is
  // compared with a bf16 copy of the model run on the rank's rows (the same casts: equal within
  // 1e-6) at the first step, before training makes them differ.
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(31);
    Net mine;
    torch::manual_seed(31);
    Net local;
    const bool bf16 = v.mixed_precision();
    Net replay{nullptr};
    if (bf16) {
      torch::manual_seed(31);
      replay = Net();
      replay->to(torch::kBFloat16);
    }
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<MlpImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(local->parameters(), sgd);
    for (int step = 0; step < 3; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const auto x_all = randn(5000 + step, {8, 6});
      const auto y = randint(5100 + step, 3, {8});
      auto x = my_rows(c, x_all).clone().requires_grad_(true);
      optim.zero_grad();
      auto loss = torch::cross_entropy_loss(model(x).to(torch::kFloat), my_rows(c, y));
      loss.backward();
      optim.step();
      auto local_x = x_all.clone().requires_grad_(true);
      local_optim.zero_grad();
      auto local_loss = torch::cross_entropy_loss(local->forward(local_x), y);
      local_loss.backward();
      local_optim.step();
      if (!x.grad().defined()) {
        c.fail("the input has no gradient" + at);
        continue;
      }
      c.expect(x.grad().scalar_type() == torch::kFloat,
               std::string("the input's gradient is ") + c10::toString(x.grad().scalar_type()) + at);
      if (!bf16) {
        expect_same_tensor(c, "the input's gradient" + at, x.grad(), my_rows(c, local_x.grad()) * c.world, 1e-5);
      } else if (step == 0) {
        auto rx = my_rows(c, x_all).clone().requires_grad_(true);
        auto replay_loss = torch::cross_entropy_loss(replay->forward(rx.to(torch::kBFloat16)).to(torch::kFloat),
                                                     my_rows(c, y));
        replay_loss.backward();
        expect_same_tensor(c, "the input's gradient against the bf16 replay" + at, x.grad(), rx.grad(), 1e-6);
      }
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(),
                    bf16 ? kBf16Tol : 1e-5);
    }
    expect_same_model(c, model, *mine, *local, bf16 ? kBf16Tol : 1e-5);
  });
}

namespace {
// Forwards taking a container of tensors (FSDP1 test_fsdp_input test_input_type).
struct ListInputImpl : torch::nn::Module {
  ListInputImpl() {
    a = register_module("a", torch::nn::Linear(6, 8));
    b = register_module("b", torch::nn::Linear(6, 8));
    block = register_module("block", Mlp(8));
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(std::vector<torch::Tensor> xs) { return head(block(torch::tanh(a(xs[0]) + b(xs[1])))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, head{nullptr};
  Mlp block{nullptr};
};
TORCH_MODULE(ListInput);

struct DictInputImpl : ListInputImpl {
  torch::Tensor forward(const c10::Dict<std::string, torch::Tensor>& in) {
    return ListInputImpl::forward({in.at("x"), in.at("z")});
  }
};
TORCH_MODULE(DictInput);

// Trains `Net` (whose forward takes what `make_input(x, z, wrapped)` makes) against local training.
template <typename Net, typename MakeInput>
void train_container_input(Ctx& c, const Variant& v, MakeInput&& make_input) {
  torch::manual_seed(32);
  Net mine;
  torch::manual_seed(32);
  Net local;
  fsdp::Options o = v.options;
  o.auto_wrap_policy = fsdp::module_type_policy<MlpImpl>();
  fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD optim(model.parameters(), sgd);
  torch::optim::SGD local_optim(local->parameters(), sgd);
  const double tol = v.mixed_precision() ? kBf16Tol : 1e-5;
  for (int step = 0; step < 4; ++step) {
    const std::string at = " at step " + std::to_string(step);
    const auto x = randn(5200 + step, {8, 6}), z = randn(5300 + step, {8, 6});
    const auto y = randint(5400 + step, 3, {8});
    // The peer's inputs require grad.
    auto mx = my_rows(c, x).clone().requires_grad_(true), mz = my_rows(c, z).clone().requires_grad_(true);
    optim.zero_grad();
    auto loss = torch::cross_entropy_loss(model(make_input(mx, mz, true)).to(torch::kFloat), my_rows(c, y));
    loss.backward();
    optim.step();
    c.expect(mx.grad().defined() && mz.grad().defined(), "the inputs have no gradient" + at);
    local_optim.zero_grad();
    auto local_loss = torch::cross_entropy_loss(local->forward(make_input(x, z, false)), y);
    local_loss.backward();
    local_optim.step();
    c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), tol);
  }
  expect_same_model(c, model, *mine, *local, tol);
}
}  // namespace

CONFORMANCE_CASE(StructuredIO, ForwardTakingAVectorOfTensors, 2, "#136: FSDP1 test_fsdp_input test_input_type (list)") {
  // Under bf16 the wrapper casts the floating-point tensors inside the vector, as PyTorch casts
  // the tensors inside a list.
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    train_container_input<ListInput>(
        c, v, [](const torch::Tensor& x, const torch::Tensor& z, bool) { return std::vector<torch::Tensor>{x, z}; });
  });
}

CONFORMANCE_CASE(StructuredIO, ForwardTakingADictOfTensors, 2, "#136: FSDP1 test_fsdp_input test_input_type (dict)") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    train_container_input<DictInput>(c, v, [](const torch::Tensor& x, const torch::Tensor& z, bool) {
      c10::Dict<std::string, torch::Tensor> d;
      d.insert("x", x);
      d.insert("z", z);
      return d;
    });
  });
}

namespace {
// FSDP2 test_dataclass_input: the tensor inside the caller's own type.
struct MyInput {
  torch::Tensor x;
  double scale = 1.0;
};
struct StructInputImpl : NetImpl {
  torch::Tensor forward(const MyInput& in) { return NetImpl::forward(in.x * in.scale); }
};
TORCH_MODULE(StructInput);
}  // namespace

CONFORMANCE_CASE(StructuredIO, ForwardTakingAStructHoldingTheTensor, 2,
                 "#240: FSDP2 test_fully_shard_mixed_precision test_dataclass_input") {
  // In fp32 it trains as local training does. Under bf16 the wrapper cannot see inside the
  // caller's type: the fp32 tensor meets the unit's bf16 parameters, and fsdp says so by name,
  // with what to do (cast it to param_dtype), instead of libtorch's dtype error; done so, it trains.
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    const bool bf16 = v.mixed_precision();
    if (bf16) {
      torch::manual_seed(33);
      StructInput mine;
      fsdp::Options o = v.options;
      o.auto_wrap_policy = fsdp::module_type_policy<MlpImpl>();
      fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
      c.expect_refused("an fp32 tensor inside a struct under bf16 mixed precision",
                       [&] { model(MyInput{randn(5500, {4, 6}), 0.5}); },
                       {"fsdp", "Float", "BFloat16", "param_dtype", ".to("});
    }
    train_container_input<StructInput>(c, v, [bf16](const torch::Tensor& x, const torch::Tensor& z, bool wrapped) {
      // The caller's cast, for the wrapped model under bf16 (local training runs in fp32).
      return MyInput{bf16 && wrapped ? (x + z).to(torch::kBFloat16) : x + z, 0.5};
    });
  });
}

namespace {
// Units handing each other a std::vector and a c10::Dict of tensors (FSDP2 test_nontensor_activations).
struct SplitImpl : torch::nn::Module {
  SplitImpl() {
    l1 = register_module("l1", torch::nn::Linear(8, 8));
    l2 = register_module("l2", torch::nn::Linear(8, 8));
  }
  std::vector<torch::Tensor> forward(const std::vector<torch::Tensor>& in) {
    return {torch::tanh(l1(in[0])), torch::tanh(l2(in[1])) + in[0]};
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr};
};
TORCH_MODULE(Split);

struct DictBlockImpl : torch::nn::Module {
  DictBlockImpl() {
    a = register_module("a", torch::nn::Linear(8, 8));
    b = register_module("b", torch::nn::Linear(8, 8));
  }
  c10::Dict<std::string, torch::Tensor> forward(const c10::Dict<std::string, torch::Tensor>& in) {
    c10::Dict<std::string, torch::Tensor> out;
    out.insert("h", torch::tanh(a(in.at("h"))) + in.at("g"));
    out.insert("g", torch::tanh(b(in.at("g"))));
    return out;
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(DictBlock);

struct NonTensorActivationsImpl : torch::nn::Module {
  NonTensorActivationsImpl() {
    stem = register_module("stem", torch::nn::Linear(6, 8));
    split = register_module("split", Split());
    block = register_module("block", DictBlock());
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor stem_out(const torch::Tensor& x) { return torch::relu(stem(x)); }
  torch::Tensor rest(const torch::Tensor& h) {
    auto v = split(std::vector<torch::Tensor>{h, h * 0.5});
    c10::Dict<std::string, torch::Tensor> d;
    d.insert("h", v[0]);
    d.insert("g", v[1]);
    auto o = block(d);
    return head(o.at("h") + o.at("g"));
  }
  torch::nn::Linear stem{nullptr}, head{nullptr};
  Split split{nullptr};
  DictBlock block{nullptr};
};
TORCH_MODULE(NonTensorActivations);
}  // namespace

CONFORMANCE_CASE(StructuredIO, UnitsHandEachOtherVectorsAndDictsOfTensors, 4,
                 "#259: FSDP2 test_fully_shard_autograd test_nontensor_activations") {
  // The model's forward is the caller's lambda (forward_with), which casts nothing: under bf16
  // the caller casts the input to param_dtype; left in fp32 it is refused by name.
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    const bool bf16 = v.mixed_precision();
    torch::manual_seed(34);
    NonTensorActivations mine;
    torch::manual_seed(34);
    NonTensorActivations local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<SplitImpl, DictBlockImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    if (bf16) {
      c.expect_refused("an fp32 input to forward_with under bf16 mixed precision",
                       [&] { model.forward_with([&] { return mine->rest(mine->stem_out(randn(5600, {4, 6}))); }); },
                       {"fsdp", "Float", "BFloat16", "param_dtype", ".to("});
    }
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(local->parameters(), sgd);
    const double tol = bf16 ? kBf16Tol : 1e-5;
    for (int step = 0; step < 4; ++step) {
      const std::string at = " at step " + std::to_string(step);
      const auto x = randn(5700 + step, {8, 6});
      const auto y = randint(5800 + step, 3, {8});
      optim.zero_grad();
      auto out = model.forward_with([&] {
        auto in = my_rows(c, x);
        return mine->rest(mine->stem_out(bf16 ? in.to(torch::kBFloat16) : in));
      });
      auto loss = torch::cross_entropy_loss(out.to(torch::kFloat), my_rows(c, y));
      loss.backward();
      c.expect(model.metrics().memory.unsharded_current == 0, "gathered parameters left after the backward" + at);
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::cross_entropy_loss(local->rest(local->stem_out(x)), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss" + at, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), tol);
    }
    expect_same_model(c, model, *mine, *local, tol);
  });
}

}  // namespace structured_io
}  // namespace conformance
