// Parameter dtypes and mixed precision, as the peers test them (FSDP1 test_fsdp_mixed_precision,
// test_fsdp_pure_fp16, test_fsdp_clip_grad_norm, test_fsdp_sharded_grad_scaler; FSDP2
// test_fully_shard_mixed_precision): reduce-only mixed precision, three different dtypes, an fp64
// model, a whole bf16 or fp16 model without mixed precision, a bf16-built model under bf16 mixed
// precision, world size 1, low-precision gradients clipped, clipping without gradients, the fp16
// gradient scaler, micro-batches accumulated under a reduce dtype, and the EMA train/eval flow.
//
// The oracle under mixed precision is local training that replays fsdp's casts (CastReplay): a
// master copy in the parameters' own dtype, stepped by the same optimizer, and a working copy in
// param_dtype that runs each rank's rows apart; each rank's gradients are cast to reduce_dtype,
// divided by W (before summing when reduce_dtype differs from the master dtype, after otherwise),
// summed over the ranks and cast back. What is left between fsdp and the replay is the order of
// the sum over ranks (a ring, or a reduce-scatter then an all-reduce across replicas): at W = 1
// nothing, else a few roundings of reduce_dtype per gradient element (tolerances by case below).
#include <set>

#include "conformance.h"
#include "fsdp/grad_scaler.h"

namespace conformance {
namespace mixed_precision {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

// A residual block of two Linears, a unit of its own.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d) {
    a = register_module("a", torch::nn::Linear(d, d));
    b = register_module("b", torch::nn::Linear(d, d));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + b(torch::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Block);

// 8 features -> 4 outputs; the root unit holds the first and last Linear.
struct MLPImpl : torch::nn::Module {
  MLPImpl() {
    in = register_module("in", torch::nn::Linear(8, 16));
    b0 = register_module("b0", Block(16));
    b1 = register_module("b1", Block(16));
    out = register_module("out", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out(b1(b0(torch::tanh(in(x))))); }
  torch::nn::Linear in{nullptr}, out{nullptr};
  Block b0{nullptr}, b1{nullptr};
};
TORCH_MODULE(MLP);

fsdp::WrapPolicy blocks() { return fsdp::module_type_policy<BlockImpl>(); }

torch::Tensor batch_x(int step) { return randn(2000 + static_cast<uint64_t>(step), {16, 8}); }
torch::Tensor batch_y(int step) { return randn(2100 + static_cast<uint64_t>(step), {16, 4}); }

// The loss a user writes: mean squared error of the outputs, taken in the targets' dtype.
torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out.to(y.scalar_type()), y); }

// fsdp's mixed precision replayed on one process (see the top of the file).
template <typename Net>
class CastReplay {
 public:
  CastReplay(Net master, Net work, fsdp::MixedPrecision mp, int world)
      : master_(std::move(master)), work_(std::move(work)), mp_(mp), world_(world),
        m_(unique_parameters(*master_)), w_(unique_parameters(*work_)) {
    torch::NoGradGuard no_grad;
    for (auto& b : work_->buffers(true)) {
      if (b.defined() && at::isFloatingType(b.scalar_type())) b.set_data(b.to(mp_.buffer_dtype));
    }
  }
  Net& master() { return master_; }
  std::vector<torch::Tensor> params() const { return m_; }

  // Rank r's micro-batch k: micro(work, r, k) returns the loss it backwards (its share of the
  // rank's mean). All but the last micro-batch accumulate in the master dtype, as fsdp's no_sync
  // does; `scale` multiplies each loss before backward (the gradient scaler). Leaves the reduced
  // gradients in the master copy's .grad and returns the mean over ranks of their summed losses.
  template <typename Fn>
  double backward(Fn&& micro, int micro_batches = 1, double scale = 1.0) {
    const auto master_dtype = m_[0].scalar_type();
    const bool low = mp_.reduce_dtype != master_dtype;
    std::vector<torch::Tensor> sum(m_.size());
    double loss = 0;
    for (int r = 0; r < world_; ++r) {
      {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < m_.size(); ++i) {
          w_[i].set_data(m_[i].detach().to(mp_.param_dtype));
          w_[i].mutable_grad().reset();
        }
      }
      std::vector<torch::Tensor> acc(m_.size());
      for (int k = 0; k < micro_batches; ++k) {
        auto l = micro(work_, r, k);
        loss += l.item().toDouble();
        (scale == 1.0 ? l : l * scale).backward();
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < m_.size(); ++i) {
          auto g = w_[i].grad();
          if (!g.defined() || (k + 1 == micro_batches && !acc[i].defined())) continue;
          acc[i] = acc[i].defined() ? acc[i] + g.to(master_dtype) : g.to(master_dtype);
          w_[i].mutable_grad().reset();
        }
      }
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < m_.size(); ++i) {
        auto g = acc[i].defined() ? acc[i] : w_[i].grad();
        if (!g.defined()) continue;
        auto part = g.to(mp_.reduce_dtype);
        if (low) part = part / world_;
        sum[i] = sum[i].defined() ? sum[i] + part : part;
      }
    }
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < m_.size(); ++i) {
      if (!sum[i].defined()) {
        m_[i].mutable_grad().reset();
        continue;
      }
      auto g = (low ? sum[i] : sum[i] / world_).to(master_dtype);
      if (mp_.keep_low_precision_grads) g = g.to(mp_.param_dtype);
      m_[i].mutable_grad() = g;
    }
    return loss / world_;
  }

  // Clips the master's gradients as fsdp does: the global norm from the squares in fp32, the
  // coefficient cast to each gradient's dtype. Returns the norm.
  double clip(double max_norm) {
    torch::NoGradGuard no_grad;
    auto sumsq = torch::zeros({1});
    for (const auto& p : m_) {
      if (p.grad().defined()) sumsq.add_(p.grad().to(torch::kFloat).pow(2).sum());
    }
    const auto total = sumsq.sqrt();
    const auto coef = torch::clamp_max(max_norm / (total + 1e-6), 1.0);
    for (const auto& p : m_) {
      if (p.grad().defined()) p.grad().mul_(coef.to(p.grad().scalar_type()));
    }
    return total.item().toDouble();
  }

 private:
  Net master_, work_;
  fsdp::MixedPrecision mp_;
  int world_;
  std::vector<torch::Tensor> m_, w_;
};

