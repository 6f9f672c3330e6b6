// A model of our own, trained with fsdp in a few lines: an MLP with typed members learns a fixed
// random linear map, each Linear its own FSDP unit, full sharding over the ranks.
//
//   regression --nproc-per-node 2      (or under torchrun --no-python)
#include <cstdio>

#include <torch/torch.h>

#include "fsdp/fsdp.h"
#include "fsdp/launch.h"

struct RegressorImpl : torch::nn::Module {
  RegressorImpl() {
    in = register_module("in", torch::nn::Linear(32, 64));
    hidden = register_module("hidden", torch::nn::Linear(64, 64));
    out = register_module("out", torch::nn::Linear(64, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out(torch::relu(hidden(torch::relu(in(x))))); }
  torch::nn::Linear in{nullptr}, hidden{nullptr}, out{nullptr};
};
TORCH_MODULE(Regressor);

int main(int argc, char** argv) {
  if (auto code = fsdp::maybe_launch_local(argc, argv)) return *code;
  try {
    auto mesh = fsdp::Mesh::create(fsdp::LaunchEnv::from_environment());
    torch::manual_seed(0);  // the same initial weights and data on every rank
    Regressor model;
    const auto target = torch::randn({32, 8});
    fsdp::Options options;
    options.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
    fsdp::FullyShardedDataParallel sharded(model, mesh, options);
    torch::optim::Adam optim(model->parameters(), torch::optim::AdamOptions(1e-2));

    const int64_t global_batch = 64, per_rank = global_batch / mesh->world_size();
    double first = 0, last = 0;
    for (int step = 0; step < 60; ++step) {
      const auto x = torch::randn({global_batch, 32});
      const auto mine = x.slice(0, mesh->rank() * per_rank, (mesh->rank() + 1) * per_rank);
      optim.zero_grad();
      auto loss = torch::mse_loss(sharded.forward(mine), mine.matmul(target));
      loss.backward();
      sharded.clip_grad_norm_(1.0);
      optim.step();
      std::vector<torch::Tensor> global{loss.detach().reshape({1})};
      mesh->world()->allreduce(global)->wait();  // the global batch's mean loss
      last = global[0].item<double>() / mesh->world_size();
      if (step == 0) first = last;
      if (mesh->rank() == 0 && step % 20 == 0) std::printf("step %2d loss %.4f\n", step, last);
    }
    if (mesh->rank() == 0) std::printf("loss %.4f -> %.4f over 60 steps on %d ranks\n", first, last, mesh->world_size());
    return last < 0.5 * first ? 0 : 2;  // it must have learned something
  } catch (const std::exception& e) {
    std::fprintf(stderr, "regression: error: %s\n", e.what());
    return 1;
  }
}
