// Loops an outside client wrote as a new user would, that fsdp once got wrong (issue 35):
//   a weight shared by two units, neither of them the root, under hybrid sharding;
//   two wrapped models in one process (the official libtorch DCGAN example's loop);
//   an Embedding built with sparse(true);
//   an optimizer step inside an unshard() scope after a backward inside it (silently skipped every
//   parameter: its gradients wait for the scope's end);
//   a forward whose output is dropped between the backward and the step (libtorch's SGD failed on
//   the root's parameters with a size mismatch: its p.data() copies still held the gathered ones).
#include "conformance.h"
#include "fsdp/fused_optimizer.h"

namespace conformance {
namespace regressions {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

// A block: a 3x3 convolution (its own, or one shared with another block) and its own 1x1 one.
struct ConvBlockImpl : torch::nn::Module {
  ConvBlockImpl(torch::nn::Conv2d shared, int64_t channels) {
    conv = register_module("conv", shared);
    proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, channels, 1)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(proj(torch::relu(conv(x)))) + x; }
  torch::nn::Conv2d conv{nullptr}, proj{nullptr};
};
TORCH_MODULE(ConvBlock);

// The second and third blocks share one Conv2d: the same holder registered in both, so the unit of
// the block registered first (b2) holds it and the other block's forward gathers b2's unit.
// `b3_first`: forward runs b3 before b2 (b2's unit is gathered, freed and gathered again within
// one forward). Odd channel counts leave the units padded.
struct TiedCNNImpl : torch::nn::Module {
  TiedCNNImpl(int64_t channels, bool b3_first) : b3_first(b3_first) {
    using torch::nn::Conv2dOptions;
    stem = register_module("stem", torch::nn::Conv2d(Conv2dOptions(3, channels, 3).padding(1)));
    torch::nn::Conv2d shared(Conv2dOptions(channels, channels, 3).padding(1));
    b1 = register_module("b1", ConvBlock(torch::nn::Conv2d(Conv2dOptions(channels, channels, 3).padding(1)), channels));
    b2 = register_module("b2", ConvBlock(shared, channels));
    b3 = register_module("b3", ConvBlock(shared, channels));
    head = register_module("head", torch::nn::Linear(channels * 8 * 8, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = b1(torch::relu(stem(x)));
    h = b3_first ? b2(b3(h)) : b3(b2(h));
    return head(h.flatten(1));
  }
  bool b3_first;
  torch::nn::Conv2d stem{nullptr};
  ConvBlock b1{nullptr}, b2{nullptr}, b3{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TiedCNN);

template <typename Optim, typename Options>
void shared_conv_parity(Ctx& c, const Options& optim_options, double loss_tol, double param_tol) {
  struct Shape {
    int64_t channels;
    bool b3_first;
    bool conv_units;  // every Conv2d its own unit (the shared one once), not every block
  };
  for (const Shape shape : {Shape{8, false, false}, Shape{5, true, false}, Shape{8, false, true}}) {
    auto variants = every_strategy(c);
    for (auto& v : variants) {
      v.name += shape.b3_first ? ", b3 before b2, 5 channels" : ", b2 before b3";
      if (shape.conv_units) v.name += ", a unit per Conv2d";
    }
    for_each(c, variants, [&](const Variant& v) {
      torch::manual_seed(0);
      TiedCNN mine(shape.channels, shape.b3_first);
      torch::manual_seed(0);
      TiedCNN local(shape.channels, shape.b3_first);
      fsdp::Options o = v.options;
      if (shape.conv_units) {
        o.auto_wrap_policy = fsdp::module_type_policy<torch::nn::Conv2dImpl>();
      } else {
        o.auto_wrap_policy = fsdp::module_type_policy<ConvBlockImpl>();
      }
      fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
      const size_t units = shape.conv_units ? 7 : 4;  // stem, b1 x2, shared, b2.proj, b3.proj, root
      c.expect(model.units().size() == units, "units: " + std::to_string(model.units().size()));
      Optim optim(model.parameters(), optim_options);
      Optim local_optim(unique_parameters(*local), optim_options);
      for (int step = 0; step < 10; ++step) {
        const auto x = randn(100 + step, {8, 3, 8, 8});
        const auto y = randint(200 + step, 10, {8});
        optim.zero_grad();
        auto loss = torch::cross_entropy_loss(model(my_rows(c, x)), my_rows(c, y));
        loss.backward();
        optim.step();
        local_optim.zero_grad();
        auto local_loss = torch::cross_entropy_loss(local->forward(x), y);
        local_loss.backward();
        local_optim.step();
        c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                      local_loss.item().toDouble(), loss_tol);
      }
      expect_same_model(c, model, *mine, *local, param_tol);
    });
  }
}

}  // namespace

CONFORMANCE_CASE(Regressions, WeightSharedByTwoInnerUnitsWithAdam, 4,
                 "FSDP1 test_fsdp_flatten_params *_with_shared_params; issue 35 (hybrid_shard drifted from step 3)") {
  shared_conv_parity<torch::optim::Adam>(c, torch::optim::AdamOptions(1e-3), 1e-5, 2e-5);
}

CONFORMANCE_CASE(Regressions, WeightSharedByTwoInnerUnitsWithSGD, 4,
                 "FSDP1 test_fsdp_flatten_params *_with_shared_params; issue 35") {
  shared_conv_parity<torch::optim::SGD>(c, torch::optim::SGDOptions(0.05).momentum(0.9), 1e-5, 1e-5);
}

namespace {

// The official libtorch DCGAN example's networks (pytorch/examples cpp/dcgan), a quarter as wide.
constexpr int64_t kNoise = 16;
torch::nn::Sequential make_generator() {
  return torch::nn::Sequential(
      torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(kNoise, 64, 4).bias(false)),
      torch::nn::BatchNorm2d(64), torch::nn::ReLU(),
      torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(64, 32, 3).stride(2).padding(1).bias(false)),
      torch::nn::BatchNorm2d(32), torch::nn::ReLU(),
      torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(32, 16, 4).stride(2).padding(1).bias(false)),
      torch::nn::BatchNorm2d(16), torch::nn::ReLU(),
      torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(16, 1, 4).stride(2).padding(1).bias(false)),
      torch::nn::Tanh());
}
torch::nn::Sequential make_discriminator() {
  return torch::nn::Sequential(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 4).stride(2).padding(1).bias(false)),
      torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 32, 4).stride(2).padding(1).bias(false)),
      torch::nn::BatchNorm2d(32), torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 4).stride(2).padding(1).bias(false)),
      torch::nn::BatchNorm2d(64), torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2)),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(64, 1, 3).stride(1).padding(0).bias(false)), torch::nn::Sigmoid());
}