// The dtypes fsdp handed the backend for the units' collectives of the step so far (since
// reset_step()): all-gathers, and the gradients' reduce-scatters and all-reduces.
struct CommDtypes {
  std::set<std::string> gather, reduce;
};
CommDtypes comm_dtypes(const fsdp::FullyShardedDataParallelBase& model) {
  CommDtypes d;
  for (const auto& s : model.timeline()) {
    if (s.unit < 0) continue;
    if (s.kind == fsdp::SpanKind::ALL_GATHER) d.gather.insert(s.dtype);
    if (s.kind == fsdp::SpanKind::REDUCE_SCATTER || s.kind == fsdp::SpanKind::ALL_REDUCE) d.reduce.insert(s.dtype);
  }
  return d;
}
std::string joined(const std::set<std::string>& s) {
  std::string out;
  for (const auto& x : s) out += (out.empty() ? "" : ",") + x;
  return "{" + out + "}";
}
// `got` is `want`, or empty where the strategy has no such collective (F = 1 gathers nothing).
void expect_dtypes(Ctx& c, const std::string& what, const std::set<std::string>& got, const std::string& want) {
  c.expect(got.empty() || got == std::set<std::string>{want}, what + " ran in " + joined(got) + ", not " + want);
}

void expect_dtype(Ctx& c, const std::string& what, const torch::Tensor& t, c10::ScalarType want) {
  c.expect(t.defined() && t.scalar_type() == want, what + " is " +
                                                      (t.defined() ? std::string(c10::toString(t.scalar_type())) : "undefined") +
                                                      ", not " + c10::toString(want));
}

// Variants: every strategy (W = 4: full_shard, shard_grad_op, no_shard, hybrid_shard and
// hybrid_shard_zero2 with F = 2) under `mp`.
std::vector<Variant> with_mp(const Ctx& c, const fsdp::MixedPrecision& mp, const std::string& tag) {
  auto vs = every_strategy(c);
  for (auto& v : vs) {
    v.options.mixed_precision = mp;
    v.name += " " + tag;
  }
  return vs;
}

// Trains `mine` under fsdp and the replay for `steps` SGD-with-momentum steps on the MLP's
// batches; compares losses every step and the whole parameters at the end against `tol`, and
// checks each step's collectives, parameters and gradients for the dtypes given.
struct Dtypes {
  std::string gather, reduce;
  c10::ScalarType param, grad;
};
void replay_parity(Ctx& c, const Variant& v, const Dtypes& want, double tol, int steps = 3,
                   c10::ScalarType master = torch::kFloat) {
  torch::manual_seed(21);
  MLP mine;
  torch::manual_seed(21);
  MLP ref;
  torch::manual_seed(21);
  MLP work;
  if (master != torch::kFloat) {
    mine->to(master);
    ref->to(master);
  }
  fsdp::Options o = v.options;
  o.auto_wrap_policy = blocks();
  fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
  CastReplay<MLP> replay(ref, work, *o.mixed_precision, c.world);
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD optim(model.parameters(), sgd);
  torch::optim::SGD ref_optim(replay.params(), sgd);
  for (int step = 0; step < steps; ++step) {
    // The inputs in the model's dtype; the targets (and the loss) in fp32 for a low-precision model.
    const auto x = batch_x(step).to(master);
    const auto y = batch_y(step).to(at::isReducedFloatingType(master) ? torch::kFloat : master);
    model.reset_step();
    optim.zero_grad();
    auto loss = mse(model(my_rows(c, x)), my_rows(c, y));
    loss.backward();
    for (const auto& p : model.parameters()) {
      expect_dtype(c, "a parameter", p, want.param);
      expect_dtype(c, "a gradient", p.grad(), want.grad);
    }
    optim.step();
    const auto d = comm_dtypes(model);
    expect_dtypes(c, "the all-gathers", d.gather, want.gather);
    expect_dtypes(c, "the gradients' reductions", d.reduce, want.reduce);
    ref_optim.zero_grad();
    const int64_t per = x.size(0) / c.world;
    const double ref_loss = replay.backward([&](MLP& w, int r, int) {
      return mse(w->forward(x.narrow(0, r * per, per).to(o.mixed_precision->param_dtype)), y.narrow(0, r * per, per));
    });
    ref_optim.step();
    c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()), ref_loss, tol);
  }
  expect_same_model(c, model, *mine, *replay.master(), tol);
}

}  // namespace

