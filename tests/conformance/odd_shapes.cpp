// Odd shapes: parameters whose sizes divide by no world size (17 x 257, 17, one element, a 0-dim
// scalar), as PyTorch FSDP2's collective tests use them (test_fully_shard_comm), and units smaller
// than hpZ's secondary group (DeepSpeed ZeRO++ test_zeropp): every rank's shard is mostly padding,
// which must never reach a parameter, a gradient or the optimizer.
#include "conformance.h"

namespace conformance {
namespace odd_shapes {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

// A 17 x 257 weight and its 17-element bias: one unit of 4386 elements (4 ranks: 1096.5 each).
struct WideImpl : torch::nn::Module {
  WideImpl() {
    weight = register_parameter("weight", torch::randn({17, 257}) * 0.06);
    bias = register_parameter("bias", torch::randn({17}) * 0.1);
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::addmm(bias, x, weight.t()); }
  torch::Tensor weight, bias;
};
TORCH_MODULE(Wide);

// A one-element gain: a unit of one element, on fewer ranks than any shard group holds.
struct GainImpl : torch::nn::Module {
  GainImpl() { gain = register_parameter("gain", torch::full({1}, 0.8)); }
  torch::Tensor forward(const torch::Tensor& x) { return x * gain; }
  torch::Tensor gain;
};
TORCH_MODULE(Gain);

// [B, 257] -> [B, 3]; the root holds the head (17 x 3 and 3) and a 0-dim temperature.
struct OddNetImpl : torch::nn::Module {
  OddNetImpl() {
    wide = register_module("wide", Wide());
    gain = register_module("gain", Gain());
    head = register_module("head", torch::nn::Linear(17, 3));
    temperature = register_parameter("temperature", torch::tensor(1.5));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::tanh(gain(wide(x)))) * temperature; }
  Wide wide{nullptr};
  Gain gain{nullptr};
  torch::nn::Linear head{nullptr};
  torch::Tensor temperature;
};
TORCH_MODULE(OddNet);

fsdp::WrapPolicy odd_units() { return fsdp::module_type_policy<WideImpl, GainImpl>(); }

// `steps` SGD-with-momentum steps under fsdp and locally; losses every step and the whole
// parameters at the end within `tol`. Returns fsdp's losses and the first step's all-gathered
// bytes, to compare runs with each other.
struct Run {
  std::vector<double> losses;
  int64_t all_gather_bytes = 0;
};
Run odd_parity(Ctx& c, const Variant& v, double tol, int steps = 4) {
  torch::manual_seed(41);
  OddNet mine;
  torch::manual_seed(41);
  OddNet local;
  fsdp::Options o = v.options;
  o.auto_wrap_policy = odd_units();
  fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD optim(model.parameters(), sgd);
  torch::optim::SGD local_optim(unique_parameters(*local), sgd);
  Run run;
  auto& losses = run.losses;
  for (int step = 0; step < steps; ++step) {
    const auto x = randn(3000 + step, {8, 257}), y = randint(3100 + step, 3, {8});
    model.reset_step();
    optim.zero_grad();
    auto loss = torch::cross_entropy_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
    loss.backward();
    optim.step();
    local_optim.zero_grad();
    auto local_loss = torch::cross_entropy_loss(local->forward(x), y);
    local_loss.backward();
    local_optim.step();
    if (step == 0) run.all_gather_bytes = model.metrics().comm.all_gather;
    losses.push_back(global_mean(c, loss.item().toDouble()));
    c.expect_near("loss at step " + std::to_string(step), losses.back(), local_loss.item().toDouble(), tol);
  }
  expect_same_model(c, model, *mine, *local, tol);
  // The shards fsdp hands the optimizer hold no padding: every rank's pieces, over the world,
  // number each element once per replica group.
  int64_t held = 0;
  for (const auto& p : model.parameters()) held += p.numel();
  std::vector<at::Tensor> t{torch::tensor({held}, torch::kLong)};
  c.mesh->world()->allreduce(t)->wait();
  int64_t whole = 0;
  for (const auto& p : unique_parameters(*local)) whole += p.numel();
  const int64_t replicas = c.world / model.shard_size();
  c.expect(t[0].item().toLong() == whole * replicas, "the ranks' shards hold " + std::to_string(t[0].item().toLong()) +
                                                         " elements, not " + std::to_string(whole * replicas));
  return run;
}

}  // namespace

// fp32: 1e-5. bf16 against the fp32 oracle: a 257-long dot product with bf16 operands (2^-9
// relative per rounding) moves the logits, the loss and 4 steps' parameters by about 1e-3
// (measured 6e-4): 5e-3.
CONFORMANCE_CASE(OddShapes, ParametersOfSizesNoWorldDivides, 4,
                 "#282: FSDP2 test_fully_shard_comm test_all_gather_fp32 test_reduce_scatter_fp32 "
                 "test_reduce_scatter_fp16") {
  for_each(c, every_strategy(c, /*bf16=*/true),
           [&](const Variant& v) { odd_parity(c, v, v.mixed_precision() ? 5e-3 : 1e-5); });
}

// hpZ: after forward each unit stays sharded over groups of 2 ranks (of F = 4) instead of 4; the
// one-element unit is smaller than that group, the 17 x 257 one is not a multiple of it. Backward
// gathers from the secondary shards: the same values, so training is bitwise the same as without
// hpZ, and local training's to 1e-5; per unit too (the 0 of a unit turns its secondary shard off).
CONFORMANCE_CASE(OddShapes, HpZWithUnitsSmallerThanTheSecondaryGroup, 4,
                 "#306: DeepSpeed test_zeropp test_zero_hpz_small_param_secondary_shard_without_overlap "
                 "test_zero_hpz_secondary_shard_padding_is_zeroed") {
  for (const bool bf16 : {false, true}) {
    auto plain = every_strategy(c, bf16)[bf16 ? 5 : 0];  // full_shard F=4
    Run without;
    for_each(c, {plain}, [&](const Variant& v) { without = odd_parity(c, v, bf16 ? 5e-3 : 1e-5); });
    Variant hpz = plain, per_unit = plain;
    hpz.options.reshard_after_forward_to = 2;
    hpz.name += " reshard_after_forward_to=2";
    per_unit.options.reshard_after_forward_to_by_unit = {{"gain", 2}, {"wide", 0}};
    per_unit.name += " gain=2 wide=0";
    for_each(c, {hpz, per_unit}, [&](const Variant& v) {
      const auto with = odd_parity(c, v, bf16 ? 5e-3 : 1e-5);
      for (size_t s = 0; s < with.losses.size() && s < without.losses.size(); ++s) {
        c.expect(with.losses[s] == without.losses[s], "the loss at step " + std::to_string(s) +
                                                          " differs from full_shard's (" + std::to_string(with.losses[s]) +
                                                          ", " + std::to_string(without.losses[s]) + ")");
      }
      // Backward gathered from the secondary shards, within pairs of ranks: fewer bytes.
      c.expect(with.all_gather_bytes < without.all_gather_bytes,
               "backward's all-gathers did not use the secondary shards (" + std::to_string(with.all_gather_bytes) +
                   " bytes gathered, " + std::to_string(without.all_gather_bytes) + " without hpZ)");
    });
  }
}

}  // namespace odd_shapes
}  // namespace conformance
