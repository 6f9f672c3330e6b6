#include "engine/param_key.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "engine/param_guard.h"
#include "engine/touch_detection.h"

namespace fsdp::param_key {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::TESTING_ONLY_GenericWrapper;

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  touch::OperatorPins pins;  // until autograd has recorded the operator
  if (!touch::suppressed()) {
    if (touch::in_root_pass()) {
      touch::on_keyed_op(op, *stack);
    } else {
      guard::on_keyed_op(op, *stack);
    }
  }
  c10::impl::ExcludeDispatchKeyGuard nested(kKey);
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
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
