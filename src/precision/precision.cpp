#include "precision/precision.h"

namespace fsdp {

UnitDtypes unit_dtypes(c10::ScalarType param_dtype, const std::optional<MixedPrecision>& mp) {
  UnitDtypes d{param_dtype, param_dtype, param_dtype, param_dtype};
  if (!mp || !c10::isFloatingType(param_dtype)) return d;
  d.compute = mp->param_dtype;
  d.reduce = mp->reduce_dtype;
  d.grad = mp->keep_low_precision_grads ? d.compute : d.master;
  return d;
}

}  // namespace fsdp