// Reduce-only: parameters gathered and computed in fp32, gradients reduced in bf16. The replay
// differs from fsdp only in the order of the bf16 sum over 4 ranks: a few bf16 roundings (2^-9
// relative) of gradients of magnitude <= 0.5, times lr 0.05 over 3 steps with momentum: < 1e-3.
CONFORMANCE_CASE(MixedPrecision, ReduceOnlyInBF16, 4,
                 "#34 #234: FSDP1 test_fsdp_mixed_precision test_mixed_precision_e2e_full_shard[mp_only_reduce]; "
                 "FSDP2 test_fully_shard_mixed_precision test_reduce_dtype") {
  const fsdp::MixedPrecision mp{torch::kFloat, torch::kBFloat16, torch::kFloat, false};
  for_each(c, with_mp(c, mp, "reduce bf16"), [&](const Variant& v) {
    replay_parity(c, v, {"fp32", "bf16", torch::kFloat, torch::kFloat}, 1e-3);
  });
}

namespace {
// A buffer the user's forward reads (cast to the computation's dtype, as it must be once
// buffer_dtype and param_dtype differ).
struct ShiftedMLPImpl : torch::nn::Module {
  ShiftedMLPImpl() {
    net = register_module("net", MLP());
    shift = register_buffer("shift", torch::linspace(-0.5, 0.5, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    logits_dtype = x.scalar_type();
    auto out = net(x + shift.to(x.scalar_type()));
    logits_dtype = out.scalar_type();
    return out;
  }
  MLP net{nullptr};
  torch::Tensor shift;
  c10::ScalarType logits_dtype = torch::kFloat;
};
TORCH_MODULE(ShiftedMLP);
}  // namespace

// Parameters in fp16, reductions in fp32, buffers in bf16. The replay computes in fp16 exactly as
// fsdp does; the reductions' fp32 sums differ in order only: 1e-5.
CONFORMANCE_CASE(MixedPrecision, ParamsReduceAndBuffersInThreeDtypes, 4,
                 "#35: FSDP1 test_fsdp_mixed_precision test_mixed_precision_e2e_full_shard[mp_diff_buffer_reduce]") {
  const fsdp::MixedPrecision mp{torch::kHalf, torch::kFloat, torch::kBFloat16, false};
  for_each(c, with_mp(c, mp, "fp16/fp32/bf16"), [&](const Variant& v) {
    torch::manual_seed(22);
    ShiftedMLP mine;
    torch::manual_seed(22);
    ShiftedMLP ref;
    torch::manual_seed(22);
    ShiftedMLP work;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = blocks();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    expect_dtype(c, "the buffer", mine->shift, torch::kBFloat16);
    CastReplay<ShiftedMLP> replay(ref, work, mp, c.world);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD ref_optim(replay.params(), sgd);
    for (int step = 0; step < 3; ++step) {
      const auto x = batch_x(step), y = batch_y(step);
      model.reset_step();
      optim.zero_grad();
      auto loss = mse(model(my_rows(c, x)), my_rows(c, y));
      c.expect(mine->logits_dtype == torch::kHalf, "the outputs are in param_dtype (fp16)");
      loss.backward();
      for (const auto& p : model.parameters()) {
        expect_dtype(c, "a parameter", p, torch::kFloat);
        expect_dtype(c, "a gradient", p.grad(), torch::kFloat);
      }
      optim.step();
      const auto d = comm_dtypes(model);
      expect_dtypes(c, "the all-gathers", d.gather, "fp16");
      expect_dtypes(c, "the gradients' reductions", d.reduce, "fp32");
      ref_optim.zero_grad();
      const int64_t per = x.size(0) / c.world;
      const double ref_loss = replay.backward([&](ShiftedMLP& w, int r, int) {
        return mse(w->forward(x.narrow(0, r * per, per).to(torch::kHalf)), y.narrow(0, r * per, per));
      });
      ref_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()), ref_loss, 1e-5);
    }
    expect_same_model(c, model, *mine, *replay.master(), 1e-5, /*buffers=*/false);
    expect_same_tensor(c, "the buffer", mine->shift, replay.master()->shift.to(torch::kBFloat16), 0.0);
  });
}

