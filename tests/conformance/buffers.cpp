// Buffers and BatchNorm: models whose modules hold buffers (BatchNorm1d/2d running statistics, a
// buffer a user's module updates in its own forward), as peers test them:
//   sync_module_states makes every rank hold rank 0's parameters and buffers (FSDP1
//   test_fsdp_misc), also across the replicas of a hybrid strategy (FSDP2 test_fully_shard_init);
//   BatchNorm trains under every strategy and under bf16 mixed precision (FSDP1 / FSDP2 mixed
//   precision tests), also with a size-based wrap policy;
//   an ignored module keeps its dtype, its buffers' too, under mixed precision;
//   checkpoints restore buffers bitwise (FSDP1 test_fsdp_state_dict).
//
// Data parallel BatchNorm: each rank normalizes its own rows (as DDP without SyncBatchNorm), so the
// oracle runs each rank's rows through the local model apart, and the running statistics of rank r
// are those of a local model that saw only rank r's rows (RankBuffers below keeps one set of
// buffers per rank and swaps it in for that rank's rows).
#include <ftw.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>

#include "conformance.h"

namespace conformance {
namespace buffers {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {
// Rank 0's copy of every tensor of `state` (whole tensors of the same shape on every rank), on every rank.
std::map<std::string, torch::Tensor> broadcast_state(Ctx& c, std::map<std::string, torch::Tensor> state) {
  for (auto& [name, t] : state) {
    std::vector<at::Tensor> one{t.contiguous()};
    c10d::BroadcastOptions opts;
    opts.rootRank = 0;
    c.mesh->world()->broadcast(one, opts)->wait();
    t = one[0];
  }
  return state;
}

// A module that updates a buffer of its own in forward, as user code does: a running mean of its
// input, subtracted before its Linear (a running centering), and a count of training forwards.
struct CenterImpl : torch::nn::Module {
  explicit CenterImpl(int64_t n) {
    lin = register_module("lin", torch::nn::Linear(n, n));
    mean = register_buffer("mean", torch::zeros({n}));
    calls = register_buffer("calls", torch::zeros({}, torch::kLong));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (is_training()) {
      torch::NoGradGuard no_grad;
      mean.mul_(0.9).add_(x.detach().mean(0).to(mean.scalar_type()), 0.1);
      calls.add_(1);
    }
    return lin(x - mean.to(x.scalar_type()));
  }
  torch::nn::Linear lin{nullptr};
  torch::Tensor mean, calls;
};
TORCH_MODULE(Center);

// Conv2d without bias (a BatchNorm follows), BatchNorm2d, ReLU.
struct ConvBNImpl : torch::nn::Module {
  ConvBNImpl(int64_t in, int64_t out) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1).bias(false)));
    bn = register_module("bn", torch::nn::BatchNorm2d(out));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(bn(conv(x))); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(ConvBN);

// Linear, BatchNorm1d, LayerNorm, ReLU.
struct LinBNImpl : torch::nn::Module {
  LinBNImpl(int64_t in, int64_t out) {
    lin = register_module("lin", torch::nn::Linear(in, out));
    bn = register_module("bn", torch::nn::BatchNorm1d(out));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({out})));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(ln(bn(lin(x)))); }
  torch::nn::Linear lin{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::nn::LayerNorm ln{nullptr};
};
TORCH_MODULE(LinBN);