// `fn(rows)` on each rank's rows of `x` apart, the mean of the W results: what data-parallel
// training computes with a BatchNorm (each rank normalizes its own rows), on one process.
template <typename Fn>
torch::Tensor per_rank_mean(const Ctx& c, const torch::Tensor& x, Fn&& fn) {
  const int64_t per = x.size(0) / c.world;
  torch::Tensor sum;
  for (int r = 0; r < c.world; ++r) {
    auto l = fn(x.narrow(0, r * per, per), r * per, per);
    sum = sum.defined() ? sum + l : l;
  }
  return sum / c.world;
}

}  // namespace

CONFORMANCE_CASE(Regressions, TwoWrappedModelsTrainLikeTheDCGANExample, 4,
                 "issue 35 (hybrid_shard aborted in Gloo: a collective mismatch between two roots)") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(1);
    auto G = make_generator(), D = make_discriminator();
    torch::manual_seed(1);
    auto lG = make_generator(), lD = make_discriminator();
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<torch::nn::ConvTranspose2dImpl, torch::nn::Conv2dImpl>();
    fsdp::FullyShardedDataParallel generator(G, c.mesh, o);
    fsdp::FullyShardedDataParallel discriminator(D, c.mesh, o);
    const auto adam = torch::optim::AdamOptions(2e-4).betas({0.5, 0.999});
    torch::optim::Adam g_optim(generator.parameters(), adam), d_optim(discriminator.parameters(), adam);
    torch::optim::Adam lg_optim(lG->parameters(), adam), ld_optim(lD->parameters(), adam);
    const int64_t B = 8;
    for (int step = 0; step < 4; ++step) {
      const auto real = torch::tanh(randn(300 + step, {B, 1, 28, 28}));
      const auto noise = randn(400 + step, {B, kNoise, 1, 1});
      const auto real_labels = torch::rand({B}, at::make_generator<at::CPUGeneratorImpl>(500 + step)) * 0.2 + 0.8;
      const auto zeros = torch::zeros({B}), ones = torch::ones({B});
      // The discriminator: backwarded twice, on real images and on detached fakes.
      discriminator.module()->zero_grad();
      auto d_real = torch::binary_cross_entropy(discriminator(my_rows(c, real)).reshape(-1), my_rows(c, real_labels));
      d_real.backward();
      auto fake = generator(my_rows(c, noise));
      auto d_fake = torch::binary_cross_entropy(discriminator(fake.detach()).reshape(-1), my_rows(c, zeros));
      d_fake.backward();
      d_optim.step();
      // The generator, through the discriminator.
      generator.module()->zero_grad();
      auto g_loss = torch::binary_cross_entropy(discriminator(fake).reshape(-1), my_rows(c, ones));
      g_loss.backward();
      g_optim.step();

      // The same loop in plain libtorch, each rank's rows through its own BatchNorm statistics.
      lD->zero_grad();
      auto ld_real = per_rank_mean(c, real, [&](const torch::Tensor& x, int64_t b, int64_t n) {
        return torch::binary_cross_entropy(lD->forward(x).reshape(-1), real_labels.narrow(0, b, n));
      });
      ld_real.backward();
      std::vector<torch::Tensor> fakes;
      auto ld_fake = per_rank_mean(c, noise, [&](const torch::Tensor& z, int64_t, int64_t n) {
        fakes.push_back(lG->forward(z));
        return torch::binary_cross_entropy(lD->forward(fakes.back().detach()).reshape(-1), torch::zeros({n}));
      });
      ld_fake.backward();
      ld_optim.step();
      lG->zero_grad();
      int r = 0;
      auto lg_loss = per_rank_mean(c, noise, [&](const torch::Tensor&, int64_t, int64_t n) {
        return torch::binary_cross_entropy(lD->forward(fakes[static_cast<size_t>(r++)]).reshape(-1), torch::ones({n}));
      });
      lg_loss.backward();
      lg_optim.step();
      const std::string at = " at step " + std::to_string(step);
      c.expect_near("discriminator loss on real images" + at, global_mean(c, d_real.item().toDouble()), ld_real.item().toDouble(), 1e-5);
      c.expect_near("discriminator loss on fakes" + at, global_mean(c, d_fake.item().toDouble()), ld_fake.item().toDouble(), 1e-5);
      c.expect_near("generator loss" + at, global_mean(c, g_loss.item().toDouble()), lg_loss.item().toDouble(), 1e-5);
    }
    // Parameters only: each rank's BatchNorm running statistics are its own rows' (as in DDP
    // without broadcast_buffers), which one local model cannot hold.
    expect_same_model(c, generator, *G.ptr(), *lG.ptr(), 2e-5, /*buffers=*/false);
    expect_same_model(c, discriminator, *D.ptr(), *lD.ptr(), 2e-5, /*buffers=*/false);
  });
}

