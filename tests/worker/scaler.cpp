// fsdp-test-worker scaler --inf-rank R --out PREFIX
//   fp16 training with the ShardedGradScaler; rank R's gradient gets an inf at step 2. Writes per
//   step whether it stepped, the scale before and after, and whether the parameters changed.
#include <limits>

#include "fsdp/grad_scaler.h"
#include "worker.h"

namespace worker {

json run_scaler(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  fsdp::Options opts = options_from(a);
  const int W = mesh->world_size(), rank = mesh->rank();
  const int64_t per = kGlobalBatch / W;
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  opts.mixed_precision = fsdp::MixedPrecision{torch::kHalf, torch::kHalf, torch::kHalf, false};
  torch::manual_seed(0);
  models::GPT mine(models::GPTConfig::preset("tiny"));
  fsdp::FullyShardedDataParallel sharded(mine, mesh, opts);
  torch::optim::SGD opt(mine->parameters(), torch::optim::SGDOptions(0.05));
  fsdp::GradScalerOptions so;
  so.init_scale = 1024;
  so.growth_interval = 2;
  fsdp::ShardedGradScaler scaler(mesh, so);
  json steps = json::array();
  bool out_unscaled_once = false;
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    auto loss = gpt_loss([&](const torch::Tensor& x) { return sharded.forward(x); }, step, rank * per, rank * per + per);
    scaler.scale(loss).backward();
    if (step == 2 && rank == a.inf_rank) {
      // An overflow on this rank only: one element of its first sharded gradient.
      for (auto& p : mine->parameters()) {
        if (p.grad().defined() && p.grad().numel() > 0) {
          p.mutable_grad().view(-1)[0] = std::numeric_limits<float>::infinity();
          break;
        }
      }
    }
    if (step == 0) {
      // The optimizer lists the tied weight twice (it was built from libtorch's parameters()):
      // every gradient must still be divided by the scale exactly once.
      std::vector<torch::Tensor> scaled;
      for (auto& p : mine->parameters()) scaled.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
      const double scale = scaler.get_scale();
      scaler.unscale_(opt);
      bool once = true;
      auto params = mine->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        if (scaled[i].defined()) once = once && torch::equal(params[i].grad(), scaled[i] / scale);
      }
      out_unscaled_once = once;
    }
    double before = 0;
    for (auto& p : mine->parameters()) before += p.detach().to(torch::kDouble).sum().item<double>();
    const double scale_before = scaler.get_scale();
    const bool stepped = scaler.step(opt);
    scaler.update();
    double after = 0;
    for (auto& p : mine->parameters()) after += p.detach().to(torch::kDouble).sum().item<double>();
    steps.push_back(json{{"stepped", stepped}, {"scale_before", scale_before}, {"scale_after", scaler.get_scale()},
                         {"params_changed", before != after}, {"loss", loss.item<double>()}});
  }
  return json{{"steps", steps}, {"unscaled_once", out_unscaled_once}};
}

}  // namespace worker
