// One rank of a multi-process test. The gtest drivers (test_parity, test_accounting,
// test_failure) launch W of these with fsdp's local launcher and assert on what they write.
//
//   fsdp-test-worker parity --strategy S [--shard-size F] [--variants all] --out PREFIX
//       Trains the tiny GPT and the uneven net with SGD+momentum and AdamW for 5 steps under fsdp
//       and, in the same process, a local single-process reference on the whole global batch;
//       writes per-case max |Δparam| and max |Δloss| to PREFIX.<rank>.json.
//   fsdp-test-worker accounting --strategy S [--shard-size F] --out PREFIX
//       One training step of the tiny GPT; writes units, communication and memory metrics.
//   fsdp-test-worker structure [--mismatch-rank R]
//       Builds the model (rank R builds a different one) and exits.
//   fsdp-test-worker overlap [prefetch flags] --out PREFIX
//       Three steps of a 4-block GPT; writes the last step's timeline and overlap metrics.
//   fsdp-test-worker dynamic [prefetch flags] --out PREFIX
//       Trains a stack whose blocks run in a different order (and not all of them) every step,
//       against local training of the same model; writes max |Δparam| and max |Δloss|.
//   fsdp-test-worker precision --param-dtype bf16|fp16 [--reduce-dtype D] --out PREFIX
//       Three SGD steps of the tiny GPT in mixed precision against a local reference that replays
//       the same casts (per-rank forward/backward in param_dtype, gradients cast to reduce_dtype,
//       divided by W, summed, cast to fp32); also the dtypes handed to each collective and the
//       bytes moved against an fp32 run.
//   fsdp-test-worker scaler --inf-rank R --out PREFIX
//       fp16 training with the ShardedGradScaler; rank R's gradient gets an inf at step 2.
//   fsdp-test-worker sync --sync-module-states 0|1 --out PREFIX
//       Each rank builds the model from its own seed; trains against a local reference built
//       from rank 0's seed.
//   fsdp-test-worker deferred --model gpt|zoo --out PREFIX
//       Builds the model normally and with deferred_init from the same seed, shards both, and
//       compares every shard and buffer bit for bit; measures the peak CPU tensor memory of both
//       ways of building and sharding.
// --device cuda runs parity on this rank's GPU (the GPU script's CUDA check; default cpu).
// Prefetch flags (any mode that shards): --backward-prefetch none|backward_pre|backward_post,
// --forward-prefetch 0|1, --prefetch-count N, --limit-all-gathers K.
#include <fstream>
#include <functional>
#include <map>
#include <iostream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "fsdp/fsdp.h"
#include "fsdp/deferred_init.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/plan.h"
#include "fsdp/launch.h"
#include "models/data.h"
#include "models/gpt.h"
#include "src/flat_param.h"
#include "src/host_memory.h"

using json = nlohmann::json;

namespace {

constexpr int64_t kGlobalBatch = 12;  // divisible by every world size 1..4
constexpr int kSteps = 5;

struct Args {
  std::string mode, strategy = "full_shard", out = "/tmp/fsdp-worker", variants = "plain";
  int shard_size = 0, mismatch_rank = -1;
  std::string backward_prefetch = "backward_pre";
  int forward_prefetch = 0, prefetch_count = 1, limit_all_gathers = 2;
  std::string device = "cpu";
  std::string param_dtype = "bf16", reduce_dtype;
  int inf_rank = -1, sync_module_states = 1;
  std::string model = "gpt";
  int keep_low_grads = 0;
};

// Where parity models and batches live (--device).
torch::Device g_device(torch::kCPU);

Args parse(int argc, char** argv) {
  Args a;
  a.mode = argc > 1 ? argv[1] : "";
  for (int i = 2; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--strategy") a.strategy = v;
    else if (k == "--shard-size") a.shard_size = std::stoi(v);
    else if (k == "--out") a.out = v;
    else if (k == "--variants") a.variants = v;
    else if (k == "--mismatch-rank") a.mismatch_rank = std::stoi(v);
    else if (k == "--backward-prefetch") a.backward_prefetch = v;
    else if (k == "--forward-prefetch") a.forward_prefetch = std::stoi(v);
    else if (k == "--prefetch-count") a.prefetch_count = std::stoi(v);
    else if (k == "--limit-all-gathers") a.limit_all_gathers = std::stoi(v);
    else if (k == "--device") a.device = v;
    else if (k == "--param-dtype") a.param_dtype = v;
    else if (k == "--reduce-dtype") a.reduce_dtype = v;
    else if (k == "--inf-rank") a.inf_rank = std::stoi(v);
    else if (k == "--model") a.model = v;
    else if (k == "--keep-low-grads") a.keep_low_grads = std::stoi(v);
    else if (k == "--sync-module-states") a.sync_module_states = std::stoi(v);
    else throw std::invalid_argument("unknown flag " + k);
  }
  return a;
}

// A model under test: how to build it (same seed, same weights), its units, and its loss on a
// slice [begin, end) of step `step`'s global batch.
struct Case {
  std::string name;
  std::function<std::shared_ptr<torch::nn::Module>()> build;
  fsdp::WrapPolicy policy;
  std::function<torch::Tensor(torch::nn::Module&, int64_t step, int64_t begin, int64_t end, bool through_fsdp,
                              void* fsdp_wrapper)> loss;
};

const models::TokenSource& corpus() {
  static models::TokenSource src = models::TokenSource::from_path(models::kDefaultCorpus);
  return src;
}

std::pair<torch::Tensor, torch::Tensor> uneven_batch(int64_t step, int64_t begin, int64_t end) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto x = at::randn({kGlobalBatch, 16}, gen, at::kFloat);
  auto y = at::randn({kGlobalBatch, 16}, gen, at::kFloat);
  return {x.slice(0, begin, end).to(g_device), y.slice(0, begin, end).to(g_device)};
}

