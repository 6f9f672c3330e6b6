// fsdp-test-worker parity --strategy S [--shard-size F] [--variants all] --out PREFIX
//   Trains the tiny GPT, the uneven net, the tiny T5 and the tiny DHEN-like model with SGD+momentum and AdamW for
//   5 steps under fsdp and, in the same process, a local single-process reference on the whole global batch; writes
//   per case max |Δparam| and max |Δloss| (and with --variants all: two forwards then one backward,
//   accumulation with and without communication, clipping). The DHEN's embedding tables are sharded row-wise
//   across the ranks outside fsdp (Options::ignored_modules) and exchanged with all-to-all: its max |Δparam|
//   includes this rank's rows against the reference's same rows.
#include <iostream>

#include "worker.h"

namespace worker {
namespace {

json run_case(const std::shared_ptr<fsdp::Mesh>& mesh, fsdp::Options opts, const std::string& model,
              const std::string& optim, const std::string& variant) {
  const int rank = mesh->rank();
  const int64_t per_rank = kGlobalBatch / mesh->world_size(), begin = rank * per_rank, end = begin + per_rank;
  const auto dhen_cfg = models::DHENConfig::preset("dhen-tiny");
  // `sharded`: the model fsdp wraps (the DHEN's tables then hold this rank's rows).
  auto build = [&](bool sharded) -> std::shared_ptr<torch::nn::Module> {
    torch::manual_seed(0);
    std::shared_ptr<torch::nn::Module> m;
    if (model == "gpt") m = models::GPT(models::GPTConfig::preset("tiny")).ptr();
    else if (model == "t5") m = models::T5(models::T5Config::preset("t5-tiny")).ptr();
    else if (model == "dhen" && sharded && mesh->world_size() > 1) m = models::DHEN(dhen_cfg, mesh->world(), rank, mesh->world_size()).ptr();
    else if (model == "dhen") m = models::DHEN(dhen_cfg).ptr();
    else m = models::UnevenNet().ptr();
    m->to(g_device);  // initialized on the CPU (same numbers on every device), then moved
    return m;
  };
  if (std::getenv("FSDP_TEST_VERBOSE")) std::cerr << "case " << model << " " << optim << " " << variant << std::endl;
  auto ref = build(false);
  auto mine = build(true);
  opts.auto_wrap_policy = model == "gpt"    ? fsdp::module_type_policy<models::BlockImpl>()
                          : model == "t5"   ? fsdp::module_type_policy<models::T5EncoderBlockImpl, models::T5DecoderBlockImpl>()
                          : model == "dhen" ? fsdp::module_type_policy<models::DHENLayerImpl>()
                                            : fsdp::module_type_policy<torch::nn::LinearImpl>();
  if (model == "dhen") opts.ignored_modules = {std::dynamic_pointer_cast<models::DHENImpl>(mine)->sparse.ptr()};
  fsdp::FullyShardedDataParallel<torch::nn::Module> sharded(mine, mesh, opts);
  auto ref_opt = make_optim(optim, *ref);
  auto my_opt = make_optim(optim, *mine);

  // Loss of a module on a batch slice; `fwd` runs the module (locally or through the root).
  // T5 reads the sequence and writes it reversed (models::t5_reverse_task); `fwd` takes the
  // source and the decoder's input stacked as [2, B, T].
  auto loss_on = [&](auto&& fwd, int64_t step, int64_t b, int64_t e) {
    if (model == "gpt") return gpt_loss(fwd, step, b, e);
    if (model == "t5") {
      auto [x, unused] = corpus().batch(step, kGlobalBatch, 16, 9, b, e);
      auto [tgt_in, target] = models::t5_reverse_task(x);
      const torch::Tensor logits = fwd(torch::stack({x, tgt_in}).to(g_device));
      return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}).to(g_device));
    }
    if (model == "dhen") {
      // Dense features and ids side by side in one float tensor for `fwd` (ids below 2^24 are exact).
      static const models::ClickData clicks(models::DHENConfig::preset("dhen-tiny"), 3);
      auto [dense, ids, labels] = clicks.batch(step, kGlobalBatch, b, e);
      return models::click_loss(fwd(torch::cat({dense, ids.to(torch::kFloat)}, 1).to(g_device)), labels.to(g_device));
    }
    auto [x, y] = uneven_batch(step, b, e);
    return torch::mse_loss(fwd(x), y);
  };
  auto forward_of = [&](const std::shared_ptr<torch::nn::Module>& m, const torch::Tensor& x) {
    if (model == "t5") return std::dynamic_pointer_cast<models::T5Impl>(m)->forward(x[0], x[1]);
    if (model == "dhen") {
      const int64_t n_dense = dhen_cfg.n_dense;
      return std::dynamic_pointer_cast<models::DHENImpl>(m)->forward(
          x.narrow(1, 0, n_dense), x.narrow(1, n_dense, x.size(1) - n_dense).to(torch::kLong));
    }
    return model == "gpt" ? std::dynamic_pointer_cast<models::GPTImpl>(m)->forward(x)
                          : std::dynamic_pointer_cast<models::UnevenNetImpl>(m)->forward(x);
  };
  auto ref_fwd = [&](const torch::Tensor& x) { return forward_of(ref, x); };
  // The root wrapper is typed on Module here, so the concrete forward runs through forward_with.
  auto my_fwd = [&](const torch::Tensor& x) { return sharded.forward_with([&] { return forward_of(mine, x); }); };

  double max_loss_diff = 0, max_norm_diff = 0;
  for (int step = 0; step < kSteps; ++step) {
    ref_opt->zero_grad();
    my_opt->zero_grad();
    auto ref_loss = loss_on(ref_fwd, step, 0, kGlobalBatch);
    ref_loss.backward();
    torch::Tensor my_loss;
    // Micro-batches of a rank's slice may differ in size (3 = 1 + 2): weight each mean by its share.
    const int64_t mid = begin + per_rank / 2;
    const double w1 = double(mid - begin) / per_rank, w2 = double(end - mid) / per_rank;
    if (variant == "two_forwards") {
      // Two forwards, one backward: the mean of the halves' means is the slice's mean.
      auto l1 = loss_on(my_fwd, step, begin, mid), l2 = loss_on(my_fwd, step, mid, end);
      my_loss = l1 * w1 + l2 * w2;
      my_loss.backward();
    } else if (variant == "accum" || variant == "no_sync") {
      // Two micro-batches accumulated into one step, with or without communicating the first.
      torch::Tensor l1;
      if (variant == "no_sync") {
        auto guard = sharded.no_sync();
        l1 = loss_on(my_fwd, step, begin, mid) * w1;
        l1.backward();
      } else {
        l1 = loss_on(my_fwd, step, begin, mid) * w1;
        l1.backward();
      }
      auto l2 = loss_on(my_fwd, step, mid, end) * w2;
      l2.backward();
      my_loss = l1.detach() + l2.detach();
    } else {
      my_loss = loss_on(my_fwd, step, begin, end);
      my_loss.backward();
    }
    if (variant == "clip") {
      // Unique parameters: libtorch's parameters() lists a tied weight twice, which would count
      // (and scale) its gradient twice.
      std::vector<torch::Tensor> ref_unique;
      for (auto& kv : unique_params(*ref)) ref_unique.push_back(kv.second);
      const double ref_norm = torch::nn::utils::clip_grad_norm_(ref_unique, 0.05);
      const double my_norm = sharded.clip_grad_norm_(0.05);
      max_norm_diff = std::max(max_norm_diff, std::abs(ref_norm - my_norm));
    }
    ref_opt->step();
    my_opt->step();
    max_loss_diff = std::max(max_loss_diff, std::abs(global_mean(mesh, my_loss) - ref_loss.item<double>()));
  }

  // This rank's shard of every parameter against the same elements of the reference.
  double max_param_diff = max_shard_diff(sharded, *mine, *ref, rank);
  if (model == "dhen") {
    // The embedding rows this rank holds, against the same rows of the whole reference table.
    const auto& emb = std::dynamic_pointer_cast<models::DHENImpl>(mine)->sparse;
    const torch::Tensor ref_rows =
        std::dynamic_pointer_cast<models::DHENImpl>(ref)->sparse->weight.narrow(0, emb->row_begin(), emb->local_rows());
    if (emb->local_rows() > 0) {
      max_param_diff = std::max(max_param_diff, (emb->weight.detach().cpu() - ref_rows.detach().cpu()).abs().max().item<double>());
    }
  }
  // An unused parameter must keep no gradient, as in local training.
  bool unused_grad_none = true;
  if (model == "uneven") unused_grad_none = !mine->named_parameters()["unused"].grad().defined();
  return json{{"model", model}, {"optim", optim}, {"variant", variant}, {"max_param_diff", max_param_diff},
              {"max_loss_diff", max_loss_diff}, {"max_norm_diff", max_norm_diff}, {"unused_grad_none", unused_grad_none}};
}

}  // namespace

json run_parity(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  json cases = json::array();
  for (std::string model : {"gpt", "uneven", "t5", "dhen"}) {
    for (std::string optim : {"sgd", "adamw"}) cases.push_back(run_case(mesh, options_from(a), model, optim, "plain"));
  }
  if (a.variants == "all") {
    for (std::string v : {"two_forwards", "accum", "no_sync", "clip"}) {
      cases.push_back(run_case(mesh, options_from(a), "gpt", "sgd", v));
      cases.push_back(run_case(mesh, options_from(a), "uneven", "adamw", v));
    }
  }
  return json{{"rank", mesh->rank()}, {"cases", cases}};
}

}  // namespace worker
