// fsdp-bench-optimizer: the optimizer step of fsdp::FusedAdamW against torch::optim::AdamW on a GPT
// preset's parameters (issue 38), in one process, stepped alternately so that machine noise hits
// both alike: the median of --repeats steps each, with fsdp-train's two groups (weight decay on
// weights, none on biases and norms). Parameters are whole (one process, --shards 1) or this rank's
// 1/N of each (--shards N: the elements one rank of full sharding over N steps).
#include <algorithm>
#include <chrono>
#include <set>
#include <iostream>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "fsdp/fused_optimizer.h"
#include "models/gpt.h"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> presets = {"default", "medium", "200m"};
  int repeats = 7, shards = 1, threads = 1;
  CLI::App app{"fsdp-bench-optimizer: FusedAdamW against libtorch's AdamW, one step, on a GPT preset's parameters"};
  app.add_option("--models", presets, "GPT presets, comma-separated")->delimiter(',');
  app.add_option("--repeats", repeats, "steps timed per optimizer (after one untimed)")->check(CLI::PositiveNumber);
  app.add_option("--shards", shards, "step 1/N of each parameter, as one rank of full sharding over N")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "intra-op threads")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);
  std::cout << "| model | elements stepped | torch::optim::AdamW (ms) | fsdp::FusedAdamW (ms) | libtorch / fused |\n"
            << "|---|---|---|---|---|" << std::endl;
  for (const auto& preset : presets) {
    torch::manual_seed(0);
    models::GPT model(models::GPTConfig::preset(preset));
    // Two copies of the parameters (flattened slices, as fsdp's shards are), their gradients shared.
    std::vector<torch::Tensor> a_decay, a_none, b_decay, b_none;
    int64_t elements = 0;
    std::set<const c10::TensorImpl*> seen;
    for (const auto& item : model->named_parameters()) {
      if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
      const auto flat = item.value().detach().flatten();
      const int64_t n = (flat.numel() + shards - 1) / shards;
      const auto part = flat.narrow(0, 0, std::min(n, flat.numel())).clone();
      elements += part.numel();
      const bool exempt = item.key().find("bias") != std::string::npos || item.key().find("ln") != std::string::npos;
      auto a = part.clone().requires_grad_(true), b = part.clone().requires_grad_(true);
      a.mutable_grad() = torch::randn_like(part) * 1e-2;
      b.mutable_grad() = a.grad().clone();
      (exempt ? a_none : a_decay).push_back(a);
      (exempt ? b_none : b_decay).push_back(b);
    }
    auto groups = [](const std::vector<torch::Tensor>& decay, const std::vector<torch::Tensor>& none) {
      std::vector<torch::optim::OptimizerParamGroup> g;
      g.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(3e-4).weight_decay(0.1)));
      g.emplace_back(none, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(3e-4).weight_decay(0.0)));
      return g;
    };
    torch::optim::AdamW libtorch(groups(a_decay, a_none), torch::optim::AdamWOptions(3e-4));
    fsdp::FusedAdamW fused(groups(b_decay, b_none), torch::optim::AdamWOptions(3e-4));
    auto time_ms = [](torch::optim::Optimizer& o) {
      const auto t0 = std::chrono::steady_clock::now();
      o.step();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    };
    time_ms(libtorch);  // state allocation: not timed
    time_ms(fused);
    std::vector<double> tl, tf;
    for (int r = 0; r < repeats; ++r) {
      tl.push_back(time_ms(libtorch));
      tf.push_back(time_ms(fused));
    }
    const double ml = median(tl), mf = median(tf);
    std::printf("| %s | %lld | %.2f | %.2f | %.1f |\n", preset.c_str(), static_cast<long long>(elements), ml, mf, ml / mf);
    std::fflush(stdout);
  }
  return 0;
}