std::unique_ptr<torch::optim::Optimizer> make_optim(const std::string& kind, torch::nn::Module& m) {
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(m.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  // Per-parameter groups: no weight decay on biases and norms (1-D originals), as users do.
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& item : m.named_parameters()) {
    const bool is_1d = item.key().find("bias") != std::string::npos || item.key().find("ln") != std::string::npos ||
                       item.key().find("n.") == 0;
    (is_1d ? no_decay : decay).push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(3e-3).weight_decay(0.1)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(3e-3).weight_decay(0.0)));
  return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(3e-3));
}

// Unique parameters by first name.
std::vector<std::pair<std::string, torch::Tensor>> unique_params(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : m.named_parameters()) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  }
  return out;
}

template <typename Forward>
torch::Tensor gpt_loss(Forward&& fwd, int64_t step, int64_t begin, int64_t end) {
  auto cfg = models::GPTConfig::preset("tiny");
  auto [x, y] = corpus().batch(step, kGlobalBatch, cfg.block_size, 7, begin, end);
  return models::lm_loss(fwd(x.to(g_device)), y.to(g_device));
}

json run_parity_case(const std::shared_ptr<fsdp::Mesh>& mesh, fsdp::Options opts, const std::string& model,
                     const std::string& optim, const std::string& variant) {
  const int W = mesh->world_size(), rank = mesh->rank();
  const int64_t per_rank = kGlobalBatch / W, begin = rank * per_rank, end = begin + per_rank;
  auto build = [&]() -> std::shared_ptr<torch::nn::Module> {
    torch::manual_seed(0);
    std::shared_ptr<torch::nn::Module> m;
    if (model == "gpt") m = models::GPT(models::GPTConfig::preset("tiny")).ptr();
    else m = models::UnevenNet().ptr();
    m->to(g_device);  // initialized on the CPU (same numbers on every device), then moved
    return m;
  };
  if (std::getenv("FSDP_TEST_VERBOSE")) std::cerr << "case " << model << " " << optim << " " << variant << std::endl;
  auto ref = build();
  auto mine = build();
  opts.auto_wrap_policy = model == "gpt" ? fsdp::module_type_policy<models::BlockImpl>()
                                         : fsdp::module_type_policy<torch::nn::LinearImpl>();
  fsdp::FullyShardedDataParallel<torch::nn::Module> sharded(mine, mesh, opts);
  auto ref_opt = make_optim(optim, *ref);
  auto my_opt = make_optim(optim, *mine);

  // Loss of a module on a batch slice; `fwd` runs the module (locally or through the root).
  auto loss_on = [&](auto&& fwd, int64_t step, int64_t b, int64_t e) {
    if (model == "gpt") return gpt_loss(fwd, step, b, e);
    auto [x, y] = uneven_batch(step, b, e);
    return torch::mse_loss(fwd(x), y);
  };
  auto ref_fwd = [&](const torch::Tensor& x) {
    return model == "gpt" ? std::dynamic_pointer_cast<models::GPTImpl>(ref)->forward(x)
                          : std::dynamic_pointer_cast<models::UnevenNetImpl>(ref)->forward(x);
  };
  auto my_fwd = [&](const torch::Tensor& x) {
    // The root wrapper is typed on Module here, so call the concrete forward inside its scope.
    fsdp::detail::begin_forward(sharded.runtime());
    auto out = model == "gpt" ? std::dynamic_pointer_cast<models::GPTImpl>(mine)->forward(x)
                              : std::dynamic_pointer_cast<models::UnevenNetImpl>(mine)->forward(x);
    fsdp::detail::end_forward(sharded.runtime(), {out}, true);
    return out;
  };

  double max_loss_diff = 0, ref_norm = 0, my_norm = 0, max_norm_diff = 0;
  for (int step = 0; step < kSteps; ++step) {
    ref_opt->zero_grad();
    my_opt->zero_grad();
    auto ref_loss = loss_on(ref_fwd, step, 0, kGlobalBatch);
    ref_loss.backward();
    if (std::getenv("FSDP_TEST_VERBOSE")) std::cerr << "step " << step << " ref done" << std::endl;
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
      ref_norm = torch::nn::utils::clip_grad_norm_(ref_unique, 0.05);
      my_norm = sharded.clip_grad_norm_(0.05);
      max_norm_diff = std::max(max_norm_diff, std::abs(ref_norm - my_norm));
    }
    if (std::getenv("FSDP_TEST_VERBOSE")) std::cerr << "step " << step << " optim" << std::endl;
    ref_opt->step();
    my_opt->step();
    // The global loss is the mean of the ranks' means (equal slices).
    auto global = my_loss.detach().reshape({1}).to(torch::kCPU).clone();
    std::vector<at::Tensor> v{global};
    mesh->world()->allreduce(v)->wait();
    max_loss_diff = std::max(max_loss_diff, std::abs(global.item<double>() / W - ref_loss.item<double>()));
  }

  // Compare this rank's shard of every parameter with the same elements of the reference.
  auto ref_params = unique_params(*ref);
  std::map<std::string, torch::Tensor> ref_by_name(ref_params.begin(), ref_params.end());
  double max_param_diff = 0;
  const int F = sharded.shard_size();
  for (const auto& unit : sharded.units()) {
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& f : unit.fqns) shapes.push_back(ref_by_name.at(f).sizes().vec());
    fsdp::FlatParamLayout layout(unit.fqns, shapes, F);
    for (size_t i = 0; i < unit.fqns.size(); ++i) {
      auto s = layout.slice(i, rank % F);
      auto mine_p = mine->named_parameters()[unit.fqns[i]].detach().reshape(-1);
      auto ref_p = ref_by_name.at(unit.fqns[i]).detach().reshape(-1).narrow(0, s.param_begin, s.length);
      if (mine_p.numel() != s.length) throw std::runtime_error("shard of " + unit.fqns[i] + " has the wrong size");
      if (s.length > 0) max_param_diff = std::max(max_param_diff, (mine_p - ref_p).abs().max().item<double>());
    }
  }
  // An unused parameter must keep no gradient, as in local training.
  bool unused_grad_none = true;
  if (model == "uneven") unused_grad_none = !mine->named_parameters()["unused"].grad().defined();
  return json{{"model", model}, {"optim", optim}, {"variant", variant}, {"max_param_diff", max_param_diff},
              {"max_loss_diff", max_loss_diff}, {"max_norm_diff", max_norm_diff}, {"unused_grad_none", unused_grad_none}};
}