// [B, 3, 4, 4] images -> 3 classes, through every kind of buffer above.
struct BufferNetImpl : torch::nn::Module {
  BufferNetImpl() {
    stem = register_module("stem", ConvBN(3, 8));
    body = register_module("body", LinBN(8 * 4 * 4, 16));
    center = register_module("center", Center(16));
    head = register_module("head", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(center(body(stem(x).flatten(1)))); }
  ConvBN stem{nullptr};
  LinBN body{nullptr};
  Center center{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(BufferNet);

fsdp::WrapPolicy buffer_net_units() { return fsdp::module_type_policy<ConvBNImpl, LinBNImpl, CenterImpl>(); }

// One set of buffers per rank for one local model: as_rank(r, fn) runs fn with rank r's buffers in
// the model and keeps what fn left in them as rank r's.
class RankBuffers {
 public:
  RankBuffers(torch::nn::Module& local, int world) : local_(local) {
    for (int r = 0; r < world; ++r) {
      std::map<std::string, torch::Tensor> mine;
      for (const auto& b : local_.named_buffers(true)) {
        if (b.value().defined()) mine[b.key()] = b.value().detach().clone();
      }
      of_.push_back(std::move(mine));
    }
  }
  template <typename Fn>
  torch::Tensor as_rank(int r, Fn&& fn) {
    copy(of_[static_cast<size_t>(r)], /*into_model=*/true);
    auto out = fn();
    copy(of_[static_cast<size_t>(r)], /*into_model=*/false);
    return out;
  }
  const std::map<std::string, torch::Tensor>& of(int r) const { return of_[static_cast<size_t>(r)]; }

 private:
  // Through .data(), which shares the buffer's storage but not its version counter: BatchNorm
  // saves its running statistics for backward (which, in training mode, reads the batch's
  // statistics instead), and a copy_ into them would make autograd refuse the backward.
  void copy(std::map<std::string, torch::Tensor>& saved, bool into_model) {
    torch::NoGradGuard no_grad;
    for (auto& b : local_.named_buffers(true)) {
      if (!b.value().defined()) continue;
      auto& s = saved.at(b.key());
      if (into_model) b.value().data().copy_(s);
      else s.copy_(b.value());
    }
  }
  torch::nn::Module& local_;
  std::vector<std::map<std::string, torch::Tensor>> of_;
};

// The local step's loss: the mean over ranks of each rank's rows through the local model, each
// with its own buffers.
template <typename Net>
torch::Tensor per_rank_loss(const Ctx& c, Net& local, RankBuffers& stats, const torch::Tensor& x, const torch::Tensor& y) {
  const int64_t per = x.size(0) / c.world;
  torch::Tensor sum;
  for (int r = 0; r < c.world; ++r) {
    auto l = stats.as_rank(r, [&] {
      return torch::cross_entropy_loss(local->forward(x.narrow(0, r * per, per)), y.narrow(0, r * per, per));
    });
    sum = sum.defined() ? sum + l : l;
  }
  return sum / c.world;
}

// This rank's buffers (fsdp leaves them whole on every rank) against the local model's buffers of
// this rank, compared in the local dtype (under mixed precision fsdp holds them in buffer_dtype).
void expect_rank_buffers(Ctx& c, torch::nn::Module& mine, const std::map<std::string, torch::Tensor>& want, double tol,
                         const std::string& what = "buffer ") {
  size_t seen = 0;
  for (const auto& b : mine.named_buffers(true)) {
    if (!b.value().defined()) continue;
    ++seen;
    auto it = want.find(b.key());
    if (it == want.end()) {
      c.fail("the local model has no buffer " + b.key());
      continue;
    }
    expect_same_tensor(c, what + b.key(), b.value().to(it->second.scalar_type()), it->second, tol);
  }
  c.expect(seen == want.size(), "the wrapped model has " + std::to_string(seen) + " buffers, the local one " +
                                    std::to_string(want.size()));
}

// Trains `mine` under fsdp and `local` on the whole batch (each rank's rows apart) for `steps`
// SGD-with-momentum steps and compares losses every step, then parameters, and this rank's buffers
// against the local model's buffers of this rank.
template <typename Net, typename Model>
void train_and_compare(Ctx& c, Model& model, Net& mine, Net& local, RankBuffers& stats, int steps, double tol,
                       uint64_t seed) {
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD optim(model.parameters(), sgd);
  torch::optim::SGD local_optim(unique_parameters(*local), sgd);
  for (int step = 0; step < steps; ++step) {
    const auto x = randn(seed + static_cast<uint64_t>(step), {16, 3, 4, 4});
    const auto y = randint(seed + 100 + static_cast<uint64_t>(step), 3, {16});
    optim.zero_grad();
    auto loss = torch::cross_entropy_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
    loss.backward();
    optim.step();
    local_optim.zero_grad();
    auto local_loss = per_rank_loss(c, local, stats, x, y);
    local_loss.backward();
    local_optim.step();
    c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                  local_loss.item().toDouble(), tol);
  }
  expect_same_model(c, model, *mine, *local, tol, /*buffers=*/false);
  expect_rank_buffers(c, *mine, stats.of(c.rank), tol);
}

// bf16 mixed precision against the fp32 oracle: forward and backward in bf16 (8 significant bits,
// a relative rounding of 2^-9 per operation, through 4 layers and two normalizations) put the
// losses and the 3 steps' parameters up to about 1e-2 from fp32 (measured 5.6e-3); buffers are
// held in bf16 (running statistics of magnitude up to 2 carry 2^-7 of rounding each; measured
// 9.2e-3).
constexpr double kBF16Tol = 3e-2;

}  // namespace

CONFORMANCE_CASE(Buffers, BatchNormRunningStatsFollowEachRanksRows, 4,
                 "#41 #238: FSDP1 test_fsdp_mixed_precision test_mp_batchnorm; FSDP2 test_fully_shard_mixed_precision "
                 "test_norm_modules_bf16 test_norm_modules_fp16") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(11);
    BufferNet mine;
    torch::manual_seed(11);
    BufferNet local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = buffer_net_units();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    c.expect(model.units().size() == 4, "the three blocks and the root are the units");
    if (v.mixed_precision()) {
      // Floating-point buffers are cast once to buffer_dtype; the batch counters stay integers.
      c.expect(mine->stem->bn->running_mean.scalar_type() == torch::kBFloat16, "running_mean is in buffer_dtype");
      c.expect(mine->center->mean.scalar_type() == torch::kBFloat16, "the user's buffer is in buffer_dtype");
      c.expect(mine->body->bn->num_batches_tracked.scalar_type() == torch::kLong, "num_batches_tracked stays Long");
    }
    RankBuffers stats(*local, c.world);
    const int steps = 3;
    train_and_compare(c, model, mine, local, stats, steps, v.mixed_precision() ? kBF16Tol : 1e-5, 1000);
    // The statistics moved, every step, on every rank.
    c.expect(mine->stem->bn->num_batches_tracked.item().toLong() == steps, "BatchNorm2d counted every step");
    c.expect(mine->body->bn->num_batches_tracked.item().toLong() == steps, "BatchNorm1d counted every step");
    c.expect(mine->center->calls.item().toLong() == steps, "the user's buffer counted every step");
    c.expect(mine->body->bn->running_var.to(torch::kFloat).sub(1).abs().max().item().toDouble() > 1e-3,
             "BatchNorm1d's running_var moved");
  });
}