namespace {
// A recommendation model's table with sparse gradients, then a dense tower.
struct SparseTableNetImpl : torch::nn::Module {
  SparseTableNetImpl() {
    table = register_module("table", torch::nn::Embedding(torch::nn::EmbeddingOptions(50, 8).sparse(true)));
    tower = register_module("tower", torch::nn::Linear(8, 1));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return tower(table(ids).mean(1)).reshape(-1); }
  torch::nn::Embedding table{nullptr};
  torch::nn::Linear tower{nullptr};
};
TORCH_MODULE(SparseTableNet);
}  // namespace

CONFORMANCE_CASE(Regressions, EmbeddingWithSparseGradientsTrainsLikeLocal, 4,
                 "issue 35 (libtorch's 'reshape is not implemented for sparse tensors' at the first backward)") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(2);
    SparseTableNet mine;
    torch::manual_seed(2);
    SparseTableNet local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<torch::nn::EmbeddingImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    // SGD (with momentum) takes sparse gradients in plain libtorch.
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
    const double tol = v.mixed_precision() ? 2e-2 : 1e-5;
    for (int step = 0; step < 4; ++step) {
      const auto ids = randint(600 + step, 50, {8, 5});
      const auto y = randn(700 + step, {8});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(my_rows(c, ids)).to(torch::kFloat), my_rows(c, y));
      loss.backward();
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(ids), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), tol);
    }
    expect_same_model(c, model, *mine, *local, tol);
  });
}