fsdp::Options options_from(const Args& a) {
  fsdp::Options o;
  o.strategy = fsdp::parse_strategy(a.strategy);
  o.shard_size = a.shard_size;
  o.backward_prefetch = fsdp::parse_backward_prefetch(a.backward_prefetch);
  o.forward_prefetch = a.forward_prefetch != 0;
  o.prefetch_count = a.prefetch_count;
  o.limit_all_gathers = a.limit_all_gathers;
  return o;
}

// Blocks that run in a different order every step, and one of them not at all on odd steps: a
// model whose unit order changes between iterations (prefetch guesses are wrong half the time).
struct RoutedStackImpl : torch::nn::Module {
  RoutedStackImpl() {
    for (int i = 0; i < 4; ++i) blocks.push_back(register_module("block" + std::to_string(i), torch::nn::Linear(16, 16)));
    out = register_module("out", torch::nn::Linear(16, 16));
  }
  torch::Tensor forward(const torch::Tensor& x, int64_t step) {
    static const int orders[3][4] = {{0, 1, 2, 3}, {3, 1, 0, -1}, {2, 0, 3, 1}};
    auto h = x;
    for (int i : orders[step % 3]) {
      if (i >= 0) h = torch::tanh(blocks[static_cast<size_t>(i)](h));
    }
    return out(h);
  }
  std::vector<torch::nn::Linear> blocks;
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(RoutedStack);

json run_dynamic(const std::shared_ptr<fsdp::Mesh>& mesh, fsdp::Options opts) {
  const int W = mesh->world_size(), rank = mesh->rank();
  const int64_t per_rank = kGlobalBatch / W, begin = rank * per_rank;
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
    std::vector<at::Tensor> v{my_loss.detach().reshape({1}).clone()};
    mesh->world()->allreduce(v)->wait();
    max_loss_diff = std::max(max_loss_diff, std::abs(v[0].item<double>() / W - ref_loss.item<double>()));
  }
  // Gather every parameter back to compare it whole (a plain all-gather of the flat shards).
  double max_param_diff = 0;
  const int F = sharded.shard_size();
  auto ref_named = ref->named_parameters();
  for (const auto& unit : sharded.units()) {
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& f : unit.fqns) shapes.push_back(ref_named[f].sizes().vec());
    fsdp::FlatParamLayout layout(unit.fqns, shapes, F);
    for (size_t i = 0; i < unit.fqns.size(); ++i) {
      auto sl = layout.slice(i, rank % F);
      auto mine_p = mine->named_parameters()[unit.fqns[i]].detach().reshape(-1);
      auto ref_p = ref_named[unit.fqns[i]].detach().reshape(-1).narrow(0, sl.param_begin, sl.length);
      if (sl.length > 0) max_param_diff = std::max(max_param_diff, (mine_p - ref_p).abs().max().item<double>());
    }
  }
  return json{{"max_param_diff", max_param_diff}, {"max_loss_diff", max_loss_diff}};
}

