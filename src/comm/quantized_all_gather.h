// Quantized all-gather of parameters (ZeRO++'s qwZ; Options::quantize_all_gather).
//
// Each rank quantizes its shard of a unit in blocks, one fp32 scale per block, into one record of
// bytes; the all-gather moves the records (1 byte per element and 4 per block instead of the
// compute dtype's 2 or 4); every rank dequantizes all records into the unit's compute buffer.
//
// Blocks never cross the edge of a parameter (nor of the shard, nor of the padding): a block holds
// at most `block` elements of one parameter, so a LayerNorm's weights (1.0) never set the scale of
// the biases next to them (1e-6), and every parameter's error is bounded by its own values. So a
// shard's blocks follow its parameter slices ("runs", given by their start offsets), and ranks
// holding different slices have different numbers of blocks; a record leaves room for the most
// scales any rank needs, so that all records have one size:
//
//   [ scales: max_blocks × fp32 ][ codes: shard_numel × 1 byte ][ 0-3 bytes of padding ]
//
// (scales first and the record a multiple of 4 bytes, so every rank's scales are aligned floats).
//
//   INT8      scale = max|x| / 127, code = round(x / scale) in [-127, 127]: |error| <= max|x| / 254
//   FP8_E4M3  scale = max|x| / 448, code = e4m3(x / scale): relative error <= 2^-4 (values below
//             e4m3's normal range, 2^-6 of the block's max, keep an absolute error of 2^-10 scale)
//
// A block of zeros gets scale 0 and comes back as zeros; so does a block too small for its scale's
// reciprocal to be a float (max|x| below ~1e-36 in FP8). A block holding inf or NaN (a frozen -inf
// mask) is marked by its scale's sign bit: its finite values use a slightly smaller range (INT8
// 126, FP8 416) and the codes beyond it stand for the others (INT8 127 +inf, -127 -inf, -128 NaN;
// FP8 +448 +inf, -448 -inf, NaN NaN), so they come back exactly and the finite ones beside them
// stay finite. The functions are deterministic: the same shard gives the same bytes on every call,
// so forward and backward compute with the same values.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "fsdp/metrics.h"
#include "fsdp/options.h"

namespace fsdp {

// The blocks of one shard: their start offsets (the first is 0), each block running to the next
// start (the last to the shard's end).
using BlockStarts = std::vector<int64_t>;

// Cuts a shard of `numel` elements whose runs start at `run_starts` (sorted; parameters'
// slices, the padding) into blocks of at most `block` elements that stay inside their runs.
// Throws std::invalid_argument for a block below 1.
BlockStarts quantization_blocks(const std::vector<int64_t>& run_starts, int64_t numel, int block);

struct QuantizedRecord {
  int64_t numel = 0;       // elements of one shard
  int64_t max_blocks = 0;  // the most blocks any rank's shard has: the room for scales
  int64_t bytes() const { return (4 * max_blocks + numel + 3) / 4 * 4; }
};

// shard (any floating dtype, record.numel elements, cut as `blocks`) -> one record (uint8).
at::Tensor quantize_shard(const at::Tensor& shard, AllGatherQuantization mode, const QuantizedRecord& record,
                          const BlockStarts& blocks);

// `gathered` (uint8, one record per rank, rank g's shard cut as blocks[g]) -> out (G × record.numel
// elements, its own dtype), rank by rank (the temporaries are one shard's, in fp32).
void dequantize_records(at::Tensor out, const at::Tensor& gathered, AllGatherQuantization mode,
                        const QuantizedRecord& record, const std::vector<BlockStarts>& blocks);

// What quantized all-gathers lost since the last reset, kept as 0-d tensors on the shards' device
// and read (one sync) only when someone asks: measuring must not stall every gather on CUDA.
class QuantizationTally {
 public:
  // Adds what `record` (quantize_shard's of `shard`) loses: its largest error and |shard|.
  void measure(const at::Tensor& shard, const at::Tensor& record, AllGatherQuantization mode,
               const QuantizedRecord& layout, const BlockStarts& blocks);
  QuantizationStats read() const;

 private:
  int64_t gathers_ = 0;
  at::Tensor max_error_, max_weight_;
};

}  // namespace fsdp
