// fsdp-test-worker tensor_parallel --tp N [--strategy S] [--variants V,...] --out PREFIX
//   Tensor parallelism as a user writes it for a model of their own (not the project's GPT or T5):
//   a small classifier with an embedding, two residual MLP blocks (up: column-parallel, down:
//   row-parallel with a bias) and a head over 64 classes, split by a plan of its own, trained
//   with the head's vocabulary-parallel cross entropy and clipping under fsdp over the
//   data-parallel ranks, against the same model trained locally on the whole batch in the same
//   process. SGD with momentum for 5 steps. Writes the largest loss difference, the largest
//   difference of any whole parameter (full_state_dict) and of the clipping norm; or, for a
//   variant that must be refused, what the first rank to refuse said ("refused").
//   Variants (comma-separated; "plain" is none):
//     embed_unit     the embedding split by rows (vocabulary-parallel), in a unit of its own whose
//                    first operator is the lookup, and ids past V / TP
//     embed_options  the embedding with padding_idx, max_norm and scale_grad_by_freq, looked up
//                    through fsdp::vocab_parallel_embedding(Embedding&, ids) (the local oracle
//                    accumulates the batch by data-parallel slices: the frequencies are per slice)
//     tied           no head of its own: the logits through column_parallel with the embedding's
//                    weight (split by rows for the lookup, by output features for the head),
//                    the classes the vocabulary
//     qk_norm        a replicated per-head-feature norm weight applied to the split hidden
//                    features of each block, declared by a partial_gradient_rule
//     sp             sequence parallelism (TensorParallelOptions): the blocks' norms and residuals
//                    on this rank's chunk of the tokens (the norms and down's bias declared
//                    partial), pooled over the gathered sequence before the head
//     sp_no_rule     (refused) sp without the partial rules: the norms' gradients differ
//     sp_head_column (refused) sp with the sequence first (sequence_dim 0) and the head through
//                    column_parallel on pooled [batch, features]: its batch taken for a sequence
//     summon_one_tp_rank (refused) after training, a change inside summon_full_params made on TP
//                    rank 0 only
//     summon_one_rank    (refused) the same change made on world rank 0 only
//     api            no training: the cross entropy's options and the region primitives against
//                    whole-tensor arithmetic, twice, the second time through a second
//                    TensorParallel of the same process (check_api)
//   Refused (what a user gets wrong; each must be refused by name, not train silently wrong):
//     qk_norm_no_rule  the same norm weight without the rule: its gradient differs across TP
//     head_outside     the column-split head called as at::linear(h, head->weight)
//     scaler_dp        a ShardedGradScaler made on tp->data_parallel() instead of tp->world()
//     seed_per_rank    each rank builds its model from its own seed (sync_module_states on)
//     batch_by_world   each rank takes the batch slice of its world rank, not its DP rank
//     eval_first       batch_by_world after an evaluation forward on a batch every rank shares
//     via_forward_with batch_by_world through forward_with (the root sees no arguments), the
//                      embedding split: its lookup checks the ids
//     label_noise      the right rows, and one target changed on TP rank 1 (per-rank label noise)
//     bias_unsplit     the column-parallel layer's weight split and its bias not
//     id_out_of_range  an id equal to the vocabulary size in DP rank 0's rows, the embedding split
#include "fsdp/tensor_parallel.h"
#include "fsdp/checkpoint.h"
#include "fsdp/grad_scaler.h"
#include "worker.h"

