#include "comm/quantized_all_gather.h"

#include <algorithm>
#include <limits>
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

// Which block each element of a shard is in: [numel] int64.
at::Tensor block_of_each(const BlockStarts& blocks, int64_t numel) {
  std::vector<int64_t> lengths(blocks.size());
  for (size_t b = 0; b < blocks.size(); ++b) lengths[b] = (b + 1 < blocks.size() ? blocks[b + 1] : numel) - blocks[b];
  return at::repeat_interleave(at::arange(static_cast<int64_t>(blocks.size()), at::kLong),
                               at::tensor(lengths, at::kLong));
}

// The finite range of a block that also holds inf or NaN: the codes beyond it stand for those.
double code_max_finite_in_special(AllGatherQuantization mode) {
  return mode == AllGatherQuantization::INT8 ? 126.0 : 416.0;
}

// One record -> [numel] fp32.
at::Tensor dequantize_one(const at::Tensor& rec, AllGatherQuantization mode, const QuantizedRecord& record,
                          const BlockStarts& blocks) {
  const int64_t n_blocks = static_cast<int64_t>(blocks.size());
  const at::Tensor stored = rec.narrow(0, 0, 4 * n_blocks).view(at::kFloat);
  const at::Tensor codes = rec.narrow(0, 4 * record.max_blocks, record.numel).view(code_dtype(mode)).to(at::kFloat);
  const at::Tensor which = block_of_each(blocks, record.numel).to(rec.device());
  at::Tensor out = codes.mul(stored.abs().index_select(0, which));
  const at::Tensor special = stored.signbit();  // blocks holding inf or NaN
  const at::Tensor in_special = special.index_select(0, which);
  const double top = code_max(mode), inf = std::numeric_limits<double>::infinity();
  out.masked_fill_(in_special.logical_and(codes.eq(top)), inf);
  out.masked_fill_(in_special.logical_and(codes.eq(-top)), -inf);
  if (mode == AllGatherQuantization::INT8) {
    out.masked_fill_(in_special.logical_and(codes.eq(-128)), std::numeric_limits<double>::quiet_NaN());
  }
  return out;
}
}  // namespace

BlockStarts quantization_blocks(const std::vector<int64_t>& run_starts, int64_t numel, int block) {
  if (block < 1) {
    throw std::invalid_argument("fsdp: quantization_block=" + std::to_string(block) +
                                " must be at least 1 (elements per scale; 64 is the default)");
  }
  std::vector<int64_t> runs(run_starts.begin(), run_starts.end());
  runs.push_back(0);
  std::sort(runs.begin(), runs.end());
  runs.erase(std::unique(runs.begin(), runs.end()), runs.end());
  BlockStarts out;
  for (size_t i = 0; i < runs.size() && runs[i] < numel; ++i) {
    const int64_t end = i + 1 < runs.size() ? std::min(runs[i + 1], numel) : numel;
    for (int64_t b = runs[i]; b < end; b += block) out.push_back(b);
  }
  return out;
}

