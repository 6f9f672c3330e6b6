// fsdp-test-worker wire --variants quantize|gather [--quantize int8|fp8] [--quantize-block B] --out PREFIX
//   Issue 26's quantized all-gather, as a user meets it.
//   quantize (one process): the quantizer itself on shards of awkward sizes (1 element, a block
//     and one more, blocks of 1 and 7), with zero blocks, outliers and tiny values: every element
//     within its bound (int8: max|x| of its block / 254; fp8: |x| / 16, or the scale's subnormal
//     step), zero blocks exact, the same bytes on a second call. Writes the worst error / bound.
//   gather (W ranks, full_shard): the tiny GPT after two SGD steps; inside an unshard() scope the
//     parameters hold what the units compute with (the quantized all-gather's output); summon_full_params
//     gives the master weights. Writes the largest difference per parameter, its bound, and fsdp's
//     own measure of it (Metrics::quantization), which must agree.
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
  bool zeros_exact = true, deterministic = true;
  for (int64_t numel : {1, 7, 255, 256, 257, 1000, 4099}) {
    for (int block : {1, 7, 256}) {
      at::Tensor x = at::randn({numel}, gen) * 0.02;
      if (numel > 3) x[numel / 2] = 3.0;  // an outlier: its block's scale grows, the others' do not
      if (numel > 600) {
        x.narrow(0, 0, 300).zero_();                 // whole zero blocks
        x.narrow(0, 300, 10).mul_(1e-6);             // tiny values in a block with larger ones
      }
      const auto record = fsdp::quantized_record(numel, block);
      const at::Tensor packed = fsdp::quantize_shard(x, mode, record);
      deterministic = deterministic && packed.equal(fsdp::quantize_shard(x, mode, record));
      at::Tensor back = at::empty({numel});
      fsdp::dequantize_records(back, packed, mode, record);
      // Per-element bound from the element's block.
      const int64_t blocks = record.blocks();
      at::Tensor padded = at::zeros({blocks * block});
      padded.narrow(0, 0, numel).copy_(x);
      at::Tensor absmax = padded.view({blocks, block}).abs().amax(1, true).expand({blocks, block}).reshape(-1).narrow(0, 0, numel);
      at::Tensor bound = int8 ? absmax / 254.0 : at::maximum(x.abs() / 16.0, absmax / 448.0 * std::ldexp(1.0, -10));
      at::Tensor err = (back - x).abs();
      // Rounding of the scale and of x / scale in fp32: a relative 1e-6 on top.
      at::Tensor ratio = err / (bound * (1 + 1e-6) + 1e-30);
      worst = std::max(worst, ratio.max().item<double>());
      if (numel > 600) zeros_exact = zeros_exact && back.narrow(0, 0, 256).abs().max().item<double>() == 0.0;
      ++cases;
      elements += numel;
    }
  }
  return {{"cases", cases}, {"elements", elements}, {"worst_error_over_bound", worst},
          {"zero_blocks_exact", zeros_exact}, {"deterministic", deterministic}};
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

}  // namespace

json run_wire(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  if (a.variants == "quantize") return check_quantizer(a);
  if (a.variants == "gather") return check_gather(mesh, a);
  throw std::invalid_argument("wire: --variants quantize or gather");
}

}  // namespace worker
