// fsdp-test-worker summon [--strategy S] [--mixed-precision bf16] --out PREFIX
//   summon_full_params against local training: after two SGD steps, every parameter whole on every
//   rank equals the local model's; with rank0_only only rank 0 sees whole parameters; an in-place
//   change written back (every parameter halved) lands in the shards, and the next step still
//   equals local training given the same change; forward inside the scope is refused.
#include <set>

#include "engine/flat_param.h"
#include "worker.h"

namespace worker {

json run_summon(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const int rank = mesh->rank();
  const int64_t per = kGlobalBatch / mesh->world_size();
  fsdp::Options opts = options_from(a);
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  if (a.mixed_precision != "none") {
    const auto d = fsdp::parse_dtype(a.mixed_precision);
    opts.mixed_precision = fsdp::MixedPrecision{d, d, d, false};
  }
  torch::manual_seed(0);
  models::GPT ref(models::GPTConfig::preset("tiny"));
  torch::manual_seed(0);
  models::GPT mine(models::GPTConfig::preset("tiny"));
  fsdp::FullyShardedDataParallel sharded(mine, mesh, opts);
  std::vector<torch::Tensor> ref_params;
  for (auto& kv : unique_params(*ref)) ref_params.push_back(kv.second);
  torch::optim::SGD ref_opt(ref_params, torch::optim::SGDOptions(0.1));
  torch::optim::SGD my_opt(sharded.parameters(), torch::optim::SGDOptions(0.1));
  auto train_step = [&](int step) {
    ref_opt.zero_grad();
    my_opt.zero_grad();
    if (!opts.mixed_precision) gpt_loss([&](const torch::Tensor& x) { return ref->forward(x); }, step, 0, kGlobalBatch).backward();
    gpt_loss([&](const torch::Tensor& x) { return sharded.forward(x); }, step, rank * per, rank * per + per).backward();
    if (!opts.mixed_precision) ref_opt.step();
    my_opt.step();
  };
  auto max_full_diff = [&] {
    double diff = 0;
    auto ref_named = ref->named_parameters();
    for (auto& [name, p] : sharded.named_parameters()) {
      if (p.sizes() != ref_named[name].sizes()) return -1.0;  // not whole
      diff = std::max(diff, (p.detach().to(torch::kDouble) - ref_named[name].detach().to(torch::kDouble)).abs().max().item<double>());
    }
    return diff;
  };
  train_step(0);
  train_step(1);
  json out{{"rank", rank}};
  std::map<std::string, torch::Tensor> shards;  // what each parameter holds outside the scope
  for (auto& [name, p] : sharded.named_parameters()) shards[name] = p.detach().clone();
  {
    auto full = sharded.summon_full_params();
    // Whole, and this rank's part of each equal to its shard, bit for bit, in the master dtype.
    double slice_diff = 0;
    std::set<std::string> dtypes;
    const int F = sharded.shard_size();
    for (const auto& unit : sharded.units()) {
      auto named = mine->named_parameters();
      std::vector<std::vector<int64_t>> shapes;
      for (const auto& f : unit.fqns) shapes.push_back(named[f].sizes().vec());
      const fsdp::FlatParamLayout layout(unit.fqns, shapes, F);
      for (size_t i = 0; i < unit.fqns.size(); ++i) {
        const auto s = layout.slice(i, rank % F);
        const auto whole = named[unit.fqns[i]].detach().reshape(-1);
        dtypes.insert(fsdp::dtype_name(whole.scalar_type()));
        if (s.length == 0) continue;
        const auto part = F == 1 ? whole : whole.narrow(0, s.param_begin, s.length);
        slice_diff = std::max(slice_diff, (part - shards[unit.fqns[i]].reshape(-1)).abs().max().item<double>());
      }
    }
    out["slice_diff"] = slice_diff;
    out["dtypes"] = dtypes;
    out["full_diff"] = opts.mixed_precision ? 0.0 : max_full_diff();  // no local reference for mixed precision
    auto [x, y] = corpus().batch(0, kGlobalBatch, 32, 7, 0, 1);
    try {
      sharded.forward(x);
      out["forward_inside"] = "";
    } catch (const std::exception& e) {
      out["forward_inside"] = e.what();
    }
  }
  {
    auto full = sharded.summon_full_params(fsdp::SummonOptions{false, true});
    out["rank0_only_whole"] = max_full_diff() >= 0;
  }
  {
    // Weight surgery: halve everything, on every rank, written back into the shards.
    auto full = sharded.summon_full_params();
    torch::NoGradGuard no_grad;
    for (auto& p : sharded.parameters()) p.mul_(0.5);
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& p : ref_params) p.mul_(0.5);
  }
  train_step(2);
  out["after_surgery_shard_diff"] = opts.mixed_precision ? 0.0 : max_shard_diff(sharded, *mine, *ref, rank);
  return out;
}

}  // namespace worker