namespace {
// The 8-channel TiedCNN twice from one seed: fsdp's and local training's.
std::pair<TiedCNN, TiedCNN> tied_pair() {
  torch::manual_seed(0);
  TiedCNN mine(8, false);
  torch::manual_seed(0);
  TiedCNN local(8, false);
  return {mine, local};
}
// The variant's options with every ConvBlock a unit of its own.
fsdp::Options block_units(const Variant& v) {
  fsdp::Options o = v.options;
  o.auto_wrap_policy = fsdp::module_type_policy<ConvBlockImpl>();
  return o;
}
}  // namespace

CONFORMANCE_CASE(Regressions, StepInsideUnshardAfterItsBackwardIsRefused, 4,
                 "issue 35 review (an optimizer step inside unshard() after a backward inside it moved nothing, "
                 "silently)") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    auto [mine, local] = tied_pair();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, block_units(v));
    // SGD with momentum refuses before it changes anything (its first read is the gradient).
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(unique_parameters(*local), torch::optim::SGDOptions(0.05).momentum(0.9));
    const double tol = v.mixed_precision() ? 2e-2 : 1e-5;
    const std::vector<std::string> says{"inside an unshard() scope", "End the unshard() scope before"};
    for (int step = 0; step < 4; ++step) {
      const auto x = randn(100 + step, {8, 3, 8, 8});
      const auto y = randint(200 + step, 10, {8});
      optim.zero_grad();
      double loss = 0;
      {
        auto whole = model.unshard();
        auto run = [&] {
          auto l = torch::cross_entropy_loss(model(my_rows(c, x)), my_rows(c, y));
          l.backward();
          loss = global_mean(c, l.to(torch::kFloat).item().toDouble());
        };
        run();
        if (step == 0) {
          c.expect_refused("the optimizer step inside the scope", [&] { optim.step(); }, says);
          c.expect_refused("fsdp's clip_grad_norm_ inside the scope", [&] { model.clip_grad_norm_(1.0); }, says);
          c.expect_refused("libtorch's clip_grad_norm_ inside the scope",
                           [&] { torch::nn::utils::clip_grad_norm_(model.parameters(), 1.0); }, says);
          c.expect_refused("summon_full_params inside the scope", [&] { auto full = model.summon_full_params(); },
                           {"inside an unshard() scope", "End the unshard() scope first"});
        }
        if (step == 1) {
          // The module's own zero_grad (detach, then None) drops them too.
          mine->zero_grad();
          run();
        }
        if (step == 2) {
          // zero_grad to None inside the scope drops what its backward left, as in local training.
          optim.zero_grad();
          run();
        }
        if (step == 3) {
          // Dropped, then an inference forward (an iteration of its own that no backward reaches):
          // the gradients stay dropped, and the step after the scope moves nothing.
          optim.zero_grad();
          torch::NoGradGuard no_grad;
          model(my_rows(c, x));
        }
      }
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::cross_entropy_loss(local->forward(x), y);
      local_loss.backward();
      if (step == 1 || step == 2) {
        local_optim.zero_grad();
        local_loss = torch::cross_entropy_loss(local->forward(x), y);
        local_loss.backward();
      }
      if (step == 3) local_optim.zero_grad();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), loss, local_loss.item().toDouble(), tol);
    }
    expect_same_model(c, model, *mine, *local, tol);
  });
}