namespace worker {
namespace {

constexpr int64_t kWidth = 32, kClasses = 64, kTokens = 8, kVocab = 100, kHeadDim = 16;

struct Variants {
  explicit Variants(const std::string& list) : list("," + list + ",") {}
  bool has(const std::string& v) const { return list.find("," + v + ",") != std::string::npos; }
  std::string list;
};

struct MyBlockImpl : torch::nn::Module {
  explicit MyBlockImpl(bool qk_norm) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    up = register_module("up", torch::nn::Linear(kWidth, 4 * kWidth));
    down = register_module("down", torch::nn::Linear(4 * kWidth, kWidth));
    // One weight per feature of a head, shared by every head: under TP each rank applies it to
    // its own heads only (a QK-norm's weight), so its gradient is a part of the whole one.
    if (qk_norm) qk_w = register_parameter("qk_w", torch::rand({kHeadDim}) + 0.5);
  }
  // What changes for TP: the two calls go through fsdp's layers (plain calls without a plan).
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = fsdp::column_parallel(up, norm(x));
    if (qk_w.defined()) {
      auto sizes = h.sizes().vec();
      torch::Tensor heads = h.reshape({-1, kHeadDim});
      heads = heads * torch::rsqrt(heads.pow(2).mean(-1, true) + 1e-5) * qk_w;
      h = heads.reshape(sizes);
    }
    return x + fsdp::row_parallel(down, torch::relu(h));
  }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
  torch::Tensor qk_w;
};
TORCH_MODULE(MyBlock);

struct MyNetImpl : torch::nn::Module {
  explicit MyNetImpl(const Variants& v)
      : head_outside(v.has("head_outside")), tied(v.has("tied")), head_column(v.has("sp_head_column")) {
    auto eo = torch::nn::EmbeddingOptions(kVocab, kWidth);
    // With the tied head, no scale_grad_by_freq: see per_slice_oracle in train().
    if (v.has("embed_options")) eo.padding_idx(3).max_norm(1.0).scale_grad_by_freq(!v.has("tied"));
    embed = register_module("embed", torch::nn::Embedding(eo));
    const bool qk = v.has("qk_norm") || v.has("qk_norm_no_rule");
    blocks = register_module("blocks", torch::nn::ModuleList(MyBlock(qk), MyBlock(qk)));
    if (!tied) head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(kWidth, kClasses).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    // With options (padding_idx, max_norm, scale_grad_by_freq) the module's lookup; the plain one
    // otherwise, as users of the tensor form write it.
    torch::Tensor x = embed->options.max_norm() ? fsdp::vocab_parallel_embedding(embed, ids)
                                                : fsdp::vocab_parallel_embedding(ids, embed->weight);
    // Sequence parallelism: the blocks see this rank's chunk of the tokens; the pooling needs them all.
    const auto sp = fsdp::sequence_parallel_of(blocks[0]->as<MyBlockImpl>()->up->weight);
    if (sp) x = fsdp::scatter_to_sequence_parallel_region(x, sp);
    for (const auto& b : *blocks) x = b->as<MyBlockImpl>()->forward(x);
    if (sp) x = fsdp::gather_from_sequence_parallel_region(x, sp, /*into_split_computation=*/false);
    const torch::Tensor pooled = x.mean(1);
    // A user's slip: the split head called directly (local training computes the same).
    if (head_outside) return at::linear(pooled, head->weight);
    const torch::Tensor& w = tied ? embed->weight : head->weight;
    if (sp && !head_column) {
      // Pooled features have no sequence to gather: the column-parallel product written out.
      fsdp::TensorParallelLayerScope own_layer;
      return at::linear(fsdp::copy_to_tensor_parallel_region(pooled, sp), w);
    }
    if (tied) return fsdp::column_parallel(pooled, w);  // [B, vocabulary / TP]
    return fsdp::column_parallel(head, pooled);  // [B, classes / TP]
  }
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& y) {
    return fsdp::vocab_parallel_cross_entropy(logits, y, tied ? embed->weight : head->weight);
  }
  int64_t classes() const { return tied ? kVocab : kClasses; }
  bool head_outside, tied, head_column;
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(MyNet);

