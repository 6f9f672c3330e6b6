#include "comm/quantized_all_gather.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include <c10/core/GradMode.h>

namespace fsdp {
namespace {
// The largest magnitude a code holds: int8's symmetric range, e4m3's largest finite value.
double code_max(AllGatherQuantization mode) { return mode == AllGatherQuantization::INT8 ? 127.0 : 448.0; }

at::ScalarType code_dtype(AllGatherQuantization mode) {
  return mode == AllGatherQuantization::INT8 ? at::kChar : at::kFloat8_e4m3fn;
}
}  // namespace

QuantizedRecord quantized_record(int64_t numel, int block) {
  if (block < 1) {
    throw std::invalid_argument("fsdp: quantization_block=" + std::to_string(block) +
                                " must be at least 1 (elements per scale; 256 is the default)");
  }
  QuantizedRecord r;
  r.numel = numel;
  r.block = block;
  return r;
}

at::Tensor quantize_shard(const at::Tensor& shard, AllGatherQuantization mode, const QuantizedRecord& record) {
  TORCH_INTERNAL_ASSERT(mode != AllGatherQuantization::NONE && shard.numel() == record.numel);
  at::NoGradGuard no_grad;
  const int64_t blocks = record.blocks(), padded = blocks * record.block;
  at::Tensor packed = at::zeros({record.bytes()}, shard.options().dtype(at::kByte));
  if (record.numel == 0) return packed;
  // Blocks of fp32 (the last one padded with zeros, which change neither its max nor its codes).
  at::Tensor x = at::zeros({padded}, shard.options().dtype(at::kFloat));
  x.narrow(0, 0, record.numel).copy_(shard.reshape(-1));
  x = x.view({blocks, record.block});
  const at::Tensor scale = x.abs().amax(1, /*keepdim=*/true).div_(code_max(mode));
  // 1/scale where the block is not all zeros; zeros quantize to code 0 either way.
  const at::Tensor inverse = at::where(scale > 0, scale.reciprocal(), at::zeros_like(scale));
  at::Tensor scaled = x.mul(inverse);
  at::Tensor codes = mode == AllGatherQuantization::INT8 ? scaled.round_().clamp_(-127, 127).to(at::kChar)
                                                         : scaled.clamp_(-448, 448).to(at::kFloat8_e4m3fn);
  packed.narrow(0, 0, 4 * blocks).view(at::kFloat).copy_(scale.reshape(-1));
  packed.narrow(0, 4 * blocks, record.numel).view(code_dtype(mode)).copy_(codes.reshape(-1).narrow(0, 0, record.numel));
  return packed;
}

void dequantize_records(at::Tensor out, const at::Tensor& gathered, AllGatherQuantization mode,
                        const QuantizedRecord& record) {
  at::NoGradGuard no_grad;
  const int64_t bytes = record.bytes(), blocks = record.blocks(), padded = blocks * record.block;
  const int64_t G = gathered.numel() / bytes;
  TORCH_INTERNAL_ASSERT(gathered.numel() == G * bytes && out.numel() == G * record.numel);
  if (record.numel == 0) return;
  at::Tensor values = at::zeros({padded}, out.options().dtype(at::kFloat));
  for (int64_t g = 0; g < G; ++g) {
    const at::Tensor rec = gathered.narrow(0, g * bytes, bytes);
    const at::Tensor scale = rec.narrow(0, 0, 4 * blocks).view(at::kFloat).view({blocks, 1});
    values.narrow(0, 0, record.numel).copy_(rec.narrow(0, 4 * blocks, record.numel).view(code_dtype(mode)));
    at::Tensor v = values.view({blocks, record.block}).mul(scale);
    out.narrow(0, g * record.numel, record.numel).copy_(v.view({-1}).narrow(0, 0, record.numel));
  }
}

void measure_quantization(const at::Tensor& shard, const at::Tensor& record, AllGatherQuantization mode,
                          const QuantizedRecord& layout, QuantizationStats& stats) {
  at::NoGradGuard no_grad;
  stats.quantized_gathers += 1;
  if (layout.numel == 0) return;
  at::Tensor back = at::empty({layout.numel}, shard.options().dtype(at::kFloat));
  dequantize_records(back, record, mode, layout);
  const at::Tensor master = shard.reshape(-1).to(at::kFloat);
  stats.max_abs_error = std::max(stats.max_abs_error, back.sub_(master).abs_().max().item<double>());
  stats.max_abs_weight = std::max(stats.max_abs_weight, master.abs().max().item<double>());
}

}  // namespace fsdp
