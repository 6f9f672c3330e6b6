// fsdp-train --export-init DIR: for training the same run elsewhere (bench/vs_pytorch.py), the
// initial weights every rank starts from, every step's global batch, and the settings, in files
// Python's torch.load reads.
#include <filesystem>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "config.h"

namespace train {

int export_init(const Config& c) {
  namespace fs = std::filesystem;
  if (c.model.rfind("t5-", 0) == 0 || c.model.rfind("dhen-", 0) == 0) {
    throw std::invalid_argument("--export-init writes the GPT's initial weights for bench/vs_pytorch.py; --model " +
                                c.model + " has no Python counterpart there");
  }
  if (c.lr_schedule != "constant" || c.warmup_steps > 0) {
    throw std::invalid_argument("--export-init: bench/vs_pytorch.py trains its peers at a constant --lr; drop --lr-schedule "
                                "and --warmup-steps");
  }
  fs::create_directories(c.export_init);
  auto data = models::TokenSource::from_path(c.data);
  const auto cfg = model_config(c, data);
  torch::manual_seed(c.seed);
  models::GPT model(cfg);
  auto write = [&](const std::string& name, const c10::impl::GenericDict& dict) {
    const std::vector<char> bytes = torch::pickle_save(dict);
    const fs::path tmp = fs::path(c.export_init) / (name + ".tmp"), dst = fs::path(c.export_init) / name;
    std::ofstream f(tmp, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f.flush()) throw std::runtime_error("writing " + tmp.string() + " failed");
    f.close();
    fs::rename(tmp, dst);  // never a half-written file under the final name
  };
  c10::impl::GenericDict weights(c10::StringType::get(), c10::TensorType::get());
  for (const auto& item : model->named_parameters()) weights.insert(item.key(), item.value().detach().clone());
  write("init.pt", weights);
  std::vector<torch::Tensor> xs, ys;
  for (int step = 0; step < c.steps; ++step) {
    auto [x, y] = data.batch(step, c.global_batch, cfg.block_size, c.seed, 0, c.global_batch);
    xs.push_back(x);
    ys.push_back(y);
  }
  c10::impl::GenericDict batches(c10::StringType::get(), c10::TensorType::get());
  batches.insert("x", torch::stack(xs));
  batches.insert("y", torch::stack(ys));
  write("batches.pt", batches);
  const nlohmann::json settings = {
      {"vocab_size", cfg.vocab_size}, {"block_size", cfg.block_size}, {"n_layer", cfg.n_layer},
      {"n_head", cfg.n_head}, {"d_model", cfg.d_model}, {"attention", c.attention}, {"steps", c.steps}, {"global_batch", c.global_batch},
      {"lr", c.lr}, {"weight_decay", c.weight_decay}, {"clip", c.clip}, {"seed", c.seed},
      {"adamw", {{"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}}},
      {"no_decay_rule", "parameter name contains 'bias' or 'ln'; the tied weight once, first name wins"}};
  std::ofstream(fs::path(c.export_init) / "config.json") << settings.dump(2) << "\n";
  std::cout << "fsdp-train: wrote " << model->named_parameters().size() << " tensors, " << c.steps
            << " batches and config.json to " << c.export_init << std::endl;
  return 0;
}

}  // namespace train
