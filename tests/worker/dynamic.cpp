// fsdp-test-worker dynamic [prefetch flags] --out PREFIX
//   Trains a stack whose blocks run in a different order (and not all of them) every step,
//   against local training of the same model; writes max |Δparam| and max |Δloss|.
#include "worker.h"

namespace worker {

json run_dynamic(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  fsdp::Options opts = options_from(a);
  const int rank = mesh->rank();
  const int64_t per_rank = kGlobalBatch / mesh->world_size(), begin = rank * per_rank;
  torch::manual_seed(0);
  RoutedStack ref;
  torch::manual_seed(0);
  RoutedStack mine;
  opts.auto_wrap_policy = [](const std::string& fqn, const torch::nn::Module&, int64_t) {
    return fqn.rfind("block", 0) == 0;
  };
  fsdp::FullyShardedDataParallel sharded(mine, mesh, opts);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD my_opt(mine->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  double max_loss_diff = 0;
  for (int64_t step = 0; step < 7; ++step) {
    auto [x, y] = uneven_batch(step, 0, kGlobalBatch);
    ref_opt.zero_grad();
    my_opt.zero_grad();
    auto ref_loss = torch::mse_loss(ref->forward(x, step), y);
    ref_loss.backward();
    ref_opt.step();
    auto my_loss = torch::mse_loss(sharded.forward(x.slice(0, begin, begin + per_rank), step),
                                   y.slice(0, begin, begin + per_rank));
    my_loss.backward();
    my_opt.step();
    max_loss_diff = std::max(max_loss_diff, std::abs(global_mean(mesh, my_loss) - ref_loss.item<double>()));
  }
  return json{{"max_param_diff", max_shard_diff(sharded, *mine, *ref, rank)}, {"max_loss_diff", max_loss_diff}};
}

}  // namespace worker