// A constructor that initializes the way libtorch users do: default kaiming for Conv2d and
// Linear, xavier and kaiming calls on registered tensors, a padding row zeroed through a view,
// a random factory, and BatchNorm buffers.
struct InitZooImpl : torch::nn::Module {
  InitZooImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3)));
    lin = register_module("lin", torch::nn::Linear(64, 32));
    xavier_w = register_parameter("xavier_w", torch::empty({48, 40}));
    torch::nn::init::xavier_normal_(xavier_w);
    kaiming_w = register_parameter("kaiming_w", torch::empty({40, 24}));
    torch::nn::init::kaiming_normal_(kaiming_w, 0, torch::kFanOut, torch::kReLU);
    emb = register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(50, 16).padding_idx(0)));
    noise = register_parameter("noise", torch::randn({7, 3}));
    norm = register_module("norm", torch::nn::BatchNorm1d(16));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear lin{nullptr};
  torch::Tensor xavier_w, kaiming_w, noise;
  torch::nn::Embedding emb{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(InitZoo);

// Max |mine - ref| over this rank's shard of every parameter (both models built the same way).
double max_shard_diff(fsdp::FullyShardedDataParallel<models::GPTImpl>& sharded, models::GPT& mine, models::GPT& ref,
                      int rank) {
  auto ref_named = ref->named_parameters();
  auto my_named = mine->named_parameters();
  double diff = 0;
  for (const auto& unit : sharded.units()) {
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& f : unit.fqns) shapes.push_back(ref_named[f].sizes().vec());
    fsdp::FlatParamLayout layout(unit.fqns, shapes, sharded.shard_size());
    for (size_t i = 0; i < unit.fqns.size(); ++i) {
      auto sl = layout.slice(i, rank % sharded.shard_size());
      auto m = my_named[unit.fqns[i]].detach().reshape(-1).to(torch::kFloat);
      auto r = ref_named[unit.fqns[i]].detach().reshape(-1).narrow(0, sl.param_begin, sl.length).to(torch::kFloat);
      if (sl.length > 0) diff = std::max(diff, (m - r).abs().max().item<double>());
    }
  }
  return diff;
}

