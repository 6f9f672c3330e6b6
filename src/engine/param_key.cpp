#include "engine/param_key.h"

#include <algorithm>
#include <string>

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "engine/param_guard.h"
#include "engine/touch_detection.h"

namespace fsdp::param_key {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::TESTING_ONLY_GenericWrapper;

// The floating-point dtypes among an operator's arguments: of keyed tensors (units' parameters,
// in their compute dtype) and of the others.
struct ArgumentDtypes {
  c10::ScalarType param = c10::ScalarType::Undefined, other = c10::ScalarType::Undefined;
  void note(const at::Tensor& t) {
    if (!t.defined() || !at::isFloatingType(t.scalar_type())) return;
    (has_key(t) ? param : other) = t.scalar_type();
  }
  bool mixed() const {
    return param != c10::ScalarType::Undefined && other != c10::ScalarType::Undefined && param != other;
  }
};

ArgumentDtypes dtypes_of(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  ArgumentDtypes d;
  const size_t n = std::min(op.schema().arguments().size(), stack.size());
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      d.note(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) d.note(t);
    }
  }
  return d;
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  touch::OperatorPins pins;  // until autograd has recorded the operator
  const bool in_pass = !touch::suppressed() && touch::in_root_pass();
  std::string if_it_fails;  // the guard's explanation, should the operator fail
  if (!touch::suppressed()) {
    if (in_pass) {
      touch::on_keyed_op(op, *stack);
    } else {
      if_it_fails = guard::on_keyed_op(op, *stack);
    }
  }
  // Read before the call, which consumes the arguments; only looked at if it throws.
  const ArgumentDtypes dtypes = in_pass ? dtypes_of(op, *stack) : ArgumentDtypes{};
  c10::impl::ExcludeDispatchKeyGuard nested(kKey);
  try {
    op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
    // Autograd (below this key) has recorded the operator: its node belongs to the forward.
    if (in_pass && c10::GradMode::is_enabled()) touch::note_forward_outputs(op, *stack);
  } catch (const c10::Error& e) {
    TORCH_CHECK(if_it_fails.empty(), if_it_fails, " libtorch said: ", e.what_without_backtrace());
    if (!dtypes.mixed()) throw;
    // A tensor that reached a unit in another dtype than its parameters compute in: under mixed
    // precision, one the wrapper could not cast (inside the caller's own struct, from a
    // forward_with lambda). libtorch's own error would not say why or what to do.
    const std::string param = c10::toString(dtypes.param), other = c10::toString(dtypes.other);
    TORCH_CHECK(false, "fsdp: ", op.schema().name(), " got a ", other, " tensor beside a unit's ", param,
                " parameters and cannot mix them. A unit computes in its compute dtype (mixed precision's "
                "param_dtype): FullyShardedDataParallel::forward casts its floating-point Tensor arguments to "
                "param_dtype, also inside std::vector, std::map, std::unordered_map, std::pair, std::tuple, "
                "std::optional, c10::List and c10::Dict, but not tensors inside your own types, nor those a "
                "forward_with lambda or the module itself brings in: cast those yourself (t.to(torch::k", param,
                ")). libtorch said: ", e.what_without_backtrace());
  }
}

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericWrapper, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

}  // namespace

at::Tensor keyed(const at::Tensor& view) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(view.storage()),
                                                   view.key_set() | c10::DispatchKeySet(kKey), view.dtype());
  impl->set_sizes_and_strides(view.sizes(), view.strides(), view.storage_offset());
  return at::Tensor(std::move(impl));
}

bool has_key(const at::Tensor& t) { return t.defined() && t.key_set().has(kKey); }

}  // namespace fsdp::param_key
