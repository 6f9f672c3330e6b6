// fsdp-test-worker accounting --strategy S [--shard-size F] --out PREFIX
//   Two training steps of the tiny GPT; writes the units, each step's communication and memory
//   metrics, and the memory plan computed from the shapes alone before sharding.
#include "fsdp/plan.h"
#include "worker.h"

namespace worker {

json run_accounting(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const int rank = mesh->rank();
  torch::manual_seed(0);
  models::GPT gpt(models::GPTConfig::preset("tiny"));
  fsdp::Options o = options_from(a);
  o.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  // The memory plan from the shapes alone (before sharding), to hold against what is measured.
  const auto plan = fsdp::plan_memory(*gpt, mesh->world_size(), o, mesh->env().local_world_size);
  fsdp::FullyShardedDataParallel sharded(gpt, mesh, o);
  torch::optim::SGD opt(gpt->parameters(), torch::optim::SGDOptions(0.1));
  const int64_t per = kGlobalBatch / mesh->world_size();
  json steps = json::array();
  for (int step = 0; step < 2; ++step) {
    sharded.reset_step();
    opt.zero_grad();
    auto loss = gpt_loss([&](const torch::Tensor& x) { return sharded.forward(x); }, step, rank * per, rank * per + per);
    loss.backward();
    opt.step();
    auto m = sharded.metrics();
    steps.push_back(json{{"all_gather", m.comm.all_gather}, {"reduce_scatter", m.comm.reduce_scatter},
                         {"all_reduce", m.comm.all_reduce}, {"all_gather_calls", m.comm.all_gather_calls},
                         {"reduce_scatter_calls", m.comm.reduce_scatter_calls}, {"sharded_params", m.memory.sharded_params},
                         {"sharded_grads", m.memory.sharded_grads}, {"unsharded_peak", m.memory.unsharded_peak},
                         {"unsharded_current", m.memory.unsharded_current}});
  }
  json units = json::array();
  for (const auto& u : sharded.units()) {
    units.push_back(json{{"name", u.name}, {"numel", u.numel}, {"padded_numel", u.padded_numel},
                         {"shard_numel", u.shard_numel}, {"is_root", u.is_root}, {"element_size", u.element_size}});
  }
  return json{{"rank", rank}, {"world_size", mesh->world_size()}, {"shard_size", sharded.shard_size()},
              {"units", units}, {"steps", steps},
              {"plan", {{"sharded_params", plan.sharded_params}, {"sharded_grads", plan.sharded_grads},
                        {"peak_unsharded_params", plan.peak_unsharded_params}, {"shard_size", plan.shard_size}}}};
}

}  // namespace worker