// An fp64 model (cast before wrapping): without mixed precision it trains as local fp64 training,
// clipped every step, to 1e-12; under bf16 mixed precision the master weights, the gradients the
// optimizer sees and the step stay fp64 (against the replay, bf16 sum order: 1e-3).
CONFORMANCE_CASE(MixedPrecision, DoubleModelKeepsFP64Masters, 4,
                 "#36: FSDP1 test_fsdp_mixed_precision test_mixed_precision_e2e_full_shard[full_precision_param_dtype=fp64]") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(23);
    MLP mine;
    torch::manual_seed(23);
    MLP local;
    mine->to(torch::kDouble);
    local->to(torch::kDouble);
    fsdp::Options o = v.options;
    o.auto_wrap_policy = blocks();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    for (int step = 0; step < 3; ++step) {
      const auto x = batch_x(step).to(torch::kDouble), y = batch_y(step).to(torch::kDouble);
      model.reset_step();
      optim.zero_grad();
      auto loss = mse(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      const double norm = model.clip_grad_norm_(0.5);
      for (const auto& p : model.parameters()) expect_dtype(c, "a gradient", p.grad(), torch::kDouble);
      optim.step();
      expect_dtypes(c, "the all-gathers", comm_dtypes(model).gather, "Double");
      local_optim.zero_grad();
      auto local_loss = mse(local->forward(x), y);
      local_loss.backward();
      const double local_norm = torch::nn::utils::clip_grad_norm_(unique_parameters(*local), 0.5);
      local_optim.step();
      const std::string when = " at step " + std::to_string(step);
      c.expect_near("loss" + when, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-12);
      c.expect_near("gradient norm" + when, norm, local_norm, 1e-12);
    }
    expect_same_model(c, model, *mine, *local, 1e-12);
  });
  const fsdp::MixedPrecision mp{torch::kBFloat16, torch::kBFloat16, torch::kBFloat16, false};
  for_each(c, with_mp(c, mp, "bf16"), [&](const Variant& v) {
    replay_parity(c, v, {"bf16", "bf16", torch::kDouble, torch::kDouble}, 1e-3, 3, torch::kDouble);
  });
}

// World size 1: nothing is summed across ranks, so fsdp and the replay (or plain local training
// without mixed precision) compute the same operations on the same values: equal to the bit.
CONFORMANCE_CASE(MixedPrecision, OneRankMatchesTheReplayBitwise, 1,
                 "#44: FSDP1 test_fsdp_mixed_precision TestFSDPMixedPrecisionUnsharded "
                 "test_mixed_precision_no_reshard_after_forward test_mixed_precision_e2e_full_shard "
                 "test_grads_reduced_precision") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(24);
    MLP mine;
    torch::manual_seed(24);
    MLP local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = blocks();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    for (int step = 0; step < 3; ++step) {
      optim.zero_grad();
      auto loss = mse(model(batch_x(step)), batch_y(step));
      loss.backward();
      optim.step();
      local_optim.zero_grad();
      auto local_loss = mse(local->forward(batch_x(step)), batch_y(step));
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), loss.item().toDouble(), local_loss.item().toDouble(), 0.0);
    }
    expect_same_model(c, model, *mine, *local, 0.0);
  });
  std::vector<Variant> low;
  for (const bool keep : {false, true}) {
    const fsdp::MixedPrecision mp{torch::kBFloat16, torch::kBFloat16, torch::kBFloat16, keep};
    for (auto& v : with_mp(c, mp, keep ? "bf16 keep_low_precision_grads" : "bf16")) low.push_back(v);
  }
  for_each(c, low, [&](const Variant& v) {
    const auto g = v.options.mixed_precision->keep_low_precision_grads ? torch::kBFloat16 : torch::kFloat;
    replay_parity(c, v, {"bf16", "bf16", torch::kFloat, g}, 0.0);
  });
}

// bf16 with keep_low_precision_grads, clipped to a norm well below the gradients' every step: the
// norm fsdp returns is the replay's (its squares summed in fp32 in another order: 1e-3
// relative), every gradient is scaled (the clipped global norm is at most max_norm), and the
// parameters follow the replay (bf16 sum order, 1e-3).
CONFORMANCE_CASE(MixedPrecision, LowPrecisionGradientsClipToTheGlobalNorm, 4,
                 "#105: FSDP1 test_fsdp_clip_grad_norm test_low_precision_grads") {
  const fsdp::MixedPrecision mp{torch::kBFloat16, torch::kBFloat16, torch::kBFloat16, true};
  const double max_norm = 0.05;
  for_each(c, with_mp(c, mp, "bf16 keep_low_precision_grads"), [&](const Variant& v) {
    torch::manual_seed(25);
    MLP mine;
    torch::manual_seed(25);
    MLP ref;
    torch::manual_seed(25);
    MLP work;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = blocks();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    CastReplay<MLP> replay(ref, work, mp, c.world);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD ref_optim(replay.params(), sgd);
    const int replicas = c.world / model.shard_size();
    for (int step = 0; step < 3; ++step) {
      const auto x = batch_x(step), y = batch_y(step);
      optim.zero_grad();
      mse(model(my_rows(c, x)), my_rows(c, y)).backward();
      const double norm = model.clip_grad_norm_(max_norm);
      // The clipped gradients' global norm: each rank's shards, summed over the world, hold every
      // element once per replica group.
      auto sq = torch::zeros({1}, torch::kDouble);
      for (const auto& p : model.parameters()) {
        expect_dtype(c, "a gradient", p.grad(), torch::kBFloat16);
        if (p.grad().defined()) sq.add_(p.grad().to(torch::kDouble).pow(2).sum());
      }
      std::vector<at::Tensor> t{sq};
      c.mesh->world()->allreduce(t)->wait();
      const double clipped = std::sqrt(t[0].item().toDouble() / replicas);
      optim.step();
      ref_optim.zero_grad();
      const int64_t per = x.size(0) / c.world;
      replay.backward([&](MLP& w, int r, int) {
        return mse(w->forward(x.narrow(0, r * per, per).to(torch::kBFloat16)), y.narrow(0, r * per, per));
      });
      const double ref_norm = replay.clip(max_norm);
      ref_optim.step();
      const std::string when = " at step " + std::to_string(step);
      c.expect(ref_norm > 4 * max_norm, "the gradients are larger than max_norm" + when);
      c.expect_near("gradient norm" + when, norm, ref_norm, 1e-3 * ref_norm);
      // bf16 gradients: each scaled element rounds by up to 2^-9.
      c.expect(clipped <= max_norm * (1 + 1e-2), "the clipped gradients' norm is " + std::to_string(clipped) +
                                                     " > max_norm " + std::to_string(max_norm) + when);
    }
    expect_same_model(c, model, *mine, *replay.master(), 1e-3);
  });
}

