// Quantized all-gather of parameters (ZeRO++'s qwZ; Options::quantize_all_gather).
//
// Each rank quantizes its shard of a unit in blocks of B elements, one fp32 scale per block, into
// one record of bytes; the all-gather moves the records (1 byte per element and 4 per block instead
// of the compute dtype's 2 or 4); every rank dequantizes all records into the unit's compute
// buffer. A record is
//
//   [ scales: blocks × fp32 ][ codes: shard_numel × 1 byte ][ 0-3 bytes of padding ]
//
// (scales first and the record a multiple of 4 bytes, so every rank's scales are aligned floats).
// Blocks never cross a shard's edge: each rank quantizes only what it owns.
//
//   INT8      scale = max|x| / 127, code = round(x / scale) in [-127, 127]: |error| <= max|x| / 254
//   FP8_E4M3  scale = max|x| / 448, code = e4m3(x / scale): relative error <= 2^-4 (and the
//             block's smallest values, below e4m3's normal range, lose more)
//
// A block of zeros gets scale 0 and comes back as zeros. The functions are deterministic: the same
// shard gives the same bytes on every call, so forward and backward compute with the same values.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

#include "fsdp/metrics.h"
#include "fsdp/options.h"

namespace fsdp {

struct QuantizedRecord {
  int64_t numel = 0;   // elements of one shard
  int64_t block = 256;
  int64_t blocks() const { return (numel + block - 1) / block; }
  int64_t bytes() const { return (4 * blocks() + numel + 3) / 4 * 4; }
};

// The bytes one rank's shard of `numel` elements travels as.
QuantizedRecord quantized_record(int64_t numel, int block);

// shard (any floating dtype, `record.numel` elements) -> one record (uint8, record.bytes()).
at::Tensor quantize_shard(const at::Tensor& shard, AllGatherQuantization mode, const QuantizedRecord& record);

// `gathered` (uint8, G records) -> out (G × record.numel elements, its own dtype), rank by rank (the
// temporaries are one shard's, in fp32).
void dequantize_records(at::Tensor out, const at::Tensor& gathered, AllGatherQuantization mode,
                        const QuantizedRecord& record);

// Adds what `record` (quantize_shard's of `shard`) loses to `stats`: its largest error and |shard|.
void measure_quantization(const at::Tensor& shard, const at::Tensor& record, AllGatherQuantization mode,
                          const QuantizedRecord& layout, QuantizationStats& stats);

}  // namespace fsdp
