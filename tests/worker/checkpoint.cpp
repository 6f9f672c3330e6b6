// fsdp-test-worker checkpoint [--strategy S] --variants sgd|adam|adamw|rmsprop|adagrad --out PREFIX
//   Each optimizer adapter, through a real save and load: train the tiny GPT 3 steps with the
//   optimizer (options that use every state tensor it has), save a SHARDED checkpoint, train 2 more
//   steps; then a model built from other weights and an optimizer with another learning rate load
//   the checkpoint and train the same 2 steps. Writes both runs' losses (equal bit for bit when the
//   weights, the state tensors, the step counts and the hyper-parameters all came back), and the
//   error a save with an unsupported optimizer (LBFGS) gives.
#include "fsdp/checkpoint.h"
#include "worker.h"

namespace worker {
namespace {

std::unique_ptr<torch::optim::Optimizer> optimizer(const std::string& kind, std::vector<torch::Tensor> params, double lr) {
  using namespace torch::optim;
  if (kind == "sgd") return std::make_unique<SGD>(params, SGDOptions(lr).momentum(0.9).nesterov(true));
  if (kind == "adam") return std::make_unique<Adam>(params, AdamOptions(lr).amsgrad(true));
  if (kind == "adamw") return std::make_unique<AdamW>(params, AdamWOptions(lr).weight_decay(0.1));
  if (kind == "rmsprop") return std::make_unique<RMSprop>(params, RMSpropOptions(lr).momentum(0.5).centered(true));
  if (kind == "adagrad") return std::make_unique<Adagrad>(params, AdagradOptions(lr).initial_accumulator_value(0.1));
  throw std::invalid_argument("unknown optimizer '" + kind + "'");
}

}  // namespace

json run_checkpoint(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const int rank = mesh->rank();
  const int64_t per = kGlobalBatch / mesh->world_size();
  fsdp::Options opts = options_from(a);
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  const std::string dir = a.out + "-ckpt-" + a.variants;
  auto step = [&](auto& model, torch::optim::Optimizer& optim, int s) {
    optim.zero_grad();
    auto loss = gpt_loss([&](const torch::Tensor& x) { return model.forward(x); }, s, rank * per, rank * per + per);
    loss.backward();
    optim.step();
    return loss.item().toDouble();
  };
  json out{{"rank", rank}};
  {
    torch::manual_seed(0);
    models::GPT gpt(models::GPTConfig::preset("tiny"));
    fsdp::FullyShardedDataParallel model(gpt, mesh, opts);
    auto optim = optimizer(a.variants, model.parameters(), 0.01);
    for (int s = 0; s < 3; ++s) step(model, *optim, s);
    fsdp::Checkpointer ckpt(mesh, dir);
    ckpt.save(model, optim.get(), {3, "{}"});
    for (int s = 3; s < 5; ++s) out["losses_a"].push_back(step(model, *optim, s));
    // An optimizer fsdp has no adapter for is refused before anything is written.
    torch::optim::LBFGS lbfgs(model.parameters());
    try {
      ckpt.save(model, &lbfgs, {4, "{}"});
      out["unsupported"] = "";
    } catch (const std::exception& e) {
      out["unsupported"] = e.what();
    }
  }
  {
    torch::manual_seed(1);  // other weights: all of them must come from the checkpoint
    models::GPT gpt(models::GPTConfig::preset("tiny"));
    fsdp::FullyShardedDataParallel model(gpt, mesh, opts);
    auto optim = optimizer(a.variants, model.parameters(), 0.5);  // another lr: the saved one must win
    const auto state = fsdp::load_checkpoint(fsdp::latest_checkpoint(dir).value(), model, optim.get());
    out["resumed_step"] = state.step;
    for (int s = 3; s < 5; ++s) out["losses_b"].push_back(step(model, *optim, s));
  }
  return out;
}

}  // namespace worker