// The public pieces a user's own layers are made of, against whole-tensor arithmetic on every
// rank: the vocabulary-parallel cross entropy with ignore_index, label smoothing and each
// reduction (value and the logits' gradient), the four region primitives forward and backward,
// and all of it again through a second TensorParallel made in the same process.
json check_api(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  double ce_diff = 0, region_diff = 0;
  int checks = 0;
  auto note = [&](double& worst, const at::Tensor& got, const at::Tensor& want) {
    worst = std::max(worst, got.sizes() == want.sizes() ? (got - want).abs().max().item<double>() : 1e9);
    ++checks;
  };
  for (int which = 0; which < 2; ++which) {
    auto tp = fsdp::TensorParallel::create(mesh, a.tp);
    torch::manual_seed(5);
    MyNet net(Variants(""));
    fsdp::parallelize(*net, tp, {{"head.weight", {0, 1}}});
    const int64_t parts = kClasses / tp->size(), begin = tp->rank() * parts;
    const at::Tensor whole = torch::randn({6, kClasses}) * 3;
    at::Tensor targets = torch::randint(kClasses, {6});
    targets[1] = -100;
    targets[4] = -100;
    const at::Tensor upstream = torch::rand({6}) + 0.5;
    for (const std::string reduction : {"mean", "sum", "none"}) {
      for (double smoothing : {0.0, 0.1}) {
        fsdp::VocabParallelCrossEntropyOptions o;
        o.reduction = reduction;
        o.label_smoothing = smoothing;
        o.ignore_index = -100;
        const at::Tensor w_logits = whole.clone().requires_grad_(true);
        const auto red = reduction == "mean" ? at::Reduction::Mean : reduction == "sum" ? at::Reduction::Sum : at::Reduction::None;
        const at::Tensor want = at::cross_entropy_loss(w_logits, targets, {}, red, -100, smoothing);
        (reduction == "none" ? (want * upstream).sum() : want).backward();
        const at::Tensor p_logits = whole.narrow(1, begin, parts).clone().requires_grad_(true);
        const at::Tensor got = fsdp::vocab_parallel_cross_entropy(p_logits, targets, net->head->weight, o);
        (reduction == "none" ? (got * upstream).sum() : got).backward();
        note(ce_diff, got.detach(), want.detach());
        note(ce_diff, p_logits.grad(), w_logits.grad().narrow(1, begin, parts));
      }
    }
    // The regions, on a whole tensor every rank holds.
    const at::Tensor x = torch::randn({3, 8});
    const at::Tensor weights = torch::randn({3, 8});
    const at::Tensor xs = x.clone().requires_grad_(true);
    const at::Tensor part = fsdp::scatter_to_tensor_parallel_region(xs, tp, -1);
    note(region_diff, part.detach(), x.narrow(1, tp->rank() * (8 / tp->size()), 8 / tp->size()));
    const at::Tensor back = fsdp::gather_from_tensor_parallel_region(part, tp, -1);
    note(region_diff, back.detach(), x);
    (back * weights).sum().backward();
    note(region_diff, xs.grad(), weights);
    const double factor = tp->size() * (tp->size() + 1) / 2.0;  // the sum of (rank + 1) over the group
    note(region_diff, fsdp::reduce_from_tensor_parallel_region(x * (tp->rank() + 1), tp), x * factor);
    const at::Tensor xc = x.clone().requires_grad_(true);
    (fsdp::copy_to_tensor_parallel_region(xc, tp) * weights * (tp->rank() + 1)).sum().backward();
    note(region_diff, xc.grad(), weights * factor);
  }
  // The sequence-parallel regions along dimension 1 of [2, 4 x size, 3], forward and backward.
  {
    fsdp::TensorParallelOptions o;
    o.sequence_parallel = true;
    auto sp = fsdp::TensorParallel::create(mesh, a.tp, o);
    const int64_t n = 4, T = n * sp->size(), first = sp->rank() * n;
    const double factor = sp->size() * (sp->size() + 1) / 2.0;
    const at::Tensor x = torch::randn({2, T, 3}), w = torch::randn({2, T, 3});
    const at::Tensor xs = x.clone().requires_grad_(true);
    const at::Tensor chunk = fsdp::scatter_to_sequence_parallel_region(xs, sp);
    note(region_diff, chunk.detach(), x.narrow(1, first, n));
    const at::Tensor all = fsdp::gather_from_sequence_parallel_region(chunk, sp, /*into_split_computation=*/false);
    note(region_diff, all.detach(), x);
    (all * w).sum().backward();
    note(region_diff, xs.grad(), w);
    const at::Tensor c = x.narrow(1, first, n).clone().requires_grad_(true);
    (fsdp::gather_from_sequence_parallel_region(c, sp, /*into_split_computation=*/true) * w * (sp->rank() + 1)).sum().backward();
    note(region_diff, c.grad(), (w * factor).narrow(1, first, n));
    const at::Tensor xr = x.clone().requires_grad_(true);
    const at::Tensor summed = fsdp::reduce_scatter_to_sequence_parallel_region(xr * (sp->rank() + 1), sp);
    note(region_diff, summed.detach(), (x * factor).narrow(1, first, n));
    (summed * w.narrow(1, first, n)).sum().backward();
    note(region_diff, xr.grad(), w * (sp->rank() + 1));
  }
  // Refusals of the pieces, each with what to do: targets that are no class indices, a row count
  // that differs from the logits', a TP stream scope on a TensorParallel the streams were not
  // seeded for (its masks would be the same on every TP rank).
  auto refused = [&](const std::function<void()>& call, const std::string& says) {
    try {
      call();
    } catch (const std::exception& e) {
      if (std::string(e.what()).find(says) != std::string::npos) {
        ++checks;
        return;
      }
    }
    region_diff = 1e9;  // not refused, or not by name
  };
  {
    auto tp = fsdp::TensorParallel::create(mesh, a.tp);
    torch::manual_seed(5);
    MyNet net(Variants(""));
    fsdp::parallelize(*net, tp, {{"head.weight", {0, 1}}});
    const at::Tensor logits = torch::randn({6, kClasses / tp->size()});
    refused([&] { fsdp::vocab_parallel_cross_entropy(logits, torch::zeros({6}), net->head->weight); }, "integer tensor");
    refused([&] { fsdp::vocab_parallel_cross_entropy(logits, torch::zeros({12}, torch::kLong), net->head->weight); },
            "one target per row");
    auto other = fsdp::TensorParallel::create(mesh, a.tp);
    fsdp::seed_tensor_parallel_rng(tp, 7);
    refused([&] { fsdp::TensorParallelRngScope scope(other); }, "seeded for another TensorParallel");
  }
  return {{"rank", mesh->rank()}, {"ce_diff", ce_diff}, {"region_diff", region_diff}, {"checks", checks}};
}