json run_precision(const std::shared_ptr<fsdp::Mesh>& mesh, fsdp::Options opts, const Args& a) {
  const int W = mesh->world_size(), rank = mesh->rank();
  const int64_t per = kGlobalBatch / W;
  const auto pd = fsdp::parse_dtype(a.param_dtype);
  const auto rd = fsdp::parse_dtype(a.reduce_dtype.empty() ? a.param_dtype : a.reduce_dtype);
  const auto cfg = models::GPTConfig::preset("tiny");
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  const double lr = 0.05;

  // Bytes of one fp32 step, for comparison.
  fsdp::CommBytes fp32_bytes;
  {
    torch::manual_seed(0);
    models::GPT m(cfg);
    fsdp::FullyShardedDataParallel s(m, mesh, opts);
    s.reset_step();
    gpt_loss([&](const torch::Tensor& x) { return s.forward(x); }, 0, rank * per, rank * per + per).backward();
    fp32_bytes = s.metrics().comm;
  }

  opts.mixed_precision = fsdp::MixedPrecision{pd, rd, pd, a.keep_low_grads != 0};
  torch::manual_seed(0);
  models::GPT mine(cfg);
  torch::manual_seed(0);
  models::GPT ref(cfg);   // the fp32 master copy of the reference
  torch::manual_seed(0);
  models::GPT work(cfg);  // the reference's low-precision working copy
  fsdp::FullyShardedDataParallel sharded(mine, mesh, opts);
  // Unique parameters: libtorch's parameters() lists the tied weight twice, and SGD would step it twice.
  std::vector<torch::Tensor> my_unique;
  for (auto& kv : unique_params(*mine)) my_unique.push_back(kv.second);
  torch::optim::SGD opt(my_unique, torch::optim::SGDOptions(lr));
  auto ref_params = unique_params(*ref);
  auto work_params = unique_params(*work);

  std::set<std::string> ag_dtypes, rs_dtypes, grad_dtypes, param_dtypes;
  std::string logits_dtype;
  fsdp::CommBytes mp_bytes;
  for (int step = 0; step < 3; ++step) {
    sharded.reset_step();
    opt.zero_grad();
    auto fwd = [&](const torch::Tensor& x) {
      auto logits = sharded.forward(x);
      logits_dtype = fsdp::dtype_name(logits.scalar_type());
      return logits;
    };
    // "accum": the rank's slice as two weighted micro-batches, the first under no_sync.
    const bool accum = a.variants == "accum";
    auto halves = [&](int r) {
      const int64_t b = r * per, mid = b + per / 2, e = b + per;
      return std::make_tuple(b, mid, e, double(mid - b) / per, double(e - mid) / per);
    };
    if (accum) {
      const auto [b, mid, e, w1, w2] = halves(rank);
      {
        auto guard = sharded.no_sync();
        (gpt_loss(fwd, step, b, mid) * w1).backward();
      }
      (gpt_loss(fwd, step, mid, e) * w2).backward();
    } else {
      gpt_loss(fwd, step, rank * per, rank * per + per).backward();
    }
    for (const auto& p : my_unique) {
      if (p.grad().defined()) grad_dtypes.insert(fsdp::dtype_name(p.grad().scalar_type()));
      param_dtypes.insert(fsdp::dtype_name(p.scalar_type()));
    }
    opt.step();
    if (step == 0) mp_bytes = sharded.metrics().comm;
    for (const auto& sp : sharded.timeline()) {
      if (sp.kind == fsdp::SpanKind::ALL_GATHER) ag_dtypes.insert(sp.dtype);
      if (sp.kind == fsdp::SpanKind::REDUCE_SCATTER) rs_dtypes.insert(sp.dtype);
    }

    // The reference: every rank's slice in the working dtype, gradients reduced as fsdp does.
    torch::NoGradGuard outer;
    std::vector<torch::Tensor> sum(ref_params.size());
    for (int r = 0; r < W; ++r) {
      for (size_t i = 0; i < ref_params.size(); ++i) {
        work_params[i].second.set_data(ref_params[i].second.detach().to(pd));
        work_params[i].second.mutable_grad().reset();
      }
      auto work_fwd = [&](const torch::Tensor& x) { return work->forward(x); };
      std::vector<torch::Tensor> accum_grads(ref_params.size());
      if (accum) {
        // The first micro-batch's gradients, kept in fp32 as fsdp's no_sync accumulator does.
        const auto [b, mid, e, w1, w2] = halves(r);
        {
          torch::AutoGradMode grad_on(true);
          (gpt_loss(work_fwd, step, b, mid) * w1).backward();
        }
        for (size_t i = 0; i < ref_params.size(); ++i) {
          auto g = work_params[i].second.grad();
          if (g.defined()) accum_grads[i] = g.to(rd).to(torch::kFloat);
          work_params[i].second.mutable_grad().reset();
        }
        torch::AutoGradMode grad_on(true);
        (gpt_loss(work_fwd, step, mid, e) * w2).backward();
      } else {
        torch::AutoGradMode grad_on(true);
        gpt_loss(work_fwd, step, r * per, r * per + per).backward();
      }
      for (size_t i = 0; i < ref_params.size(); ++i) {
        auto g = work_params[i].second.grad();
        if (!g.defined() && !accum_grads[i].defined()) continue;
        auto flat = g.defined() ? g.to(rd) : torch::zeros_like(accum_grads[i], torch::TensorOptions().dtype(rd));
        if (accum_grads[i].defined()) flat.add_(accum_grads[i]);
        auto part = flat / W;
        sum[i] = sum[i].defined() ? sum[i] + part : part;
      }
    }
    for (size_t i = 0; i < ref_params.size(); ++i) {
      if (!sum[i].defined()) continue;
      // fsdp casts the reduced gradient to fp32, and with keep_low_precision_grads on to param_dtype.
      auto g = sum[i].to(torch::kFloat);
      if (a.keep_low_grads) g = g.to(pd).to(torch::kFloat);
      ref_params[i].second.add_(g, -lr);
    }
  }
  // Buffers are cast once to buffer_dtype; integer buffers stay as they are.
  torch::manual_seed(0);
  InitZoo zoo;
  fsdp::Options zoo_opts = opts;
  zoo_opts.auto_wrap_policy = nullptr;
  fsdp::FullyShardedDataParallel zoo_sharded(zoo, mesh, zoo_opts);
  return json{{"max_param_diff", max_shard_diff(sharded, mine, ref, rank)},
              {"logits_dtype", logits_dtype}, {"grad_dtypes", grad_dtypes}, {"param_dtypes", param_dtypes},
              {"running_mean_dtype", fsdp::dtype_name(zoo->norm->running_mean.scalar_type())},
              {"num_batches_tracked_dtype", fsdp::dtype_name(zoo->norm->num_batches_tracked.scalar_type())},
              {"all_gather_dtypes", ag_dtypes}, {"reduce_scatter_dtypes", rs_dtypes},
              {"fp32_all_gather_bytes", fp32_bytes.all_gather}, {"fp32_reduce_scatter_bytes", fp32_bytes.reduce_scatter},
              {"all_gather_bytes", mp_bytes.all_gather}, {"reduce_scatter_bytes", mp_bytes.reduce_scatter},
              {"fp32_all_reduce_bytes", fp32_bytes.all_reduce}, {"all_reduce_bytes", mp_bytes.all_reduce}};
}

