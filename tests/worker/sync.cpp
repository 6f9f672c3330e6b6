// fsdp-test-worker sync --sync-module-states 0|1 --out PREFIX
//   Each rank builds the model from its own seed; trains against a local reference built from
//   rank 0's seed. Writes the initial and final max |Δparam|.
#include "worker.h"

namespace worker {

json run_sync(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  fsdp::Options opts = options_from(a);
  const int W = mesh->world_size(), rank = mesh->rank();
  const int64_t per = kGlobalBatch / W;
  const auto cfg = models::GPTConfig::preset("tiny");
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  opts.sync_module_states = a.sync_module_states != 0;
  torch::manual_seed(100 + rank);  // every rank a different initialization
  models::GPT mine(cfg);
  torch::manual_seed(100);  // rank 0's
  models::GPT ref(cfg);
  fsdp::FullyShardedDataParallel sharded(mine, mesh, opts);
  torch::optim::SGD opt(mine->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  const double initial = max_shard_diff(sharded, *mine, *ref, rank);
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    gpt_loss([&](const torch::Tensor& x) { return sharded.forward(x); }, step, rank * per, rank * per + per).backward();
    opt.step();
    gpt_loss([&](const torch::Tensor& x) { return ref->forward(x); }, step, 0, kGlobalBatch).backward();
    ref_opt.step();
  }
  return json{{"initial_diff", initial}, {"max_param_diff", max_shard_diff(sharded, *mine, *ref, rank)}};
}

}  // namespace worker
