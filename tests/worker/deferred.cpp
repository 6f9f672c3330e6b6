// fsdp-test-worker deferred --model gpt|zoo --out PREFIX
//   Builds the model normally and with deferred_init from the same seed, shards both, and compares
//   every shard and buffer bit for bit; measures the peak CPU tensor memory (process-wide) of both
//   ways of building and sharding; trains both two steps (gpt); checks that a constructor reading
//   a deferred value is refused.
#include "fsdp/deferred_init.h"
#include "memory/host_memory.h"
#include "worker.h"

namespace worker {

json run_deferred(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  fsdp::Options opts = options_from(a);
  const int rank = mesh->rank();
  models::GPTConfig cfg{256, 64, 8, 4, 256};  // 8 blocks of 0.79 M parameters: a unit is ~1/9 of the model
  std::function<std::shared_ptr<torch::nn::Module>()> build;
  if (a.model == "gpt") {
    build = [&] { return models::GPT(cfg).ptr(); };
    opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  } else {
    build = [] { return InitZoo().ptr(); };
    opts.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl, torch::nn::Conv2dImpl, torch::nn::EmbeddingImpl>();
  }
  auto shard_bytes = [](const std::vector<fsdp::UnitInfo>& units) {
    int64_t largest = 0, shards = 0;
    for (const auto& u : units) {
      largest = std::max(largest, u.padded_numel * u.element_size);
      shards += u.shard_numel * u.element_size;
    }
    return std::make_pair(largest, shards);
  };

  torch::manual_seed(7);
  int64_t normal_peak = 0;
  std::shared_ptr<torch::nn::Module> normal;
  std::optional<fsdp::FullyShardedDataParallel<torch::nn::Module>> n;
  {
    fsdp::HostMemoryPeak peak;
    normal = build();
    n.emplace(normal, mesh, opts);
    normal_peak = peak.peak_bytes();
  }
  const at::Tensor after_normal = torch::randn({4});  // where the generator stands afterwards

  torch::manual_seed(7);
  int64_t deferred_peak = 0;
  bool was_deferred = true;
  std::shared_ptr<torch::nn::Module> deferred;
  std::optional<fsdp::FullyShardedDataParallel<torch::nn::Module>> d;
  {
    fsdp::HostMemoryPeak peak;
    deferred = fsdp::deferred_init(build);
    for (const auto& p : deferred->parameters()) was_deferred = was_deferred && fsdp::is_deferred(p) && p.is_meta();
    d.emplace(deferred, mesh, opts);
    deferred_peak = peak.peak_bytes();
  }
  const at::Tensor after_deferred = torch::randn({4});

  bool equal = true;
  std::string first_difference;
  auto np = normal->named_parameters(), dp = deferred->named_parameters();
  for (const auto& item : np) {
    const at::Tensor& x = item.value();
    const at::Tensor& y = dp[item.key()];
    if (y.is_meta() || x.sizes() != y.sizes() || !torch::equal(x, y)) {
      if (equal) first_difference = item.key();
      equal = false;
    }
  }
  auto nb = normal->named_buffers(), db = deferred->named_buffers();
  for (const auto& item : nb) {
    const at::Tensor& y = db[item.key()];
    if (y.is_meta() || !torch::equal(item.value(), y)) {
      if (equal) first_difference = item.key();
      equal = false;
    }
  }
  // The materialized model trains exactly like the normal one (same ops on the same values).
  bool trains_equal = true;
  if (a.model == "gpt") {
    const int64_t per = kGlobalBatch / mesh->world_size();
    auto step_both = [&](int step) {
      for (auto* m : {&*n, &*d}) {
        std::vector<torch::Tensor> unique;
        for (auto& kv : unique_params(*m->module())) unique.push_back(kv.second);
        torch::optim::SGD opt(unique, torch::optim::SGDOptions(0.1));
        opt.zero_grad();
        auto model = std::dynamic_pointer_cast<models::GPTImpl>(m->module());
        gpt_loss([&](const torch::Tensor& x) { return m->forward_with([&] { return model->forward(x); }); }, step,
                 rank * per, rank * per + per)
            .backward();
        opt.step();
      }
    };
    for (int step = 0; step < 2; ++step) step_both(step);
    auto np2 = normal->named_parameters(), dp2 = deferred->named_parameters();
    for (const auto& item : np2) trains_equal = trains_equal && torch::equal(item.value(), dp2[item.key()]);
  }

  // A constructor that computes with a parameter's value is refused, with the operator named.
  std::string refusal;
  try {
    fsdp::deferred_init([] {
      auto lin = torch::nn::Linear(4, 4);
      torch::NoGradGuard no_grad;
      lin->bias.copy_(lin->weight.sum(1));
      return lin;
    });
  } catch (const std::exception& e) {
    refusal = e.what();
  }
  const auto [largest, shards] = shard_bytes(d->units());
  return json{{"was_deferred", was_deferred}, {"bitwise_equal", equal}, {"first_difference", first_difference},
              {"rng_continues_equal", torch::equal(after_normal, after_deferred)},
              {"normal_peak_bytes", normal_peak}, {"deferred_peak_bytes", deferred_peak},
              {"largest_unit_bytes", largest}, {"shard_bytes", shards}, {"rank", rank}, {"refusal", refusal},
              {"trains_equal", trains_equal}};
}

}  // namespace worker
