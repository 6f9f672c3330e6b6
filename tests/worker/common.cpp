// What the worker's modes share: flags, data, optimizers, and the shard comparison.
#include <set>

#include "engine/flat_param.h"
#include "worker.h"

namespace worker {

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
    else if (k == "--unit-detection") a.unit_detection = v;
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
    else if (k == "--seeds") a.seeds = v;
    else if (k == "--mixed-precision") a.mixed_precision = v;
    else if (k == "--calls") a.calls = std::stoi(v);
    else if (k == "--fault") a.fault = v;
    else if (k == "--fault-at") a.fault_at = v;
    else if (k == "--fault-rank") a.fault_rank = std::stoi(v);
    else if (k == "--fault-step") a.fault_step = std::stoi(v);
    else if (k == "--sequence") a.sequence = v;
    else if (k == "--features") a.features = v;
    else if (k == "--mismatch-what") a.mismatch_what = v;
    else if (k == "--case") a.hole = v;
    else if (k == "--path") a.path = v;
    else if (k == "--quantize") a.quantize = v;
    else if (k == "--quantize-block") a.quantize_block = std::stoi(v);
    else if (k == "--hpz") a.hpz = std::stoi(v);
    else if (k == "--gloo-reduce-scatter") a.gloo_reduce_scatter = v;
    else if (k == "--tp") a.tp = std::stoi(v);
    else throw std::invalid_argument("unknown flag " + k);
  }
  return a;
}

fsdp::Options options_from(const Args& a) {
  fsdp::Options o;
  o.strategy = fsdp::parse_strategy(a.strategy);
  o.shard_size = a.shard_size;
  o.backward_prefetch = fsdp::parse_backward_prefetch(a.backward_prefetch);
  o.unit_detection = fsdp::parse_unit_detection(a.unit_detection);
  o.forward_prefetch = a.forward_prefetch != 0;
  o.prefetch_count = a.prefetch_count;
  o.limit_all_gathers = a.limit_all_gathers;
  o.quantize_all_gather = fsdp::parse_all_gather_quantization(a.quantize);
  o.quantization_block = a.quantize_block;
  o.reshard_after_forward_to = a.hpz;
  o.gloo_reduce_scatter = fsdp::parse_gloo_reduce_scatter(a.gloo_reduce_scatter);
  return o;
}

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

std::vector<std::pair<std::string, torch::Tensor>> unique_params(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : m.named_parameters()) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  }
  return out;
}

double max_shard_diff(const fsdp::FullyShardedDataParallelBase& sharded, torch::nn::Module& mine, torch::nn::Module& ref,
                      int rank) {
  auto ref_named = ref.named_parameters();
  auto my_named = mine.named_parameters();
  const int F = sharded.shard_size();
  double diff = 0;
  for (const auto& unit : sharded.units()) {
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& f : unit.fqns) shapes.push_back(ref_named[f].sizes().vec());
    fsdp::FlatParamLayout layout(unit.fqns, shapes, F);
    for (size_t i = 0; i < unit.fqns.size(); ++i) {
      const auto sl = layout.slice(i, rank % F);
      auto m = my_named[unit.fqns[i]].detach().reshape(-1).to(torch::kFloat);
      if (m.numel() != sl.length) throw std::runtime_error("the shard of " + unit.fqns[i] + " has the wrong size");
      auto r = ref_named[unit.fqns[i]].detach().reshape(-1).narrow(0, sl.param_begin, sl.length).to(torch::kFloat);
      if (sl.length > 0) diff = std::max(diff, (m - r).abs().max().item<double>());
    }
  }
  return diff;
}

double global_mean(const std::shared_ptr<fsdp::Mesh>& mesh, const torch::Tensor& local) {
  std::vector<at::Tensor> v{local.detach().reshape({1}).to(torch::kCPU, torch::kDouble).clone()};
  mesh->world()->allreduce(v)->wait();
  return v[0].item<double>() / mesh->world_size();
}

RoutedStackImpl::RoutedStackImpl() {
  for (int i = 0; i < 4; ++i) blocks.push_back(register_module("block" + std::to_string(i), torch::nn::Linear(16, 16)));
  out = register_module("out", torch::nn::Linear(16, 16));
}

torch::Tensor RoutedStackImpl::forward(const torch::Tensor& x, int64_t step) {
  static const int orders[3][4] = {{0, 1, 2, 3}, {3, 1, 0, -1}, {2, 0, 3, 1}};
  auto h = x;
  for (int i : orders[step % 3]) {
    if (i >= 0) h = torch::tanh(blocks[static_cast<size_t>(i)](h));
  }
  return out(h);
}

InitZooImpl::InitZooImpl() {
  conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3)));
  lin = register_module("lin", torch::nn::Linear(64, 32));
  xavier_w = register_parameter("xavier_w", torch::empty({48, 40}));
  torch::nn::init::xavier_normal_(xavier_w);
  kaiming_w = register_parameter("kaiming_w", torch::empty({40, 24}));
  torch::nn::init::kaiming_normal_(kaiming_w, 0, torch::kFanOut, torch::kReLU);
  emb = register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(50, 16).padding_idx(0)));
  noise = register_parameter("noise", torch::randn({7, 3}));
  norm = register_module("norm", torch::nn::BatchNorm1d(16));
  // Two parameters that are parts of one tensor initialized whole (a fused projection split).
  auto halves = torch::empty({2, 20, 6});
  torch::nn::init::uniform_(halves, -0.5, 0.5);
  first_half = register_parameter("first_half", halves[0]);
  second_half = register_parameter("second_half", halves[1]);
}

json timeline_json(const fsdp::FullyShardedDataParallelBase& sharded) {
  json spans = json::array();
  for (const auto& s : sharded.timeline()) {
    spans.push_back(json{{"kind", fsdp::to_string(s.kind)}, {"unit", s.unit}, {"backward", s.backward_pass},
                         {"begin_ns", s.begin_ns}, {"start_ns", s.start_ns}, {"end_ns", s.end_ns}, {"seq", s.seq},
                         {"end_seq", s.end_seq}, {"bytes", s.bytes}});
  }
  return spans;
}

}  // namespace worker