json run_scaler(const std::shared_ptr<fsdp::Mesh>& mesh, fsdp::Options opts, const Args& a) {
  const int W = mesh->world_size(), rank = mesh->rank();
  const int64_t per = kGlobalBatch / W;
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  opts.mixed_precision = fsdp::MixedPrecision{torch::kHalf, torch::kHalf, torch::kHalf, false};
  torch::manual_seed(0);
  models::GPT mine(models::GPTConfig::preset("tiny"));
  fsdp::FullyShardedDataParallel sharded(mine, mesh, opts);
  torch::optim::SGD opt(mine->parameters(), torch::optim::SGDOptions(0.05));
  fsdp::GradScalerOptions so;
  so.init_scale = 1024;
  so.growth_interval = 2;
  fsdp::ShardedGradScaler scaler(mesh, so);
  json steps = json::array();
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    auto loss = gpt_loss([&](const torch::Tensor& x) { return sharded.forward(x); }, step, rank * per, rank * per + per);
    scaler.scale(loss).backward();
    if (step == 2 && rank == a.inf_rank) {
      // An overflow on this rank only: one element of its first sharded gradient.
      for (auto& p : mine->parameters()) {
        if (p.grad().defined() && p.grad().numel() > 0) {
          p.mutable_grad().view(-1)[0] = std::numeric_limits<float>::infinity();
          break;
        }
      }
    }
    double before = 0;
    for (auto& p : mine->parameters()) before += p.detach().to(torch::kDouble).sum().item<double>();
    const double scale_before = scaler.get_scale();
    const bool stepped = scaler.step(opt);
    scaler.update();
    double after = 0;
    for (auto& p : mine->parameters()) after += p.detach().to(torch::kDouble).sum().item<double>();
    steps.push_back(json{{"stepped", stepped}, {"scale_before", scale_before}, {"scale_after", scaler.get_scale()},
                         {"params_changed", before != after}, {"loss", loss.item<double>()}});
  }
  return json{{"steps", steps}};
}

json run_sync(const std::shared_ptr<fsdp::Mesh>& mesh, fsdp::Options opts, const Args& a) {
  const int W = mesh->world_size(), rank = mesh->rank();
  const int64_t per = kGlobalBatch / W;
  const auto cfg = models::GPTConfig::preset("tiny");
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  opts.sync_module_states = a.sync_module_states != 0;
  torch::manual_seed(100 + rank);  // every rank a different initialization
  models::GPT mine(cfg);
  torch::manual_seed(100);  // rank 0's
  models::GPT ref(cfg);
  fsdp::FullyShardedDataParallel sharded(mine, mesh, opts);
  torch::optim::SGD opt(mine->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  const double initial = max_shard_diff(sharded, mine, ref, rank);
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    gpt_loss([&](const torch::Tensor& x) { return sharded.forward(x); }, step, rank * per, rank * per + per).backward();
    opt.step();
    gpt_loss([&](const torch::Tensor& x) { return ref->forward(x); }, step, 0, kGlobalBatch).backward();
    ref_opt.step();
  }
  return json{{"initial_diff", initial}, {"max_param_diff", max_shard_diff(sharded, mine, ref, rank)}};
}


