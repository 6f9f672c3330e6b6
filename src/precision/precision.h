// Mixed precision's dtype rules (paper §4.4), in one place: the handle, the gradient reduction and
// the memory plan all ask here which dtype a unit's parameters are stored, computed, reduced and
// handed to the optimizer in.
#pragma once

#include <optional>

#include <c10/core/ScalarType.h>

#include "fsdp/options.h"

namespace fsdp {

struct UnitDtypes {
  c10::ScalarType master;   // the sharded parameters (what the optimizer steps)
  c10::ScalarType compute;  // the unsharded parameters: all-gather, forward and backward
  c10::ScalarType reduce;   // gradient reduce-scatter and all-reduce
  c10::ScalarType grad;     // the sharded gradients handed to the optimizer
  // Gathering needs a buffer of its own even with F = 1: the cast.
  bool casts() const { return compute != master; }
  // Reduced in a narrower type than the master: divide by W before summing (an fp16 sum could
  // overflow) and cast back after.
  bool low_precision_reduce() const { return reduce != master; }
  // Divide each rank's gradients by W before the sum, not after: whenever the reduction runs in a
  // 16-bit float, also for a model that is fp16 itself (no mixed precision), where the sum of W
  // per-rank gradients overflows fp16 long before their mean does (local training computes the
  // mean). Full precision divides after, as local training rounds.
  bool divide_before_sum() const {
    return low_precision_reduce() || reduce == c10::kHalf || reduce == c10::kBFloat16;
  }
};

// Mixed precision applies to floating-point units only; integer parameters keep their dtype.
UnitDtypes unit_dtypes(c10::ScalarType param_dtype, const std::optional<MixedPrecision>& mixed_precision);

}  // namespace fsdp