CONFORMANCE_CASE(Buffers, SizeBasedPolicyWrapsAConvBatchNormNet, 4,
                 "#39: FSDP1 test_fsdp_mixed_precision test_mixed_precision_resnet") {
  // A small residual conv net: the policy decides the units, BatchNorm trains under every strategy,
  // in fp32 and in bf16.
  struct Net : torch::nn::Module {
    Net() {
      stem = register_module("stem", ConvBN(3, 16));
      for (const char* b : {"layer1", "layer2"}) {
        auto s = torch::nn::Sequential(
            torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 16, 3).padding(1).bias(false)), torch::nn::BatchNorm2d(16),
            torch::nn::ReLU(), torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 16, 3).padding(1).bias(false)),
            torch::nn::BatchNorm2d(16));
        layers.push_back(register_module(b, s));
      }
      fc = register_module("fc", torch::nn::Linear(16, 3));
    }
    torch::Tensor forward(const torch::Tensor& x) {
      auto h = stem(x);
      for (auto& l : layers) h = torch::relu(l->forward(h) + h);
      return fc(h.mean({2, 3}));
    }
    ConvBN stem{nullptr};
    std::vector<torch::nn::Sequential> layers;
    torch::nn::Linear fc{nullptr};
  };
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(12);
    auto mine = std::make_shared<Net>();
    torch::manual_seed(12);
    auto local = std::make_shared<Net>();
    fsdp::Options o = v.options;
    // Each 3x3 16->16 convolution holds 2304 elements, the stem 432 + 32: only the four inner
    // convolutions reach 2000 on their own; what is left of each layer (its two BatchNorms, 64)
    // and of the stem does not.
    o.auto_wrap_policy = fsdp::size_based_policy(2000);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    std::vector<std::string> names;
    for (const auto& u : model.units()) names.push_back(u.name);
    std::sort(names.begin(), names.end());
    const std::vector<std::string> want{"", "layer1.0", "layer1.3", "layer2.0", "layer2.3"};
    std::string got;
    for (const auto& n : names) got += "'" + n + "' ";
    c.expect(names == want, "the units are the four convolutions and the root, not " + got);
    RankBuffers stats(*local, c.world);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    const double tol = v.mixed_precision() ? kBF16Tol : 1e-5;
    for (int step = 0; step < 3; ++step) {
      const auto x = randn(1200 + step, {16, 3, 6, 6});
      const auto y = randint(1300 + step, 3, {16});
      optim.zero_grad();
      auto loss = torch::cross_entropy_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
      loss.backward();
      optim.step();
      local_optim.zero_grad();
      const int64_t per = x.size(0) / c.world;
      torch::Tensor local_loss;
      for (int r = 0; r < c.world; ++r) {
        auto l = stats.as_rank(r, [&] {
          return torch::cross_entropy_loss(local->forward(x.narrow(0, r * per, per)), y.narrow(0, r * per, per));
        });
        local_loss = local_loss.defined() ? local_loss + l : l;
      }
      local_loss = local_loss / c.world;
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                    local_loss.item().toDouble(), tol);
    }
    expect_same_model(c, model, *mine, *local, tol, /*buffers=*/false);
    expect_rank_buffers(c, *mine, stats.of(c.rank), tol);
  });
}