// Clipping when no parameter has a gradient (right after wrapping, after zero_grad to None):
// returns 0 on every rank, changes nothing, and the training that follows is local training's.
CONFORMANCE_CASE(MixedPrecision, ClipWithoutGradientsReturnsZero, 4,
                 "#106: FSDP1 test_fsdp_clip_grad_norm test_no_gradients") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(26);
    MLP mine;
    torch::manual_seed(26);
    MLP local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = blocks();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    double norm = -1;
    c.expect_ok("clip_grad_norm_ right after wrapping", [&] { norm = model.clip_grad_norm_(1.0); });
    c.expect(norm == 0.0, "clip_grad_norm_ without gradients returned " + std::to_string(norm) + ", not 0");
    for (int step = 0; step < 3; ++step) {
      const auto x = batch_x(step), y = batch_y(step);
      optim.zero_grad();  // to None
      c.expect_ok("clip_grad_norm_ after zero_grad", [&] { norm = model.clip_grad_norm_(1.0); });
      c.expect(norm == 0.0, "clip_grad_norm_ after zero_grad returned " + std::to_string(norm) + ", not 0");
      auto loss = mse(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      const double clipped = model.clip_grad_norm_(0.5);
      optim.step();
      local_optim.zero_grad();
      auto local_loss = mse(local->forward(x), y);
      local_loss.backward();
      const double local_norm = torch::nn::utils::clip_grad_norm_(unique_parameters(*local), 0.5);
      local_optim.step();
      const std::string when = " at step " + std::to_string(step);
      c.expect_near("loss" + when, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
      c.expect_near("gradient norm" + when, clipped, local_norm, 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

namespace {
// A block whose first Linear's weight is frozen (its bias trains): a unit mixing frozen and
// trainable parameters, as the peer's NonUniformReqGradNWM.
void freeze_first_weight(MLP& m) {
  m->b0->a->weight.requires_grad_(false);
  m->in->weight.requires_grad_(false);
}
}  // namespace

// fp16 with the sharded gradient scaler, a unit mixing frozen and trainable parameters. The
// initial scale (2^17) overflows the fp16 gradients of some steps (4 of the 8), which are skipped
// on every rank while the scale backs off; growth every 2 good steps doubles it again. The replay
// scales, unscales and skips by the same arithmetic, written here: the same steps must be
// skipped, the scales agree exactly, and the parameters follow the replay to 1e-3 (fp16 sums over
// 4 ranks in another order, 2^-11 relative each; measured 5e-5).
CONFORMANCE_CASE(MixedPrecision, GradScalerSkipsTheStepsLocalScalingSkips, 4,
                 "#111: FSDP1 test_fsdp_sharded_grad_scaler test_fsdp_ddp_parity_with_grad_scaler") {
  const fsdp::MixedPrecision mp{torch::kHalf, torch::kHalf, torch::kHalf, false};
  for_each(c, with_mp(c, mp, "fp16"), [&](const Variant& v) {
    torch::manual_seed(27);
    MLP mine;
    torch::manual_seed(27);
    MLP ref;
    torch::manual_seed(27);
    MLP work;
    freeze_first_weight(mine);
    freeze_first_weight(ref);
    freeze_first_weight(work);
    fsdp::Options o = v.options;
    o.auto_wrap_policy = blocks();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    CastReplay<MLP> replay(ref, work, mp, c.world);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD ref_optim(replay.params(), sgd);
    fsdp::GradScalerOptions so;
    so.init_scale = 1 << 17;
    so.growth_interval = 2;
    fsdp::ShardedGradScaler scaler(c.mesh, so);
    // The replay's scaler state.
    double scale = so.init_scale;
    int good = 0, skipped = 0;
    for (int step = 0; step < 8; ++step) {
      const auto x = batch_x(step) * 4, y = batch_y(step) * 4;
      optim.zero_grad();
      auto loss = mse(model(my_rows(c, x)), my_rows(c, y));
      scaler.scale(loss).backward();
      const bool stepped = scaler.step(optim);
      scaler.update();
      ref_optim.zero_grad();
      const int64_t per = x.size(0) / c.world;
      const double ref_loss = replay.backward(
          [&](MLP& w, int r, int) {
            return mse(w->forward(x.narrow(0, r * per, per).to(torch::kHalf)), y.narrow(0, r * per, per));
          },
          1, scale);
      bool inf = false;
      {
        torch::NoGradGuard no_grad;
        for (auto& p : replay.params()) {
          if (!p.grad().defined()) continue;
          inf = inf || !torch::isfinite(p.grad()).all().item().toBool();
          p.grad().mul_(1.0 / scale);
        }
      }
      if (!inf) ref_optim.step();
      if (inf) {
        scale *= so.backoff_factor;
        good = 0;
        ++skipped;
      } else if (++good == so.growth_interval) {
        scale *= so.growth_factor;
        good = 0;
      }
      const std::string when = " at step " + std::to_string(step);
      c.expect(stepped == !inf, std::string("fsdp ") + (stepped ? "stepped" : "skipped") + when + ", local scaling " +
                                    (inf ? "skipped" : "stepped"));
      c.expect_near("scale after step " + std::to_string(step), scaler.get_scale(), scale, 0.0);
      c.expect_near("loss" + when, global_mean(c, loss.item().toDouble()), ref_loss, 1e-3);
    }
    c.figure("skipped_steps", skipped);
    c.expect(skipped >= 1 && skipped <= 6, "the scenario skips some steps and takes others (skipped " +
                                               std::to_string(skipped) + " of 8)");
    expect_same_model(c, model, *mine, *replay.master(), 1e-3);
    c.expect(!mine->in->weight.requires_grad() && !mine->b0->a->weight.requires_grad(), "frozen weights stay frozen");
  });
}

namespace {
// Local training of the whole batch in `dtype` against fsdp's per-rank means reduced in `dtype`:
// what is left is low precision's rounding of two different computations of one mean.
// With `loss_scale`, each loss is multiplied by it before backward and the gradients divided by
// it after, as a user's static loss scaling for fp16 does (on both sides alike).
void low_precision_parity(Ctx& c, const Variant& v, c10::ScalarType dtype, double tol, double loss_scale = 1.0) {
  torch::manual_seed(28);
  MLP mine;
  torch::manual_seed(28);
  MLP local;
  mine->to(dtype);
  local->to(dtype);
  fsdp::Options o = v.options;
  o.auto_wrap_policy = blocks();
  fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD optim(model.parameters(), sgd);
  torch::optim::SGD local_optim(unique_parameters(*local), sgd);
  const std::string name = fsdp::dtype_name(dtype);
  for (int step = 0; step < 3; ++step) {
    const auto x = batch_x(step).to(dtype), y = batch_y(step);
    model.reset_step();
    optim.zero_grad();
    auto loss = mse(model(my_rows(c, x)), my_rows(c, y));
    (loss * loss_scale).backward();
    bool finite = true;
    for (const auto& p : model.parameters()) {
      expect_dtype(c, "a parameter", p, dtype);
      expect_dtype(c, "a gradient", p.grad(), dtype);
      if (!p.grad().defined()) continue;
      finite = finite && torch::isfinite(p.grad()).all().item().toBool();
      p.grad().div_(loss_scale);
    }
    optim.step();
    const auto d = comm_dtypes(model);
    expect_dtypes(c, "the all-gathers", d.gather, name);
    expect_dtypes(c, "the gradients' reductions", d.reduce, name);
    local_optim.zero_grad();
    auto local_loss = mse(local->forward(x), y);
    (local_loss * loss_scale).backward();
    bool local_finite = true;
    for (const auto& p : unique_parameters(*local)) {
      local_finite = local_finite && torch::isfinite(p.grad()).all().item().toBool();
      c.figure("largest scaled local gradient", p.grad().abs().max().item().toDouble());  // < 65504
      p.grad().div_(loss_scale);
    }
    local_optim.step();
    c.expect(finite || !local_finite, "the gradients overflowed under fsdp at step " + std::to_string(step) +
                                          " but not in local training");
    c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                  local_loss.item().toDouble(), tol);
  }
  expect_same_model(c, model, *mine, *local, tol);
}
}  // namespace

// The whole model in bf16 or fp16 (cast before wrapping), no mixed precision: shards, gathers,
// gradients and reductions in that dtype, and training follows local training in that dtype.
// Tolerance: one or two units in the last place of the parameters (|p| < 2: bf16 2^-7, fp16
// 2^-10), which the two computations of the mean gradient round differently.
CONFORMANCE_CASE(MixedPrecision, WholeLowPrecisionModelTrainsAsLocal, 4,
                 "#169: FSDP1 test_fsdp_pure_fp16 test_pure_fp16_training") {
  for_each(c, every_strategy(c), [&](const Variant& v) { low_precision_parity(c, v, torch::kBFloat16, 1.6e-2); });
  auto fp16 = every_strategy(c);
  for (auto& v : fp16) v.name += " model fp16";
  for_each(c, fp16, [&](const Variant& v) { low_precision_parity(c, v, torch::kHalf, 2e-3); });
  // fp16 with a static loss scale that keeps each gradient below fp16's largest value (65504) in
  // local training (the largest is 21344): the ranks' gradients must not overflow on their way to
  // the mean either (summed before dividing by W, they did at step 2).
  for (auto& v : fp16) v.name += " loss scale 2^16";
  for_each(c, fp16, [&](const Variant& v) { low_precision_parity(c, v, torch::kHalf, 2e-3, 65536.0); });
}

// A bf16 model under mixed precision that computes in fp32, or in bf16 and reduces in fp32: the
// shards and the gradients the optimizer sees stay bf16; gathers and reductions run in the
// policy's dtypes. Against the replay: its fp32 sums in another order may round a bf16 gradient or
// step the other way, one unit in the last place of a bf16 parameter (|p| < 2: 2^-7).
CONFORMANCE_CASE(MixedPrecision, BF16ModelUnderFP32Policies, 4,
                 "#170: FSDP1 test_fsdp_pure_fp16 test_fp16_dtypes") {
  const fsdp::MixedPrecision up{torch::kFloat, torch::kFloat, torch::kFloat, false};
  for_each(c, with_mp(c, up, "model bf16, param fp32"), [&](const Variant& v) {
    replay_parity(c, v, {"fp32", "fp32", torch::kBFloat16, torch::kBFloat16}, 1.6e-2, 3, torch::kBFloat16);
  });
  const fsdp::MixedPrecision mixed{torch::kBFloat16, torch::kFloat, torch::kBFloat16, false};
  for_each(c, with_mp(c, mixed, "model bf16, param bf16 reduce fp32"), [&](const Variant& v) {
    replay_parity(c, v, {"bf16", "fp32", torch::kBFloat16, torch::kBFloat16}, 1.6e-2, 3, torch::kBFloat16);
  });
}

// bf16 computation, fp32 reduction, 4 micro-batches of which the first 3 under no_sync: the
// unreduced gradients accumulate in fp32 (the replay accumulates alike), the reduction runs in
// fp32. Sum order of fp32 only: 1e-5.
CONFORMANCE_CASE(MixedPrecision, NoSyncMicroBatchesAccumulateInFP32UnderAReduceDtype, 4,
                 "#235: FSDP2 test_fully_shard_mixed_precision test_grad_acc_with_reduce_dtype") {
  const fsdp::MixedPrecision mp{torch::kBFloat16, torch::kFloat, torch::kBFloat16, false};
  for_each(c, with_mp(c, mp, "bf16 reduce fp32"), [&](const Variant& v) {
    torch::manual_seed(29);
    MLP mine;
    torch::manual_seed(29);
    MLP ref;
    torch::manual_seed(29);
    MLP work;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = blocks();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    CastReplay<MLP> replay(ref, work, mp, c.world);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD ref_optim(replay.params(), sgd);
    constexpr int kMicro = 4;
    for (int step = 0; step < 2; ++step) {
      const auto x = randn(2200 + step, {32, 8}), y = randn(2300 + step, {32, 4});
      const int64_t per = x.size(0) / c.world, m = per / kMicro;
      // Micro-batch k of rank r: rows [r * per + k * m, ... + m), a quarter of the rank's mean.
      auto rows = [&](const torch::Tensor& t, int r, int k) { return t.narrow(0, r * per + k * m, m); };
      model.reset_step();
      optim.zero_grad();
      double loss = 0;
      for (int k = 0; k < kMicro; ++k) {
        auto l = mse(model(rows(x, c.rank, k)), rows(y, c.rank, k)) / kMicro;
        loss += l.item().toDouble();
        if (k + 1 < kMicro) {
          auto guard = model.no_sync();
          l.backward();
        } else {
          l.backward();
        }
      }
      for (const auto& p : model.parameters()) expect_dtype(c, "a gradient", p.grad(), torch::kFloat);
      optim.step();
      expect_dtypes(c, "the gradients' reductions", comm_dtypes(model).reduce, "fp32");
      ref_optim.zero_grad();
      const double ref_loss = replay.backward(
          [&](MLP& w, int r, int k) { return mse(w->forward(rows(x, r, k).to(torch::kBFloat16)), rows(y, r, k)) / kMicro; },
          kMicro);
      ref_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss), ref_loss, 1e-5);
    }
    expect_same_model(c, model, *mine, *replay.master(), 1e-5);
  });
}

// A model built in bf16 under bf16/bf16 mixed precision: nothing is cast, the reductions run in
// bf16 (not widened), training follows local bf16 training (tolerance as for the whole bf16 model
// above); casting it to fp32 after wrapping is refused by name at the next forward.
CONFORMANCE_CASE(MixedPrecision, BF16BuiltModelUnderBF16MixedPrecision, 4,
                 "#239: FSDP2 test_fully_shard_mixed_precision test_clamp_reduce_dtype") {
  const fsdp::MixedPrecision mp{torch::kBFloat16, torch::kBFloat16, torch::kBFloat16, false};
  for_each(c, with_mp(c, mp, "model bf16"), [&](const Variant& v) {
    low_precision_parity(c, v, torch::kBFloat16, 1.6e-2);
  });
  for_each(c, {with_mp(c, mp, "model bf16")[0]}, [&](const Variant& v) {
    torch::manual_seed(30);
    MLP mine;
    mine->to(torch::kBFloat16);
    fsdp::Options o = v.options;
    o.auto_wrap_policy = blocks();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    mine->to(torch::kFloat);
    c.expect_refused("a forward after model->to(kFloat) on the wrapped model",
                     [&] { model(my_rows(c, batch_x(0))); }, {"model->to()", "before wrapping"});
  });
}

namespace {
// A model and its exponential moving average: training runs the model, evaluation the average.
struct WithEMAImpl : torch::nn::Module {
  WithEMAImpl() {
    main = register_module("main", torch::nn::Sequential(Block(8), Block(8)));
    ema = register_module("ema", torch::nn::Sequential(Block(8), Block(8)));
    torch::NoGradGuard no_grad;
    auto from = main->parameters(), to = ema->parameters();
    for (size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
  }
  torch::Tensor forward(const torch::Tensor& x) { return is_training() ? main->forward(x) : ema->forward(x); }
  // ema = decay * ema + (1 - decay) * main, on whole parameters.
  void update_ema(double decay) {
    torch::NoGradGuard no_grad;
    auto from = main->parameters(), to = ema->parameters();
    for (size_t i = 0; i < from.size(); ++i) to[i].mul_(decay).add_(from[i], 1 - decay);
  }
  torch::nn::Sequential main{nullptr}, ema{nullptr};
};
TORCH_MODULE(WithEMA);
}  // namespace

// Train, update the EMA copy inside summon_full_params, evaluate through the EMA copy, every step.
// The evaluation must use this step's EMA weights: fsdp's outputs are those of the EMA weights it
// holds (summoned, cast to the compute dtype, run locally on this rank's rows: the same operations
// on the same values, bitwise), and they change from step to step. Against local training: fp32
// 1e-5; bf16 the tolerance of bf16 against fp32 over 3 steps (3e-2).
CONFORMANCE_CASE(MixedPrecision, EMACopyEvaluatesWithThisStepsWeights, 4,
                 "#47: FSDP1 test_fsdp_mixed_precision test_train_ema_eval_flow") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(31);
    WithEMA mine;
    torch::manual_seed(31);
    WithEMA local;
    torch::manual_seed(31);
    WithEMA check;  // computes with the EMA weights fsdp holds
    fsdp::Options o = v.options;
    o.auto_wrap_policy = blocks();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    const auto compute = v.mixed_precision() ? torch::kBFloat16 : torch::kFloat;
    check->to(compute);
    check->eval();
    const double tol = v.mixed_precision() ? 3e-2 : 1e-5;
    // SGD with momentum (the peer's Adam would move parameters of near-zero gradients by lr
    // whatever their rounding noise).
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    const auto eval_x = randn(2400, {16, 8});
    double previous = 0;
    for (int step = 0; step < 3; ++step) {
      const auto x = randn(2500 + step, {16, 8}), y = randn(2600 + step, {16, 8});
      mine->train();
      optim.zero_grad();
      auto loss = mse(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      optim.step();
      {
        auto whole = model.summon_full_params();
        mine->update_ema(0.5);
      }
      mine->eval();
      torch::Tensor out;
      {
        torch::NoGradGuard no_grad;
        out = model(my_rows(c, eval_x));
      }
      mine->train();
      local->train();
      local_optim.zero_grad();
      auto local_loss = mse(local->forward(x), y);
      local_loss.backward();
      local_optim.step();
      local->update_ema(0.5);
      local->eval();
      torch::Tensor local_out;
      {
        torch::NoGradGuard no_grad;
        local_out = local->forward(eval_x);
      }
      // The EMA weights fsdp holds, run here on this rank's rows.
      {
        const auto held = whole_state(model, *mine, false);
        torch::NoGradGuard no_grad;
        for (auto& p : check->named_parameters(true)) p.value().copy_(held.at(p.key()));
      }
      torch::Tensor held_out;
      {
        torch::NoGradGuard no_grad;
        held_out = check->forward(my_rows(c, eval_x).to(compute));
      }
      const std::string when = " at step " + std::to_string(step);
      c.expect_near("loss" + when, global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), tol);
      expect_same_tensor(c, "the evaluation outputs against the EMA weights fsdp holds" + when, out, held_out, 0.0);
      expect_same_tensor(c, "the evaluation outputs" + when, out.to(torch::kFloat), my_rows(c, local_out), tol);
      const double sum = global_mean(c, out.to(torch::kDouble).sum().item().toDouble());
      if (step > 0) c.expect(sum != previous, "the evaluation outputs changed from step to step" + when);
      previous = sum;
    }
    expect_same_model(c, model, *mine, *local, tol);
  });
}

}  // namespace mixed_precision
}  // namespace conformance