json train(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a, const Variants& v) {
  fsdp::TensorParallelOptions tp_options;
  tp_options.sequence_parallel = v.has("sp") || v.has("sp_no_rule") || v.has("sp_head_column");
  if (v.has("sp_head_column")) tp_options.sequence_dim = 0;
  auto tp = fsdp::TensorParallel::create(mesh, a.tp, tp_options);
  const auto& dp = tp->data_parallel();
  auto build = [&](int seed) {
    torch::manual_seed(seed);
    return MyNet(v);
  };
  MyNet local = build(0), mine = build(v.has("seed_per_rank") ? mesh->rank() : 0);
  std::vector<fsdp::TensorParallelRule> plan = {{"blocks.*.up.weight", {0, 1}},
                                                {"blocks.*.up.bias", {0, 1}},
                                                {"blocks.*.down.weight", {1, 1}}};
  if (!v.has("tied")) plan.push_back({"head.weight", {0, 1}});
  if (v.has("bias_unsplit")) plan.erase(plan.begin() + 1);
  if (v.has("embed_unit") || v.has("embed_options") || v.has("via_forward_with") || v.has("id_out_of_range") ||
      v.has("tied")) {
    plan.push_back({"embed.weight", {0, 1}});
  }
  if (v.has("qk_norm")) plan.push_back(fsdp::partial_gradient_rule("blocks.*.qk_w"));
  if (v.has("sp") || v.has("sp_head_column")) {
    for (const char* p : {"blocks.*.norm.*", "blocks.*.down.bias"}) plan.push_back(fsdp::partial_gradient_rule(p));
  }
  fsdp::parallelize(*mine, tp, plan);
  fsdp::Options opts = options_from(a);
  opts.auto_wrap_policy = v.has("embed_unit") ? fsdp::module_type_policy<MyBlockImpl, torch::nn::EmbeddingImpl>()
                                              : fsdp::module_type_policy<MyBlockImpl>();
  opts.tensor_parallel = tp;
  opts.sync_module_states = v.has("seed_per_rank");
  fsdp::FullyShardedDataParallel sharded(mine, dp, opts);
  torch::optim::SGD local_opt(local->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD my_opt(sharded.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::optional<fsdp::ShardedGradScaler> scaler;
  if (v.has("scaler_dp")) scaler.emplace(dp);
  // The batch slice of this rank's place among the data-parallel ranks: TP ranks of one DP group
  // see the same rows. batch_by_world slices by the world rank instead.
  const bool by_world = v.has("batch_by_world") || v.has("eval_first") || v.has("via_forward_with");
  const int64_t per = kGlobalBatch / (by_world ? mesh->world_size() : dp->world_size());
  const int64_t begin = (by_world ? mesh->rank() : dp->rank()) * per;
  // Ids past V / TP (every rank's rows are looked up) and the padding id among them.
  const int64_t id_low = v.has("embed_unit") ? kVocab / 2 : 0;
  double loss_diff = 0, norm_diff = 0;
  for (int step = 0; step < kSteps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    const torch::Tensor ids = torch::randint(id_low, kVocab, {kGlobalBatch, kTokens}, gen);
    const torch::Tensor y = torch::randint(local->classes(), {kGlobalBatch}, gen);
    if (v.has("eval_first") && step == 0) {
      torch::NoGradGuard no_grad;  // every rank the same rows: passes the input check
      sharded.forward(ids.narrow(0, 0, per));
    }
    torch::Tensor my_ids = ids.narrow(0, begin, per).clone(), my_y = y.narrow(0, begin, per).clone();
    if (v.has("label_noise") && tp->rank() == 1) my_y[0] = (my_y[0].item<int64_t>() + 1) % local->classes();
    if (v.has("id_out_of_range") && dp->rank() == 0) my_ids[0][0] = kVocab;
    local_opt.zero_grad();
    torch::Tensor l;
    if (!local->embed->options.scale_grad_by_freq()) {
      l = local->loss(local->forward(ids), y);
      l.backward();
    } else {
      // scale_grad_by_freq counts ids in the batch one process sees, so data parallelism (fsdp's,
      // as DDP's) scales by each slice's counts: the local oracle is the same batch accumulated
      // slice by slice, as many slices as data-parallel ranks. (Not with a tied head: max_norm's
      // renormalization, which fsdp merges over the ranks before the next operator reads the
      // weight, is the whole batch's, so the head of a slice sees rows the other slices
      // renormalized; slice by slice it would not.)
      const int64_t slices = dp->world_size(), rows = kGlobalBatch / slices;
      l = torch::zeros({});
      for (int64_t s = 0; s < slices; ++s) {
        const torch::Tensor part = local->loss(local->forward(ids.narrow(0, s * rows, rows)), y.narrow(0, s * rows, rows)) / slices;
        part.backward();
        l = l + part.detach();
      }
    }
    const double local_norm = torch::nn::utils::clip_grad_norm_(local->parameters(), 0.05);
    local_opt.step();
    my_opt.zero_grad();
    const torch::Tensor logits = v.has("via_forward_with") ? sharded.forward_with([&] { return mine->forward(my_ids); })
                                                            : sharded.forward(my_ids);
    const torch::Tensor m = mine->loss(logits, my_y);
    (scaler ? scaler->scale(m) : m).backward();
    if (scaler) scaler->unscale_(my_opt);
    const double my_norm = sharded.clip_grad_norm_(0.05);
    if (scaler) {
      scaler->step(my_opt);
      scaler->update();
    } else {
      my_opt.step();
    }
    // Each data-parallel rank's loss is its slice's mean: the global batch's is their mean.
    torch::Tensor mean = m.detach().reshape({1}).clone();
    std::vector<torch::Tensor> t{mean};
    dp->world()->allreduce(t)->wait();
    loss_diff = std::max(loss_diff, std::abs(mean.item<double>() / dp->world_size() - l.item<double>()));
    norm_diff = std::max(norm_diff, std::abs(my_norm - local_norm) / local_norm);
  }
  double param_diff = 0;
  int compared = 0;
  std::map<std::string, torch::Tensor> whole;
  for (const auto& [name, t] : fsdp::full_state_dict(sharded, /*rank0_only=*/false)) whole[name] = t;
  for (const auto& item : local->named_parameters()) {
    const auto it = whole.find(item.key());
    if (it == whole.end() || it->second.sizes() != item.value().sizes()) {
      param_diff = 1e9;  // a parameter missing or not whole
      continue;
    }
    param_diff = std::max(param_diff, (it->second - item.value().detach()).abs().max().item<double>());
    ++compared;
  }
  // summon_full_params: the model's own parameters whole inside the scope (the TP parts put
  // together), and an in-place change made there written back into every rank's part.
  if (v.has("summon_one_tp_rank") || v.has("summon_one_rank")) {
    {
      auto full = sharded.summon_full_params();
      const bool changes = v.has("summon_one_tp_rank") ? tp->rank() == 0 : mesh->rank() == 0;
      torch::NoGradGuard no_grad;
      if (changes) {
        for (auto& p : mine->parameters()) p.mul_(0.9);
      }
    }
    sharded.clip_grad_norm_(1.0);  // the next call refuses what the scope's end discarded
  }
  double summon_diff = 0, writeback_diff = 0;
  {
    auto full = sharded.summon_full_params();
    for (const auto& item : local->named_parameters()) {
      const torch::Tensor* got = mine->named_parameters().find(item.key());
      if (got == nullptr || got->sizes() != item.value().sizes()) {
        summon_diff = 1e9;
        continue;
      }
      summon_diff = std::max(summon_diff, (*got - item.value().detach()).abs().max().item<double>());
      torch::NoGradGuard no_grad;
      got->mul_(2);
    }
  }
  for (const auto& [name, t] : fsdp::full_state_dict(sharded, /*rank0_only=*/false)) {
    const torch::Tensor* want = local->named_parameters().find(name);
    if (want) writeback_diff = std::max(writeback_diff, (t - 2 * want->detach()).abs().max().item<double>());
  }
  return {{"rank", mesh->rank()}, {"loss_diff", loss_diff}, {"norm_rel_diff", norm_diff}, {"param_diff", param_diff},
          {"compared", compared}, {"parameters", static_cast<int>(local->named_parameters().size())},
          {"summon_diff", summon_diff}, {"writeback_diff", writeback_diff}};
}

}  // namespace

json run_tensor_parallel(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const Variants v(a.variants);
  try {
    return v.has("api") ? check_api(mesh, a) : train(mesh, a, v);
  } catch (const std::exception& e) {
    // What a refused variant said, for the test to read (the first line: the reason and the fix).
    const std::string what = e.what();
    return {{"rank", mesh->rank()}, {"refused", what.substr(0, what.find("\nException raised from"))}};
  }
}

}  // namespace worker