namespace {
// Gives every floating buffer (and, with `params`, every parameter) of `m` the value `value`
// where it is a buffer, and a draw from seed `seed` where it is a parameter: what a rank that
// built or loaded its model differently holds.
void rank_valued(torch::nn::Module& m, double value, uint64_t seed, bool params) {
  torch::NoGradGuard no_grad;
  for (auto& b : m.buffers(true)) {
    if (b.defined() && at::isFloatingType(b.scalar_type())) b.fill_(value);
    else if (b.defined()) b.fill_(static_cast<int64_t>(value));
  }
  if (!params) return;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& p : m.parameters(true)) p.copy_(at::randn(p.sizes(), gen, p.scalar_type()));
}

// A BufferNet and a side table fsdp ignores (with a buffer of its own), not part of forward: the
// caller's, each rank its own.
struct WithSideImpl : torch::nn::Module {
  WithSideImpl() {
    net = register_module("net", BufferNet());
    side = register_module("side", torch::nn::BatchNorm1d(4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return net(x); }
  BufferNet net{nullptr};
  torch::nn::BatchNorm1d side{nullptr};
};
TORCH_MODULE(WithSide);

// Every rank builds the model with its own values (`rank_valued` with the rank as the value);
// wrapped with sync_module_states, it must hold rank 0's parameters and buffers everywhere, then
// train as a local model built with rank 0's values.
void sync_then_train(Ctx& c, const Variant& v, bool check_shards) {
  torch::manual_seed(13);
  WithSide mine;
  rank_valued(*mine->net, 1.0 + c.rank, 100 + static_cast<uint64_t>(c.rank), true);
  rank_valued(*mine->side, 1.0 + c.rank, 200 + static_cast<uint64_t>(c.rank), true);
  torch::manual_seed(13);
  WithSide local;  // rank 0's model
  rank_valued(*local->net, 1.0, 100, true);
  rank_valued(*local->side, 1.0, 200, true);
  // What this rank's ignored module holds before wrapping, and must hold after.
  const auto own_side = state_of(*mine->side);
  fsdp::Options o = v.options;
  o.auto_wrap_policy = buffer_net_units();
  o.sync_module_states = true;
  if (!check_shards) o.ignored_modules = {mine->side.ptr()};
  fsdp::FullyShardedDataParallel model(mine, c.mesh, o);

  // Whole parameters and buffers: rank 0's, on every rank.
  expect_same_model(c, model, *mine->net, *local->net, 0.0, /*buffers=*/true);
  if (!check_shards) {
    for (const auto& [name, t] : state_of(*mine->side)) {
      expect_same_tensor(c, "the ignored module's " + name + " (this rank's own)", t, own_side.at(name), 0.0);
    }
  } else {
    // Each replica group shards rank 0's values, each rank its own piece of them: ranks r and
    // r + F hold the same piece.
    const auto want = state_of(*local, false);
    for (const auto& [name, piece] : fsdp::sharded_state_dict(model)) {
      auto it = want.find(name);
      if (it == want.end()) continue;  // buffers, whole on every rank: compared above
      const auto whole = it->second.reshape({-1});
      expect_same_tensor(c, "this rank's shard of " + name, piece.local.reshape({-1}),
                         whole.narrow(0, piece.flat_begin, piece.local.numel()), 0.0);
    }
  }
  RankBuffers stats(*local->net, c.world);
  train_and_compare(c, model, mine->net, local->net, stats, 2, 1e-5, 1400);
}
}  // namespace

CONFORMANCE_CASE(Buffers, SyncModuleStatesGivesEveryRankRankZerosBuffers, 4,
                 "#21 #28: FSDP1 test_fsdp_misc test_cpu_init_with_sync_module_states "
                 "test_fsdp_same_model_across_ranks") {
  for_each(c, every_strategy(c), [&](const Variant& v) { sync_then_train(c, v, /*check_shards=*/false); });
}

CONFORMANCE_CASE(Buffers, HybridShardingBroadcastsRankZerosStateAcrossReplicas, 4,
                 "#280: FSDP2 test_fully_shard_init test_hsdp_broadcast_across_replicas") {
  for_each(c, {strategy(c, "hybrid_shard"), strategy(c, "hybrid_shard_zero2")},
           [&](const Variant& v) { sync_then_train(c, v, /*check_shards=*/true); });
}

namespace {
// A Linear, a module fsdp ignores (a Linear and a BatchNorm1d, the caller's to keep), a Linear.
// Under mixed precision the ignored module keeps its own dtype: its forward casts what comes in
// to its parameters' dtype and what goes out back, as a user writes it for a module kept in fp32.
struct IgnoredInsideImpl : torch::nn::Module {
  IgnoredInsideImpl() {
    l1 = register_module("l1", torch::nn::Linear(8, 8));
    ignored = register_module("ignored", torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::BatchNorm1d(8)));
    l2 = register_module("l2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(l1(x));
    const auto own = ignored->parameters()[0].scalar_type();
    h = ignored->forward(h.to(own)).to(h.scalar_type());
    return l2(torch::relu(h));
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr};
  torch::nn::Sequential ignored{nullptr};
};
TORCH_MODULE(IgnoredInside);
}  // namespace

CONFORMANCE_CASE(Buffers, IgnoredModuleKeepsItsDtypeUnderMixedPrecision, 4,
                 "#45: FSDP1 test_fsdp_mixed_precision test_mixed_precision_with_ignored_module") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(14);
    IgnoredInside mine;
    torch::manual_seed(14);
    IgnoredInside local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
    o.ignored_modules = {mine->ignored.ptr()};
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    // fsdp neither casts nor shards what it ignores: parameters and buffers keep fp32.
    for (const auto& p : mine->ignored->named_parameters(true)) {
      c.expect(p.value().scalar_type() == torch::kFloat && p.value().dim() >= 1 &&
                   p.value().sizes() == local->ignored->named_parameters(true)[p.key()].sizes(),
               "the ignored parameter " + p.key() + " is whole and fp32, not " +
                   std::string(c10::toString(p.value().scalar_type())));
    }
    for (const auto& b : mine->ignored->named_buffers(true)) {
      const auto want = local->ignored->named_buffers(true)[b.key()].scalar_type();
      c.expect(b.value().scalar_type() == want, "the ignored module's buffer " + b.key() + " keeps " +
                                                    std::string(c10::toString(want)) + ", not " +
                                                    std::string(c10::toString(b.value().scalar_type())));
    }
    RankBuffers stats(*local, c.world);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(unique_parameters(*local), sgd);
    const double tol = v.mixed_precision() ? kBF16Tol : 1e-5;
    for (int step = 0; step < 3; ++step) {
      const auto x = randn(1500 + step, {16, 8});
      const auto y = randint(1600 + step, 3, {16});
      optim.zero_grad();
      auto loss = torch::cross_entropy_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
      loss.backward();
      // The ignored parameters' gradients are this rank's own: the caller averages them (as its
      // own data parallelism would).
      for (auto& p : mine->ignored->parameters()) {
        std::vector<at::Tensor> g{p.grad()};
        c.mesh->world()->allreduce(g)->wait();
        p.grad().div_(c.world);
      }
      optim.step();
      local_optim.zero_grad();
      const int64_t per = x.size(0) / c.world;
      torch::Tensor local_loss;
      for (int r = 0; r < c.world; ++r) {
        auto l = stats.as_rank(r, [&] {
          return torch::cross_entropy_loss(local->forward(x.narrow(0, r * per, per)), y.narrow(0, r * per, per));
        });
        local_loss = local_loss.defined() ? local_loss + l : l;
      }
      local_loss = local_loss / c.world;
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                    local_loss.item().toDouble(), tol);
    }
    expect_same_model(c, model, *mine, *local, tol, /*buffers=*/false);
    expect_rank_buffers(c, *mine, stats.of(c.rank), tol);
    for (const auto& p : mine->ignored->parameters()) {
      c.expect(p.grad().scalar_type() == torch::kFloat, "the ignored module's gradients are fp32");
    }
  });
}

