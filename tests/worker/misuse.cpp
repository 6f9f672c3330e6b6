// fsdp-test-worker misuse [--strategy S] --out PREFIX
//   What happens when a user steps outside the supported path, one fresh tiny GPT per case: the
//   model's own forward called directly, model->to() or set_data() on a parameter after wrapping,
//   an optimizer step while a forward's graph still needs gathered parameters, reading parameters
//   outside forward, the wrapper's deduplicated parameter list, and ignored modules (what fsdp leaves alone:
//   not in a unit, not broadcast, whole gradients; the errors around them). Writes, per case, the error
//   message (or "" when nothing was thrown) and what was observed.
#include "fsdp/checkpoint.h"
#include "worker.h"

namespace worker {
json run_misuse(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const int rank = mesh->rank();
  const int64_t per = kGlobalBatch / mesh->world_size();
  fsdp::Options opts = options_from(a);
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  auto fresh = [&] {
    torch::manual_seed(0);
    return models::GPT(models::GPTConfig::preset("tiny"));
  };
  auto batch = [&] { return corpus().batch(0, kGlobalBatch, 32, 5, rank * per, rank * per + per); };
  json out;

  {  // the model's own forward, called directly
    auto model = fresh();
    fsdp::FullyShardedDataParallel sharded(model, mesh, opts);
    auto [x, y] = batch();
    out["direct_call"] = error_of([&] { model->forward(x); });
    // Through the wrapper the same call works, and the model's parameters read outside forward are
    // this rank's shards.
    auto fc = model->named_parameters()["blocks.0.mlp.fc.weight"];
    out["shard_numel"] = fc.numel();
    out["full_numel"] = 4 * 32 * 32;
    out["wrapped_call"] = error_of([&] { models::lm_loss(sharded.forward(x), y).backward(); });
    out["unique_parameters"] = sharded.parameters().size();
    out["libtorch_parameters"] = model->parameters().size();
    out["named_first"] = sharded.named_parameters().front().first;
  }
  {  // an optimizer step while the forward's graph (which needs gathered parameters) is alive
    auto model = fresh();
    fsdp::FullyShardedDataParallel sharded(model, mesh, opts);
    torch::optim::SGD optim(sharded.parameters(), torch::optim::SGDOptions(0.1));
    auto [x, y] = batch();
    models::lm_loss(sharded.forward(x), y).backward();  // gradients to step with
    auto loss = models::lm_loss(sharded.forward(x), y);
    out["step_before_backward"] = error_of([&] { optim.step(); });
    out["backward_after_refusal"] = error_of([&] { loss.backward(); });
    out["step_after_backward"] = error_of([&] { optim.step(); });
  }
  {  // the same with optimizers that read the parameter before writing it: weight decay, moments
    json reads_first;
    auto make = [](const std::string& name, std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
      if (name == "sgd_weight_decay") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).weight_decay(0.01));
      if (name == "adam") return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
      if (name == "adamw") return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-3));
      if (name == "rmsprop") return std::make_unique<torch::optim::RMSprop>(params, torch::optim::RMSpropOptions(1e-3));
      return std::make_unique<torch::optim::Adagrad>(params, torch::optim::AdagradOptions(1e-2));
    };
    for (const std::string name : {"sgd_weight_decay", "adam", "adamw", "rmsprop", "adagrad"}) {
      auto model = fresh();
      fsdp::FullyShardedDataParallel sharded(model, mesh, opts);
      auto optim = make(name, sharded.parameters());
      auto [x, y] = batch();
      models::lm_loss(sharded.forward(x), y).backward();
      auto loss = models::lm_loss(sharded.forward(x), y);
      reads_first[name] = {{"before_backward", error_of([&] { optim->step(); })},
                           {"backward_after", error_of([&] { loss.backward(); })},
                           {"after_backward", error_of([&] { optim->step(); })}};
    }
    out["step_before_backward_reads_first"] = reads_first;
  }
  {  // model->to() after wrapping
    auto model = fresh();
    fsdp::FullyShardedDataParallel sharded(model, mesh, opts);
    model->to(torch::kDouble);
    auto [x, y] = batch();
    out["to_after_wrap"] = error_of([&] { sharded.forward(x); });
  }
  {  // set_data on a managed parameter
    auto model = fresh();
    fsdp::FullyShardedDataParallel sharded(model, mesh, opts);
    auto p = model->named_parameters()["ln_f.weight"];
    p.set_data(torch::ones({32}));
    auto [x, y] = batch();
    out["set_data_after_wrap"] = error_of([&] { sharded.forward(x); });
  }
  {  // Options::ignored_modules: what fsdp leaves alone, and the errors around it
    auto model = fresh();
    auto other = torch::nn::Linear(4, 4);
    fsdp::Options o = opts;
    o.ignored_modules = {other.ptr()};
    out["ignored_not_in_model"] = error_of([&] { fsdp::FullyShardedDataParallel sharded(model, mesh, o); });
    fsdp::fully_shard(*model->blocks[0]);
    o.ignored_modules = {model->blocks[0]};
    out["ignored_marked"] = error_of([&] { fsdp::FullyShardedDataParallel sharded(model, mesh, o); });
  }
  {
    auto model = fresh();
    fsdp::Options o = opts;
    o.ignored_modules = {model->pos_emb.ptr()};
    o.sync_module_states = true;
    {  // each rank's own values: sync_module_states broadcasts rank 0's, but not the ignored ones
      torch::NoGradGuard no_grad;
      model->pos_emb->weight.fill_(static_cast<double>(rank));
      model->ln_f->weight.fill_(static_cast<double>(rank + 1));
    }
    fsdp::FullyShardedDataParallel sharded(model, mesh, o);
    bool in_unit = false;
    for (const auto& u : sharded.units()) {
      for (const auto& f : u.fqns) in_unit = in_unit || f == "pos_emb.weight";
    }
    out["ignored_in_a_unit"] = in_unit;
    out["ignored_kept_own_value"] = model->pos_emb->weight.detach().eq(static_cast<double>(rank)).all().item<bool>();
    {
      auto full = sharded.summon_full_params();
      out["synced_value"] = model->ln_f->weight.detach().mean().item<double>();
    }
    auto [x, y] = batch();
    models::lm_loss(sharded.forward(x), y).backward();
    const auto& g = model->pos_emb->weight.grad();
    out["ignored_grad_whole"] = g.defined() && g.sizes() == model->pos_emb->weight.sizes();
    out["ignored_listed"] = static_cast<int>(sharded.parameters().size());
    // Not declared row-sharded, so replicated: a state dict holds rank 0's copy only, and refuses
    // while the ranks' copies differ. Made equal, it is saved whole.
    out["ignored_checkpoint"] = error_of([&] { fsdp::full_state_dict(sharded); });
    {
      torch::NoGradGuard no_grad;
      model->pos_emb->weight.fill_(0.5);
    }
    out["ignored_replicated_saved"] = false;
    for (const auto& [name, t] : fsdp::full_state_dict(sharded, /*rank0_only=*/false)) {
      if (name == "pos_emb.weight") out["ignored_replicated_saved"] = t.eq(0.5).all().item<bool>();
    }
  }
  {  // tensor parallelism (fsdp/tensor_parallel.h): a plan and a wrapper that cannot agree
    auto tp = fsdp::TensorParallel::create(mesh, mesh->world_size());  // TP over every rank, DP 1
    auto split = [&] {
      auto model = fresh();
      fsdp::parallelize(*model, tp, models::gpt_tensor_parallel_plan());
      return model;
    };
    out["tp_rule_matches_nothing"] = error_of([&] {
      auto model = fresh();
      fsdp::parallelize(*model, tp, {{"blocks.*.attn.qkvx.weight", {0, 1}}});
    });
    out["tp_not_divisible"] = error_of([&] {
      auto model = fresh();
      fsdp::parallelize(*model, tp, {{"ln_f.weight", {0, 3}}});
    });
    out["tp_twice"] = error_of([&] {
      auto model = split();
      fsdp::parallelize(*model, tp, models::gpt_tensor_parallel_plan());
    });
    out["tp_without_option"] = error_of([&] { fsdp::FullyShardedDataParallel sharded(split(), tp->data_parallel(), opts); });
    fsdp::Options with = opts;
    with.tensor_parallel = tp;
    out["tp_over_world"] = error_of([&] { fsdp::FullyShardedDataParallel sharded(split(), mesh, with); });
    auto model = split();
    fsdp::FullyShardedDataParallel sharded(model, tp->data_parallel(), with);
    out["tp_sharded_state_dict"] = error_of([&] { fsdp::sharded_state_dict(sharded); });
    // The split weight holds this rank's rows; the whole model's state dict has them all.
    out["tp_local_rows"] = model->tok_emb->weight.numel();
    const auto whole = fsdp::full_state_dict(sharded, /*rank0_only=*/false);
    for (const auto& [name, t] : whole) {
      if (name == "tok_emb.weight") out["tp_whole_rows"] = t.size(0);
    }
  }
  out["rank"] = rank;
  return out;
}

}  // namespace worker
