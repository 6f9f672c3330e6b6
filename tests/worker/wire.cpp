// fsdp-test-worker wire --variants quantize|gather|max_norm [--quantize int8|fp8] [--quantize-block B] --out PREFIX
//   Issue 26's quantized all-gather, as a user meets it.
//   quantize (one process): the quantizer itself on shards of awkward sizes (1 element, a block
//     and one more, blocks of 1 and 7) cut into runs as parameters cut a shard, with a run of ones,
//     zero runs, outliers and tiny values: no block crosses a run, every element within its bound
//     (int8: max|x| of its block / 254; fp8: |x| / 16, or the scale's subnormal step), zero runs
//     exact, the same bytes on a second call. Writes the worst error / bound.
//   gather (W ranks, full_shard): the tiny GPT after two SGD steps; inside an unshard() scope the
//     parameters hold what the units compute with (the quantized all-gather's output); summon_full_params
//     gives the master weights. Writes the largest difference per parameter, its bound, and fsdp's
//     own measure of it (Metrics::quantization), which must agree.
//   max_norm (W ranks): an Embedding with max_norm under the quantized all-gather (check_max_norm).
#include "comm/quantized_all_gather.h"
#include "worker.h"

namespace worker {
namespace {

json check_quantizer(const Args& a) {
  const auto mode = fsdp::parse_all_gather_quantization(a.quantize);
  const bool int8 = mode == fsdp::AllGatherQuantization::INT8;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(26);
  double worst = 0.0;  // error / bound, over every element of every case
  int64_t cases = 0, elements = 0;
  bool zeros_exact = true, deterministic = true, blocks_inside_runs = true;
  for (int64_t numel : {1, 7, 255, 256, 257, 1000, 4099}) {
    for (int block : {1, 7, 256}) {
      // Runs as a shard's parameter slices make them: a LayerNorm-like run of ones beside runs of
      // tiny values and an outlier; whole zero runs.
      std::vector<int64_t> runs{0};
      for (int64_t r : {3, 300, 310, 600, 999}) if (r < numel) runs.push_back(r);
      at::Tensor x = at::randn({numel}, gen) * 0.02;
      if (numel > 3) x.narrow(0, 0, 3).fill_(1.0);
      if (numel > 3) x[numel / 2] = 3.0;
      if (numel > 600) {
        x.narrow(0, 310, 290).zero_();       // a whole zero run
        x.narrow(0, 300, 10).mul_(1e-4);     // tiny values in a run of their own
      }
      const fsdp::BlockStarts blocks = fsdp::quantization_blocks(runs, numel, block);
      fsdp::QuantizedRecord record;
      record.numel = numel;
      record.max_blocks = static_cast<int64_t>(blocks.size()) + 2;  // another rank may need more
      const at::Tensor packed = fsdp::quantize_shard(x, mode, record, blocks);
      deterministic = deterministic && packed.equal(fsdp::quantize_shard(x, mode, record, blocks));
      at::Tensor back = at::empty({numel});
      fsdp::dequantize_records(back, packed, mode, record, {blocks});
      // Each element's bound from its own block; blocks must end where runs do.
      at::Tensor absmax = at::empty({numel});
      for (size_t b = 0; b < blocks.size(); ++b) {
        const int64_t begin = blocks[b], end = b + 1 < blocks.size() ? blocks[b + 1] : numel;
        if (end - begin > block) blocks_inside_runs = false;
        for (int64_t r : runs) if (r > begin && r < end) blocks_inside_runs = false;
        absmax.narrow(0, begin, end - begin).fill_(x.narrow(0, begin, end - begin).abs().max());
      }
      at::Tensor bound = int8 ? absmax / 254.0 : at::maximum(x.abs() / 16.0, absmax / 448.0 * std::ldexp(1.0, -10));
      at::Tensor err = (back - x).abs();
      // Rounding of the scale and of x / scale in fp32: a relative 1e-6 on top.
      at::Tensor ratio = err / (bound * (1 + 1e-6) + 1e-30);
      worst = std::max(worst, ratio.max().item<double>());
      if (numel > 600) zeros_exact = zeros_exact && back.narrow(0, 310, 290).abs().max().item<double>() == 0.0;
      ++cases;
      elements += numel;
    }
  }
  // Blocks that hold inf or NaN (a frozen -inf attention mask is a parameter a user may shard):
  // those come back exactly, the finite values beside them within the bound of the finite ones
  // (the range one code smaller: INT8 126, FP8 416); and a block of values below 1e-36 (its
  // scale's reciprocal is no float) with zeros in it comes back finite, its zeros zero.
  bool nonfinite_kept = true, tiny_finite = true;
  double special_worst = 0.0;
  for (int block : {4, 256}) {
    const int64_t numel = 600;
    at::Tensor x = at::randn({numel}, gen) * 0.5;
    const double inf = std::numeric_limits<double>::infinity();
    x[1] = -inf;
    x[2] = inf;
    x[300] = std::numeric_limits<double>::quiet_NaN();
    x.narrow(0, 400, 100).mul_(1e-38);
    x.narrow(0, 410, 10).zero_();
    const std::vector<int64_t> runs{0, 400, 500};  // the tiny values a parameter of their own
    const fsdp::BlockStarts blocks = fsdp::quantization_blocks(runs, numel, block);
    fsdp::QuantizedRecord record;
    record.numel = numel;
    record.max_blocks = static_cast<int64_t>(blocks.size());
    at::Tensor back = at::empty({numel});
    fsdp::dequantize_records(back, fsdp::quantize_shard(x, mode, record, blocks), mode, record, {blocks});
    const at::Tensor finite = x.isfinite();
    nonfinite_kept = nonfinite_kept && back[1].item<double>() == -inf && back[2].item<double>() == inf &&
                     std::isnan(back[300].item<double>()) && back.isfinite().equal(finite);
    tiny_finite = tiny_finite && back.narrow(0, 400, 100).isfinite().all().item<bool>() &&
                  back.narrow(0, 410, 10).abs().max().item<double>() == 0.0;
    for (size_t b = 0; b < blocks.size(); ++b) {
      const int64_t begin = blocks[b], end = b + 1 < blocks.size() ? blocks[b + 1] : numel;
      if (begin >= 400 && begin < 500) continue;  // the tiny run: finite is what is asked
      const at::Tensor xb = x.narrow(0, begin, end - begin), fb = finite.narrow(0, begin, end - begin);
      const at::Tensor kept = xb.masked_select(fb);
      if (kept.numel() == 0) continue;
      const double absmax = kept.abs().max().item<double>();
      const at::Tensor got = back.narrow(0, begin, end - begin).masked_select(fb);
      const at::Tensor bound = int8 ? at::full_like(kept, absmax / 252.0)
                                    : at::maximum(kept.abs() / 16.0, at::full_like(kept, absmax / 416.0 * std::ldexp(1.0, -10)));
      special_worst = std::max(special_worst, ((got - kept).abs() / (bound * (1 + 1e-6) + 1e-30)).max().item<double>());
    }
  }
  return {{"cases", cases}, {"elements", elements}, {"worst_error_over_bound", worst},
          {"zero_blocks_exact", zeros_exact}, {"deterministic", deterministic}, {"blocks_inside_runs", blocks_inside_runs},
          {"nonfinite_kept", nonfinite_kept}, {"tiny_blocks_finite", tiny_finite},
          {"nonfinite_blocks_worst_error_over_bound", special_worst}};
}

json check_gather(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const int rank = mesh->rank();
  const int64_t per = kGlobalBatch / mesh->world_size();
  fsdp::Options opts = options_from(a);
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  torch::manual_seed(0);
  models::GPT model(models::GPTConfig::preset("tiny"));
  fsdp::FullyShardedDataParallel sharded(model, mesh, opts);
  torch::optim::SGD opt(sharded.parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    gpt_loss([&](const torch::Tensor& x) { return sharded.forward(x); }, step, rank * per, rank * per + per).backward();
    opt.step();
  }
  sharded.reset_step();
  std::map<std::string, torch::Tensor> computed, master;
  {
    auto scope = sharded.unshard();
    for (auto& [name, p] : sharded.named_parameters()) computed[name] = p.detach().clone();
  }
  const fsdp::QuantizationStats measured = sharded.metrics().quantization;
  {
    auto full = sharded.summon_full_params();
    for (auto& [name, p] : sharded.named_parameters()) master[name] = p.detach().clone();
  }
  json params = json::object();
  double max_error = 0.0, max_weight = 0.0;
  for (auto& [name, w] : master) {
    const double err = (computed[name] - w).abs().max().item<double>();
    const double big = w.abs().max().item<double>();
    params[name] = {{"max_abs_error", err}, {"max_abs_weight", big}};
    max_error = std::max(max_error, err);
    max_weight = std::max(max_weight, big);
  }
  return {{"rank", rank}, {"params", params}, {"max_abs_error", max_error}, {"max_abs_weight", max_weight},
          {"metric_gathers", measured.quantized_gathers}, {"metric_max_abs_error", measured.max_abs_error},
          {"metric_max_abs_weight", measured.max_abs_weight}};
}

// An Embedding with max_norm (an in-place write in forward) under a quantized all-gather: the
// rows the batch looks up are renormalized (what the unit computed with, merged across ranks),
// and every other row of the fp32 master stays bit for bit what it was. Before, the merge copied
// the whole dequantized copy into the shard: every forward snapped the master to the grid.
json check_max_norm(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  constexpr int64_t kRows = 64, kLooked = 32;
  torch::manual_seed(3);
  auto net = torch::nn::Sequential(torch::nn::Embedding(torch::nn::EmbeddingOptions(kRows, 16).max_norm(1.0)),
                                   torch::nn::Linear(16, 4));
  const at::Tensor before = net[0]->as<torch::nn::EmbeddingImpl>()->weight.detach().clone();
  fsdp::FullyShardedDataParallel sharded(net.ptr(), mesh, options_from(a));
  for (int pass = 0; pass < 3; ++pass) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + pass * 10 + mesh->rank());
    sharded.forward(torch::randint(kLooked, {4, 6}, gen)).sum().backward();
  }
  at::Tensor after;
  {
    auto full = sharded.summon_full_params();
    after = net[0]->as<torch::nn::EmbeddingImpl>()->weight.detach().clone();
  }
  const at::Tensor untouched = after.narrow(0, kLooked, kRows - kLooked) - before.narrow(0, kLooked, kRows - kLooked);
  const at::Tensor norms = after.narrow(0, 0, kLooked).norm(2, 1);
  return {{"rank", mesh->rank()}, {"untouched_rows_max_change", untouched.abs().max().item<double>()},
          {"looked_rows_max_norm", norms.max().item<double>()},
          {"rows_over_max_norm_before", (before.narrow(0, 0, kLooked).norm(2, 1) > 1.0).sum().item<int64_t>()}};
}

}  // namespace

json run_wire(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  if (a.variants == "quantize") return check_quantizer(a);
  if (a.variants == "gather") return check_gather(mesh, a);
  if (a.variants == "max_norm") return check_max_norm(mesh, a);
  throw std::invalid_argument("wire: --variants quantize, gather or max_norm");
}

}  // namespace worker