namespace {
// A folder every rank of this job names alike (the job's rendezvous port is its own). POSIX
// calls, not std::filesystem: libtorch.so exports std::filesystem symbols of its own, which this
// program may bind to (remove_all crashed there).
std::string job_dir(const Ctx& c, const std::string& what) {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp && *tmp ? tmp : "/tmp") + "/fsdp-conformance-" + what + "-" +
         std::to_string(c.mesh->env().master_port);
}

void remove_tree(const std::string& dir) {
  ::nftw(
      dir.c_str(), [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

void barrier(const Ctx& c) {
  std::vector<at::Tensor> flag{torch::zeros({1})};
  c.mesh->world()->allreduce(flag)->wait();
}

// Rank 0's value of `t`, on every rank.
torch::Tensor rank0s(const Ctx& c, const torch::Tensor& t) {
  std::vector<at::Tensor> one{t.detach().clone()};
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  c.mesh->world()->broadcast(one, opts)->wait();
  return one[0];
}
}  // namespace

// Buffers that differ across ranks (each rank's BatchNorm statistics and running centering are its
// own rows') cannot all come back from a checkpoint, which holds one value of each: as PyTorch's
// state dicts, it holds rank 0's (the save warns, naming them), and a load gives every rank rank
// 0's. Made equal by the user (averaged over the ranks), they are saved and restored bitwise by
// every kind, the parameters and the optimizer's momentum too: the run goes on bit for bit as if it
// had not stopped.
CONFORMANCE_CASE(Buffers, CheckpointsRestoreBuffersBitwise, 4,
                 "#53: FSDP1 test_fsdp_state_dict test_buffers_save_and_load_state_dict") {
  const std::string root = job_dir(c, "buffers");
  ::mkdir(root.c_str(), 0755);
  // Every kind under full_shard; a hybrid strategy's LOCAL checkpoint (every rank writes its own
  // files, replicas alike) and a bf16 one's SHARDED (buffers held in bf16).
  std::vector<Variant> variants{strategy(c, "full_shard"), strategy(c, "hybrid_shard")};
  variants.push_back(every_strategy(c, true)[5]);  // full_shard F=4 bf16
  int index = 0;
  for_each(c, variants, [&](const Variant& v) {
    std::vector<fsdp::StateDictKind> kinds{fsdp::StateDictKind::FULL, fsdp::StateDictKind::SHARDED,
                                           fsdp::StateDictKind::LOCAL};
    if (v.options.strategy == fsdp::ShardingStrategy::HYBRID_SHARD) kinds = {fsdp::StateDictKind::LOCAL};
    if (v.mixed_precision()) kinds = {fsdp::StateDictKind::SHARDED};
    fsdp::Options o = v.options;
    o.auto_wrap_policy = buffer_net_units();
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    auto step = [&](auto& model, torch::optim::SGD& optim, int s) {
      const auto x = randn(1700 + s, {16, 3, 4, 4});
      const auto y = randint(1800 + s, 3, {16});
      optim.zero_grad();
      auto loss = torch::cross_entropy_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
      loss.backward();
      optim.step();
      return global_mean(c, loss.item().toDouble());
    };
    for (const auto kind : kinds) {
      const std::string what = " (" + fsdp::to_string(kind) + ")";
      const std::string dir = root + "/" + std::to_string(index++);
      torch::manual_seed(15);
      BufferNet a_net;
      fsdp::FullyShardedDataParallel a(a_net, c.mesh, o);
      torch::optim::SGD a_optim(a.parameters(), sgd);
      for (int s = 0; s < 3; ++s) step(a, a_optim, s);
      fsdp::Checkpointer ckpt(c.mesh, dir, {kind, 0});
      {
        // Saved with rank 0's buffers; loaded, every rank holds rank 0's.
        std::map<std::string, torch::Tensor> buffers;
        for (const auto& bb : a_net->named_buffers(true)) buffers[bb.key()] = bb.value().detach().clone();
        const auto rank0_buffers = broadcast_state(c, std::move(buffers));
        std::string first;
        c.expect_ok("saving a model whose ranks' buffers differ" + what, [&] { first = ckpt.save(a, &a_optim, {2}); });
        torch::manual_seed(16);
        BufferNet z_net;
        fsdp::FullyShardedDataParallel z(z_net, c.mesh, o);
        if (!first.empty()) fsdp::load_checkpoint(first, z);
        for (const auto& bb : z_net->named_buffers(true)) {
          expect_same_tensor(c, "buffer " + bb.key() + " loaded from a save whose ranks' buffers differed" + what,
                             bb.value(), rank0_buffers.at(bb.key()), 0.0);
        }
      }
      // What the message says to do: average the floating-point buffers over the ranks (the
      // counters are equal already).
      {
        torch::NoGradGuard no_grad;
        for (auto& b : a_net->buffers(true)) {
          if (!at::isFloatingType(b.scalar_type())) continue;
          std::vector<at::Tensor> t{b};
          c.mesh->world()->allreduce(t)->wait();
          b.div_(c.world);
        }
      }
      std::string saved;
      c.expect_ok("saving once the buffers agree" + what, [&] { saved = ckpt.save(a, &a_optim, {3}); });
      if (saved.empty()) return;
      const auto a_params = whole_state(a, *a_net, false);
      const auto a_buffers = state_of(*a_net, true);

      // Another model, other weights, every buffer zero.
      torch::manual_seed(16);
      BufferNet b_net;
      rank_valued(*b_net, 0.0, 0, false);
      fsdp::FullyShardedDataParallel b(b_net, c.mesh, o);
      torch::optim::SGD b_optim(b.parameters(), sgd);
      const auto loaded = fsdp::load_checkpoint(saved, b, &b_optim);
      c.expect(loaded.step == 3, "the checkpoint's step" + what);
      for (const auto& [name, t] : whole_state(b, *b_net, false)) {
        expect_same_tensor(c, name + what, t, a_params.at(name), 0.0);
      }
      for (const auto& bb : b_net->named_buffers(true)) {
        expect_same_tensor(c, "buffer " + bb.key() + what, bb.value(), a_buffers.at(bb.key()), 0.0);
      }
      // Training goes on alike, bit for bit (the optimizer's momentum was restored too).
      for (int s = 3; s < 5; ++s) {
        const double la = step(a, a_optim, s), lb = step(b, b_optim, s);
        c.expect(la == lb, "the loss after loading differs at step " + std::to_string(s) + what + ": " +
                               std::to_string(lb) + ", " + std::to_string(la) + " without the checkpoint");
      }
      const auto a_after = whole_state(a, *a_net, true);
      for (const auto& [name, t] : whole_state(b, *b_net, true)) {
        expect_same_tensor(c, name + " after two more steps" + what, t, a_after.at(name), 0.0);
      }
    }
  });
  barrier(c);
  if (c.rank == 0) remove_tree(root);
}

}  // namespace buffers
}  // namespace conformance
