// fsdp-test-worker overlap [prefetch flags] --out PREFIX
//   Three steps of a 4-block GPT; writes the last step's timeline and overlap metrics.
#include "worker.h"

namespace worker {

json run_overlap(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  fsdp::Options opts = options_from(a);
  const int rank = mesh->rank();
  const int64_t per = kGlobalBatch / mesh->world_size();
  torch::manual_seed(0);
  auto cfg = models::GPTConfig::preset("tiny");
  cfg.n_layer = 4;
  models::GPT gpt(cfg);
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  fsdp::FullyShardedDataParallel sharded(gpt, mesh, opts);
  torch::optim::SGD opt(gpt->parameters(), torch::optim::SGDOptions(0.1));
  // Step 0 has no previous order for forward prefetch; the last step is the one to look at.
  for (int step = 0; step < 3; ++step) {
    sharded.reset_step();
    opt.zero_grad();
    auto loss = gpt_loss([&](const torch::Tensor& x) { return sharded.forward(x); }, step, rank * per, rank * per + per);
    loss.backward();
    opt.step();
  }
  const json spans = timeline_json(sharded);
  json names = json::array();
  for (const auto& u : sharded.units()) names.push_back(u.name);
  const auto m = sharded.metrics();
  return json{{"units", names}, {"spans", spans}, {"max_all_gathers_in_flight", m.overlap.max_all_gathers_in_flight},
              {"exposed_ns", m.overlap.exposed_ns()}, {"all_gather_calls", m.comm.all_gather_calls},
              {"reduce_scatter_calls", m.comm.reduce_scatter_calls}, {"all_reduce_calls", m.comm.all_reduce_calls}};
}

}  // namespace worker