json run_deferred(const std::shared_ptr<fsdp::Mesh>& mesh, fsdp::Options opts, const Args& a) {
  const int rank = mesh->rank();
  models::GPTConfig cfg{256, 64, 8, 4, 256};  // 8 blocks of 0.79 M parameters: a unit is ~1/9 of the model
  std::function<std::shared_ptr<torch::nn::Module>()> build;
  if (a.model == "gpt") {
    build = [&] { return models::GPT(cfg).ptr(); };
    opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  } else {
    build = [] { return InitZoo().ptr(); };
    opts.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl, torch::nn::Conv2dImpl, torch::nn::EmbeddingImpl>();
  }
  auto shard_bytes = [](const std::vector<fsdp::UnitInfo>& units) {
    int64_t largest = 0, shards = 0;
    for (const auto& u : units) {
      largest = std::max(largest, u.padded_numel * u.element_size);
      shards += u.shard_numel * u.element_size;
    }
    return std::make_pair(largest, shards);
  };

  torch::manual_seed(7);
  int64_t normal_peak = 0;
  std::shared_ptr<torch::nn::Module> normal;
  std::optional<fsdp::FullyShardedDataParallel<torch::nn::Module>> n;
  {
    fsdp::HostMemoryPeak peak;
    normal = build();
    n.emplace(normal, mesh, opts);
    normal_peak = peak.peak_bytes();
  }
  const at::Tensor after_normal = torch::randn({4});  // where the generator stands afterwards

  torch::manual_seed(7);
  int64_t deferred_peak = 0;
  bool was_deferred = true;
  std::shared_ptr<torch::nn::Module> deferred;
  std::optional<fsdp::FullyShardedDataParallel<torch::nn::Module>> d;
  {
    fsdp::HostMemoryPeak peak;
    deferred = fsdp::deferred_init(build);
    for (const auto& p : deferred->parameters()) was_deferred = was_deferred && fsdp::is_deferred(p) && p.is_meta();
    d.emplace(deferred, mesh, opts);
    deferred_peak = peak.peak_bytes();
  }
  const at::Tensor after_deferred = torch::randn({4});

  bool equal = true;
  std::string first_difference;
  auto np = normal->named_parameters(), dp = deferred->named_parameters();
  for (const auto& item : np) {
    const at::Tensor& x = item.value();
    const at::Tensor& y = dp[item.key()];
    if (y.is_meta() || x.sizes() != y.sizes() || !torch::equal(x, y)) {
      if (equal) first_difference = item.key();
      equal = false;
    }
  }
  auto nb = normal->named_buffers(), db = deferred->named_buffers();
  for (const auto& item : nb) {
    const at::Tensor& y = db[item.key()];
    if (y.is_meta() || !torch::equal(item.value(), y)) {
      if (equal) first_difference = item.key();
      equal = false;
    }
  }
  // The materialized model trains exactly like the normal one (same ops on the same values).
  bool trains_equal = true;
  if (a.model == "gpt") {
    const int64_t per = kGlobalBatch / mesh->world_size();
    auto step_both = [&](int step) {
      for (auto* m : {&*n, &*d}) {
        std::vector<torch::Tensor> unique;
        for (auto& kv : unique_params(*m->module())) unique.push_back(kv.second);
        torch::optim::SGD opt(unique, torch::optim::SGDOptions(0.1));
        opt.zero_grad();
        auto model = std::dynamic_pointer_cast<models::GPTImpl>(m->module());
        gpt_loss([&](const torch::Tensor& x) {
          fsdp::detail::begin_forward(m->runtime());
          auto out = model->forward(x);
          fsdp::detail::end_forward(m->runtime(), {out}, true);
          return out;
        }, step, rank * per, rank * per + per).backward();
        opt.step();
      }
    };
    for (int step = 0; step < 2; ++step) step_both(step);
    auto np2 = normal->named_parameters(), dp2 = deferred->named_parameters();
    for (const auto& item : np2) trains_equal = trains_equal && torch::equal(item.value(), dp2[item.key()]);
  }

  // A constructor that computes with a parameter's value is refused, with the operator named.
  std::string refusal;
  try {
    fsdp::deferred_init([] {
      auto lin = torch::nn::Linear(4, 4);
      torch::NoGradGuard no_grad;
      lin->bias.copy_(lin->weight.sum(1));
      return lin;
    });
  } catch (const std::exception& e) {
    refusal = e.what();
  }
  const auto [largest, shards] = shard_bytes(d->units());
  return json{{"was_deferred", was_deferred}, {"bitwise_equal", equal}, {"first_difference", first_difference},
              {"rng_continues_equal", torch::equal(after_normal, after_deferred)},
              {"normal_peak_bytes", normal_peak}, {"deferred_peak_bytes", deferred_peak},
              {"largest_unit_bytes", largest}, {"shard_bytes", shards}, {"rank", rank}, {"refusal", refusal},
              {"trains_equal", trains_equal}};
}

