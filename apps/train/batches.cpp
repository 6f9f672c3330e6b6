// One rank's batches: on its device, cut into micro-batches, averaged over the ranks, and the
// held-out batch an evaluation reads (each rank its slice, the outputs gathered for the workload's
// own figures).
#include "batches.h"

namespace train {
namespace {

// Every rank's slice of `t` (equal slices, first dimension), in rank order, on every rank.
torch::Tensor all_gather_rows(fsdp::Mesh& mesh, const torch::Tensor& t) {
  torch::Tensor mine = t.detach().to(torch::kCPU, torch::kFloat).contiguous();
  if (mesh.world_size() == 1) return mine;
  std::vector<int64_t> shape = mine.sizes().vec();
  shape[0] *= mesh.world_size();
  torch::Tensor all = torch::empty(shape, mine.options());
  mesh.world()->_allgather_base(all, mine)->wait();
  return all;
}

}  // namespace

double global_mean(fsdp::Mesh& mesh, const torch::Tensor& value) {
  std::vector<at::Tensor> l{value.detach().reshape({1}).to(torch::kCPU, torch::kFloat).clone()};
  mesh.world()->allreduce(l)->wait();
  return l[0].item<double>() / mesh.world_size();
}

Batch on_device(Batch b, const torch::Device& device) {
  if (!device.is_cuda()) return b;
  for (auto& t : b.inputs) t = t.to(device, /*non_blocking=*/true);
  b.targets = b.targets.to(device, /*non_blocking=*/true);
  return b;
}

Batch slice(const Batch& b, int64_t begin, int64_t n) {
  Batch out;
  for (const auto& t : b.inputs) out.inputs.push_back(t.narrow(0, begin, n));
  out.targets = b.targets.narrow(0, begin, n);
  return out;
}

std::map<std::string, double> evaluate_held_out(const Config& c, const Workload& workload, torch::nn::Module& model,
                                                Trainee& trainee, fsdp::Mesh& mesh, const torch::Device& device,
                                                int step) {
  const int W = mesh.world_size(), rank = mesh.rank();
  torch::NoGradGuard no_grad;
  // Held out: without dropout, drawing nothing from the generators (the training steps' masks
  // do not depend on when evaluations ran).
  model.eval();
  struct BackToTraining {
    torch::nn::Module& m;
    ~BackToTraining() { m.train(); }
  } back{model};
  const int64_t eval_n = workload.eval_samples(c.global_batch), eval_per_rank = eval_n / W;
  const Batch held_out = on_device(
      workload.batch(-1 - step, eval_n, c.seed, rank * eval_per_rank, (rank + 1) * eval_per_rank), device);
  const torch::Tensor out = trainee.forward([&] { return workload.forward(model, held_out, trainee.input_dtype()); });
  std::map<std::string, double> figures = {{"loss", global_mean(mesh, workload.loss(model, out, held_out))}};
  for (const auto& [name, value] : workload.evaluate(all_gather_rows(mesh, out), all_gather_rows(mesh, held_out.targets))) {
    figures[name] = value;
  }
  return figures;
}

}  // namespace train
