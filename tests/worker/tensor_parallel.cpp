// fsdp-test-worker tensor_parallel --tp N [--strategy S] --out PREFIX
//   Tensor parallelism as a user writes it for a model of their own (not the project's GPT or T5):
//   a small classifier with an embedding, two residual MLP blocks (up: column-parallel, down:
//   row-parallel with a bias) and a head over 64 classes, split by a plan of three rules, trained
//   with the head's vocabulary-parallel cross entropy and clipping under fsdp over the
//   data-parallel ranks, against the same model trained locally on the whole batch in the same
//   process. SGD with momentum for 5 steps. Writes the largest loss difference, the largest
//   difference of any whole parameter (full_state_dict) and of the clipping norm.
#include "fsdp/tensor_parallel.h"
#include "fsdp/checkpoint.h"
#include "worker.h"

namespace worker {
namespace {

constexpr int64_t kWidth = 32, kClasses = 64, kTokens = 8;

struct MyBlockImpl : torch::nn::Module {
  MyBlockImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    up = register_module("up", torch::nn::Linear(kWidth, 4 * kWidth));
    down = register_module("down", torch::nn::Linear(4 * kWidth, kWidth));
  }
  // What changes for TP: the two calls go through fsdp's layers (plain calls without a plan).
  torch::Tensor forward(const torch::Tensor& x) {
    return x + fsdp::row_parallel(down, torch::relu(fsdp::column_parallel(up, norm(x))));
  }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(MyBlock);

struct MyNetImpl : torch::nn::Module {
  MyNetImpl() {
    embed = register_module("embed", torch::nn::Embedding(100, kWidth));
    blocks = register_module("blocks", torch::nn::ModuleList(MyBlock(), MyBlock()));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(kWidth, kClasses).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    torch::Tensor x = embed(ids);
    for (const auto& b : *blocks) x = b->as<MyBlockImpl>()->forward(x);
    return fsdp::column_parallel(head, x.mean(1));  // [B, classes / TP]
  }
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& y) {
    return fsdp::vocab_parallel_cross_entropy(logits, y, head->weight);
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(MyNet);

}  // namespace

json run_tensor_parallel(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  auto tp = fsdp::TensorParallel::create(mesh, a.tp);
  const auto& dp = tp->data_parallel();
  auto build = [] {
    torch::manual_seed(0);
    return MyNet();
  };
  MyNet local = build(), mine = build();
  fsdp::parallelize(*mine, tp, {{"blocks.*.up.weight", {0, 1}}, {"blocks.*.up.bias", {0, 1}},
                                {"blocks.*.down.weight", {1, 1}}, {"head.weight", {0, 1}}});
  fsdp::Options opts = options_from(a);
  opts.auto_wrap_policy = fsdp::module_type_policy<MyBlockImpl>();
  opts.tensor_parallel = tp;
  fsdp::FullyShardedDataParallel sharded(mine, dp, opts);
  torch::optim::SGD local_opt(local->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD my_opt(sharded.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const int64_t per = kGlobalBatch / dp->world_size(), begin = dp->rank() * per;
  double loss_diff = 0, norm_diff = 0;
  for (int step = 0; step < kSteps; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    const torch::Tensor ids = torch::randint(100, {kGlobalBatch, kTokens}, gen);
    const torch::Tensor y = torch::randint(kClasses, {kGlobalBatch}, gen);
    local_opt.zero_grad();
    const torch::Tensor l = local->loss(local->forward(ids), y);
    l.backward();
    const double local_norm = torch::nn::utils::clip_grad_norm_(local->parameters(), 0.05);
    local_opt.step();
    my_opt.zero_grad();
    const torch::Tensor m = mine->loss(sharded.forward(ids.narrow(0, begin, per)), y.narrow(0, begin, per));
    m.backward();
    const double my_norm = sharded.clip_grad_norm_(0.05);
    my_opt.step();
    // Each data-parallel rank's loss is its slice's mean: the global batch's is their mean.
    torch::Tensor mean = m.detach().reshape({1}).clone();
    std::vector<torch::Tensor> v{mean};
    dp->world()->allreduce(v)->wait();
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
  return {{"rank", mesh->rank()}, {"loss_diff", loss_diff}, {"norm_rel_diff", norm_diff}, {"param_diff", param_diff},
          {"compared", compared}};
}

}  // namespace worker