json run_overlap(const std::shared_ptr<fsdp::Mesh>& mesh, fsdp::Options opts) {
  const int W = mesh->world_size(), rank = mesh->rank();
  const int64_t per = kGlobalBatch / W;
  torch::manual_seed(0);
  auto cfg = models::GPTConfig::preset("tiny");
  cfg.n_layer = 4;
  models::GPT gpt(cfg);
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  fsdp::FullyShardedDataParallel sharded(gpt, mesh, opts);
  torch::optim::SGD opt(gpt->parameters(), torch::optim::SGDOptions(0.1));
  // Step 0 has no previous order for forward prefetch; the last step is the one to look at.
  for (int step = 0; step < 3; ++step) {
    sharded.reset_step();
    opt.zero_grad();
    auto loss = gpt_loss([&](const torch::Tensor& x) { return sharded.forward(x); }, step, rank * per, rank * per + per);
    loss.backward();
    opt.step();
  }
  json spans = json::array();
  for (const auto& s : sharded.timeline()) {
    spans.push_back(json{{"kind", fsdp::to_string(s.kind)}, {"unit", s.unit}, {"backward", s.backward_pass},
                         {"begin_ns", s.begin_ns}, {"start_ns", s.start_ns}, {"end_ns", s.end_ns}, {"seq", s.seq},
                         {"end_seq", s.end_seq}, {"bytes", s.bytes}});
  }
  json names = json::array();
  for (const auto& u : sharded.units()) names.push_back(u.name);
  const auto m = sharded.metrics();
  return json{{"units", names}, {"spans", spans}, {"max_all_gathers_in_flight", m.overlap.max_all_gathers_in_flight},
              {"exposed_ns", m.overlap.exposed_ns()}, {"all_gather_calls", m.comm.all_gather_calls},
              {"reduce_scatter_calls", m.comm.reduce_scatter_calls}, {"all_reduce_calls", m.comm.all_reduce_calls}};
}

void write(const Args& a, int rank, const json& j) {
  std::ofstream(a.out + "." + std::to_string(rank) + ".json") << j.dump(1) << "\n";
}

int run(const Args& a) {
  torch::set_num_threads(1);
  if (a.device == "cuda") {
    if (!torch::cuda::is_available()) throw std::invalid_argument("--device cuda: no CUDA device visible");
    const auto env = fsdp::LaunchEnv::from_environment();
    g_device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank % torch::cuda::device_count()));
    c10::impl::getDeviceGuardImpl(torch::kCUDA)->setDevice(g_device);
  } else if (a.device != "cpu") {
    throw std::invalid_argument("--device must be cpu or cuda");
  }
  auto mesh = fsdp::Mesh::create(fsdp::LaunchEnv::from_environment());
  const int rank = mesh->rank();
  if (a.mode == "parity") {
    json cases = json::array();
    for (std::string model : {"gpt", "uneven"}) {
      for (std::string optim : {"sgd", "adamw"}) cases.push_back(run_parity_case(mesh, options_from(a), model, optim, "plain"));
    }
    if (a.variants == "all") {
      for (std::string v : {"two_forwards", "accum", "no_sync", "clip"}) {
        cases.push_back(run_parity_case(mesh, options_from(a), "gpt", "sgd", v));
        cases.push_back(run_parity_case(mesh, options_from(a), "uneven", "adamw", v));
      }
    }
    write(a, rank, json{{"rank", rank}, {"cases", cases}});
    return 0;
  }
  if (a.mode == "accounting") {
    torch::manual_seed(0);
    models::GPT gpt(models::GPTConfig::preset("tiny"));
    fsdp::Options o = options_from(a);
    o.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
    // The memory plan from the shapes alone (before sharding), to hold against what is measured.
    const auto plan = fsdp::plan_memory(*gpt, mesh->world_size(), o, fsdp::LaunchEnv::from_environment().local_world_size);
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
    write(a, rank, json{{"rank", rank}, {"world_size", mesh->world_size()}, {"shard_size", sharded.shard_size()},
                        {"units", units}, {"steps", steps},
                        {"plan", {{"sharded_params", plan.sharded_params}, {"sharded_grads", plan.sharded_grads},
                                  {"peak_unsharded_params", plan.peak_unsharded_params}, {"shard_size", plan.shard_size}}}});
    return 0;
  }
  // Modes that run on the sharded model and write one JSON result per rank.
  using Mode = std::function<json(const std::shared_ptr<fsdp::Mesh>&, fsdp::Options, const Args&)>;
  const std::map<std::string, Mode> modes = {
      {"overlap", [](const auto& m, auto o, const Args&) { return run_overlap(m, o); }},
      {"dynamic", [](const auto& m, auto o, const Args&) { return run_dynamic(m, o); }},
      {"deferred", run_deferred}, {"precision", run_precision}, {"scaler", run_scaler}, {"sync", run_sync}};
  if (auto it = modes.find(a.mode); it != modes.end()) {
    write(a, rank, it->second(mesh, options_from(a), a));
    return 0;
  }
  if (a.mode == "structure") {
    torch::manual_seed(0);
    auto cfg = models::GPTConfig::preset("tiny");
    if (rank == a.mismatch_rank) cfg.d_model += 2;  // a different model on one rank
    models::GPT gpt(cfg);
    fsdp::FullyShardedDataParallel sharded(gpt, mesh, options_from(a));
    return 0;
  }
  throw std::invalid_argument("unknown mode '" + a.mode + "'");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (auto code = fsdp::maybe_launch_local(argc, argv)) return *code;
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << "fsdp-test-worker: error: " << e.what() << std::endl;
    return 1;
  }
}
