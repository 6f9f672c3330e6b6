#include "engine/param_guard.h"

#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include <c10/util/SmallVector.h>

#include "engine/param_key.h"

namespace fsdp::guard {
namespace {

struct Entry {
  Sink* sink;
  size_t unit;
  bool grad = false;  // an unreduced gradient, not a parameter
};
std::shared_mutex g_mutex;
std::unordered_map<const c10::StorageImpl*, Entry> g_storages;

}  // namespace

std::string on_keyed_op(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  // Every registered argument, and whether the operator writes it: an optimizer's update names the
  // parameter and its gradient, and either may be what must be refused (a parameter that is whole
  // at rest passes, the stand-in gradient beside it does not).
  struct Hit {
    Entry entry;
    at::Tensor tensor;
    bool writes;
  };
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  c10::SmallVector<Hit, 2> hits;  // an optimizer's update: the parameter and its gradient, no allocation
  {
    std::shared_lock<std::shared_mutex> lock(g_mutex);
    auto consider = [&](const at::Tensor& t, bool writes) {
      if (!t.defined() || !param_key::has_key(t) || !t.has_storage()) return;
      auto it = g_storages.find(t.storage().unsafeGetStorageImpl());
      if (it != g_storages.end()) hits.push_back(Hit{it->second, t, writes});
    };
    for (size_t i = 0; i < n; ++i) {
      const c10::IValue& v = stack[stack.size() - n + i];
      const auto* alias = schema.arguments()[i].alias_info();
      // A list (fsdp::FusedAdamW's one call per parameter group: Tensor(a!)[]) writes its elements
      // when its element type is written.
      bool writes = alias != nullptr && alias->isWrite();
      if (v.isTensor()) {
        consider(v.toTensor(), writes);
      } else if (v.isTensorList()) {
        if (alias != nullptr && !alias->containedTypes().empty()) writes = writes || alias->containedTypes()[0].isWrite();
        for (const at::Tensor& t : v.toTensorVector()) consider(t, writes);
      }
    }
  }
  std::string if_it_fails;
  for (const Hit& hit : hits) {
    if (hit.entry.grad) {
      hit.entry.sink->on_unreduced_grad_op(op, hit.entry.unit, hit.writes);
    } else {
      std::string why = hit.entry.sink->on_guarded_op(op, hit.entry.unit, hit.tensor, hit.writes);
      if (if_it_fails.empty()) if_it_fails = std::move(why);
    }
  }
  return if_it_fails;
}

void register_storage(Sink* sink, size_t unit, const c10::StorageImpl* storage) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_storages[storage] = Entry{sink, unit};
}

void register_grad_storage(Sink* sink, size_t unit, const c10::StorageImpl* storage) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_storages[storage] = Entry{sink, unit, true};
}

void unregister_grad_storage(const c10::StorageImpl* storage) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  auto it = g_storages.find(storage);
  if (it != g_storages.end() && it->second.grad) g_storages.erase(it);
}

void unregister_sink(Sink* sink) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  for (auto it = g_storages.begin(); it != g_storages.end();) {
    it = it->second.sink == sink ? g_storages.erase(it) : std::next(it);
  }
}

bool consumes_module_shape(const c10::OperatorName& name) {
  static const std::unordered_set<std::string> ops = {
      "aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv",
      "aten::mv", "aten::bilinear", "aten::einsum", "aten::conv1d", "aten::conv2d", "aten::conv3d",
      "aten::convolution", "aten::_convolution", "aten::conv_transpose1d", "aten::conv_transpose2d",
      "aten::conv_transpose3d", "aten::embedding", "aten::embedding_bag", "aten::_embedding_bag",
      "aten::layer_norm", "aten::native_layer_norm", "aten::group_norm", "aten::native_group_norm",
      "aten::batch_norm", "aten::native_batch_norm", "aten::instance_norm", "aten::rms_norm",
      "aten::scaled_dot_product_attention", "aten::prelu", "aten::lstm", "aten::gru", "aten::rnn_tanh",
      "aten::rnn_relu"};
  return ops.count(name.name) > 0;
}

}  // namespace fsdp::guard