at::Tensor quantize_shard(const at::Tensor& shard, AllGatherQuantization mode, const QuantizedRecord& record,
                          const BlockStarts& blocks) {
  TORCH_INTERNAL_ASSERT(mode != AllGatherQuantization::NONE && shard.numel() == record.numel &&
                        static_cast<int64_t>(blocks.size()) <= record.max_blocks);
  at::NoGradGuard no_grad;
  at::Tensor packed = at::zeros({record.bytes()}, shard.options().dtype(at::kByte));
  if (record.numel == 0) return packed;
  const int64_t n_blocks = static_cast<int64_t>(blocks.size());
  const at::Tensor x = shard.reshape(-1).to(at::kFloat);
  const at::Tensor which = block_of_each(blocks, record.numel).to(x.device());
  const at::Tensor finite = at::isfinite(x);
  const at::Tensor values = at::where(finite, x, at::zeros_like(x));
  // Blocks holding inf or NaN (quantize_all_gather.h: their scale's sign bit says so).
  const at::Tensor special = at::zeros({n_blocks}, x.options())
                                 .scatter_reduce_(0, which, finite.logical_not().to(at::kFloat), "amax", true)
                                 .gt(0);
  const at::Tensor range = at::where(special, at::full({n_blocks}, code_max_finite_in_special(mode), x.options()),
                                     at::full({n_blocks}, code_max(mode), x.options()));
  const at::Tensor scale = at::zeros({n_blocks}, x.options())
                               .scatter_reduce_(0, which, values.abs(), "amax", /*include_self=*/true)
                               .div_(range);
  // 1/scale where the block is not all zeros and the reciprocal is a float; zeros (and values too
  // small to scale) quantize to code 0.
  at::Tensor inverse = at::where(scale > 0, scale.reciprocal(), at::zeros_like(scale));
  inverse = at::where(at::isfinite(inverse), inverse, at::zeros_like(inverse));
  const at::Tensor limit = range.index_select(0, which);
  at::Tensor scaled = values.mul(inverse.index_select(0, which));
  // No host sync on the way (the usual block holds no inf): the limits and the codes of the
  // non-finite values are applied to every element.
  if (mode == AllGatherQuantization::INT8) scaled.round_();
  scaled = at::minimum(at::maximum(scaled, limit.neg()), limit);
  const double top = code_max(mode);
  scaled.masked_fill_(x.isposinf(), top);
  scaled.masked_fill_(x.isneginf(), -top);
  scaled.masked_fill_(x.isnan(), mode == AllGatherQuantization::INT8 ? -128.0 : std::numeric_limits<double>::quiet_NaN());
  const at::Tensor codes = mode == AllGatherQuantization::INT8 ? scaled.to(at::kChar) : scaled.to(at::kFloat8_e4m3fn);
  packed.narrow(0, 0, 4 * n_blocks).view(at::kFloat).copy_(at::where(special, scale.neg(), scale));
  packed.narrow(0, 4 * record.max_blocks, record.numel).view(code_dtype(mode)).copy_(codes);
  return packed;
}

void dequantize_records(at::Tensor out, const at::Tensor& gathered, AllGatherQuantization mode,
                        const QuantizedRecord& record, const std::vector<BlockStarts>& blocks) {
  at::NoGradGuard no_grad;
  const int64_t bytes = record.bytes();
  const int64_t G = static_cast<int64_t>(blocks.size());
  TORCH_INTERNAL_ASSERT(gathered.numel() == G * bytes && out.numel() == G * record.numel);
  if (record.numel == 0) return;
  for (int64_t g = 0; g < G; ++g) {
    out.narrow(0, g * record.numel, record.numel)
        .copy_(dequantize_one(gathered.narrow(0, g * bytes, bytes), mode, record, blocks[static_cast<size_t>(g)]));
  }
}

void QuantizationTally::measure(const at::Tensor& shard, const at::Tensor& record, AllGatherQuantization mode,
                                const QuantizedRecord& layout, const BlockStarts& blocks) {
  at::NoGradGuard no_grad;
  gathers_ += 1;
  if (layout.numel == 0) return;
  const at::Tensor master = shard.reshape(-1).to(at::kFloat);
  const at::Tensor error = dequantize_one(record, mode, layout, blocks).sub_(master).abs_().max();
  const at::Tensor weight = master.abs().max();
  max_error_ = max_error_.defined() ? at::maximum(max_error_, error) : error;
  max_weight_ = max_weight_.defined() ? at::maximum(max_weight_, weight) : weight;
}

QuantizationStats QuantizationTally::read() const {
  QuantizationStats stats;
  stats.quantized_gathers = gathers_;
  if (max_error_.defined()) stats.max_abs_error = max_error_.item<double>();
  if (max_weight_.defined()) stats.max_abs_weight = max_weight_.item<double>();
  return stats;
}

}  // namespace fsdp