// A loop that runs one more forward with grad between backward and step (a peek at the training
// accuracy, say) and drops its output: no backward will come, and the step must update the shards
// as in local training. The root holds parameters (stem, head), which forward leaves gathered for
// backward; SGD's weight decay and update go through p.data(), shallow copies taken while they are
// still gathered, Adam's through the parameters themselves.
CONFORMANCE_CASE(Regressions, AForwardWhoseOutputIsDroppedBeforeTheStep, 4,
                 "outside review of issue 38 (SGD: c10 size mismatch 16 vs 145 when the root holds parameters)") {
  // fsdp's fused optimizers read each parameter's shape before any operator reaches it (they
  // crashed at the second step: state in the shard's shape against the still-gathered parameter).
  for (const std::string optimizer : {"SGD", "Adam", "FusedAdamW", "FusedSGD"}) {
    auto variants = every_strategy(c, /*bf16=*/true);
    for (auto& v : variants) v.name += ", " + optimizer;
    for_each(c, variants, [&](const Variant& v) {
      auto [mine, local] = tied_pair();
      fsdp::FullyShardedDataParallel model(mine, c.mesh, block_units(v));
      std::unique_ptr<torch::optim::Optimizer> optim, local_optim;
      const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01);
      const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
      if (optimizer == "Adam") {
        optim = std::make_unique<torch::optim::Adam>(model.parameters(), torch::optim::AdamOptions(1e-3).weight_decay(0.01));
        local_optim = std::make_unique<torch::optim::Adam>(unique_parameters(*local), torch::optim::AdamOptions(1e-3).weight_decay(0.01));
      } else if (optimizer == "SGD") {
        optim = std::make_unique<torch::optim::SGD>(model.parameters(), sgd);
        local_optim = std::make_unique<torch::optim::SGD>(unique_parameters(*local), sgd);
      } else if (optimizer == "FusedAdamW") {
        optim = std::make_unique<fsdp::FusedAdamW>(model.parameters(), adamw);
        local_optim = std::make_unique<torch::optim::AdamW>(unique_parameters(*local), adamw);
      } else {
        optim = std::make_unique<fsdp::FusedSGD>(model.parameters(), sgd);
        local_optim = std::make_unique<torch::optim::SGD>(unique_parameters(*local), sgd);
      }
      const double tol = v.mixed_precision() ? 2e-2 : 1e-5;
      for (int step = 0; step < 4; ++step) {
        const auto x = randn(100 + step, {8, 3, 8, 8});
        const auto y = randint(200 + step, 10, {8});
        optim->zero_grad();
        // The loss stays in scope, its backwarded graph with it (holding the parameters'
        // AccumulateGrad nodes): the dropped forward is told apart by its own nodes.
        auto l = torch::cross_entropy_loss(model(my_rows(c, x)), my_rows(c, y));
        l.backward();
        const double loss = global_mean(c, l.to(torch::kFloat).item().toDouble());
        double peek = 0, local_peek = 0;
        {
          auto out = model(my_rows(c, x));  // with grad, never backwarded
          peek = global_mean(c, out.to(torch::kFloat).argmax(1).eq(my_rows(c, y)).to(torch::kFloat).mean().item().toDouble());
        }
        optim->step();
        local_optim->zero_grad();
        auto local_loss = torch::cross_entropy_loss(local->forward(x), y);
        local_loss.backward();
        {
          auto out = local->forward(x);
          local_peek = out.argmax(1).eq(y).to(torch::kFloat).mean().item().toDouble();
        }
        local_optim->step();
        const std::string at = " at step " + std::to_string(step);
        c.expect_near("loss" + at, loss, local_loss.item().toDouble(), tol);
        c.expect_near("accuracy of the dropped forward" + at, peek, local_peek, v.mixed_precision() ? 0.25 : 1e-6);
      }
      expect_same_model(c, model, *mine, *local, tol);
    });
  }
}

}  // namespace regressions
}  // namespace conformance
