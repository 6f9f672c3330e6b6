#include "engine/touch_detection.h"

#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/graph_task.h>

#include "engine/param_key.h"

namespace fsdp {
namespace touch {
namespace {

struct Target {
  TouchSink* sink;
  size_t unit;
};

struct Armed {
  TouchSink* sink;
  bool record_function;  // Options::unit_detection == RECORD_FUNCTION
};

std::shared_mutex g_mutex;  // guards everything below (rarely written)
std::unordered_map<const c10::StorageImpl*, Target> g_targets;
std::vector<Armed> g_armed;
at::CallbackHandle g_handle = 0;
bool g_callback_enabled = false;

thread_local bool t_in_callback = false;     // our own collectives and copies run operators too
thread_local int t_forward_depth = 0;  // roots whose forward this thread is in (nested: a teacher's)
thread_local CheckpointScope::Kind t_checkpoint = CheckpointScope::NONE;
thread_local std::vector<std::shared_ptr<void>>* t_keep_alive = nullptr;
thread_local std::vector<std::shared_ptr<void>>* t_operator_pins = nullptr;
thread_local std::vector<std::weak_ptr<void>>* t_forward_nodes = nullptr;  // the root forward's (set_forward_nodes)
// RECORD_FUNCTION: how deep in operator calls this thread is (the callback sees the operators a
// composite calls, unlike the key's fallback, which excludes them).
thread_local int t_operator_depth = 0;

struct DepthContext : at::ObserverContext {};

bool requires_grad(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().requires_grad();
  if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) {
      if (t.requires_grad()) return true;
    }
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor() && e.toTensor().requires_grad()) return true;
    }
  }
  return false;
}

// Whether the operator will record an autograd node: grad mode on and an input that requires grad.
template <typename Args>
bool builds_graph(const Args& args) {
  if (t_forward_depth == 0) return false;
  // Without grad mode, but the checkpoint's node will recompute this operator in backward.
  if (t_checkpoint == CheckpointScope::FORWARD) return true;
  if (!c10::GradMode::is_enabled()) return false;
  for (const c10::IValue& v : args) {
    if (requires_grad(v)) return true;
  }
  return false;
}

// Calls `fn(tensor)` for every tensor among an operator's arguments.
template <typename Args, typename Fn>
void for_each_tensor(const Args& args, Fn&& fn) {
  for (const c10::IValue& v : args) {
    if (v.isTensor()) {
      fn(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) fn(t);
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) fn(e.toTensor());
      }
    }
  }
}

const Armed* armed(TouchSink* sink) {
  for (const Armed& a : g_armed) {
    if (a.sink == sink) return &a;
  }
  return nullptr;
}

// The armed sink of the unit whose storage `t` is, if any, in the given detection mode.
const Target* target_of(const at::Tensor& t, bool record_function) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  auto it = g_targets.find(t.storage().unsafeGetStorageImpl());
  if (it == g_targets.end()) return nullptr;
  const Armed* a = armed(it->second.sink);
  return a && a->record_function == record_function ? &it->second : nullptr;
}

// The operator's tensors that are units' storage, told to their sinks; then each sink counts the
// call once, for the first of its units it touched. Returns the sinks that counted it.
// `schema_of()`: the operator's schema (or null), asked only once an argument is a unit's, to
// tell whether the operator writes that argument in place.
template <typename Args, typename SchemaOf>
std::vector<TouchSink*> deliver(const Args& args, bool record_function, bool keyed_only, SchemaOf&& schema_of) {
  bool graph_known = false, graph = false;
  std::vector<Target> first;  // per sink, the first unit touched (usually one sink)
  size_t index = 0;
  for (const c10::IValue& v : args) {
    const size_t argument = index++;
    for_each_tensor(c10::ArrayRef<c10::IValue>(&v, 1), [&](const at::Tensor& t) {
      if (keyed_only && !param_key::has_key(t)) return;
      const Target* target = target_of(t, record_function);
      if (!target) return;
      const c10::FunctionSchema* schema = schema_of();
      const auto* alias =
          schema && argument < schema->arguments().size() ? schema->arguments()[argument].alias_info() : nullptr;
      const bool writes = alias != nullptr && alias->isWrite();
      if (!graph_known) {
        graph = builds_graph(args);
        graph_known = true;
      }
      if (std::none_of(first.begin(), first.end(), [&](const Target& f) { return f.sink == target->sink; })) {
        first.push_back(*target);
      }
      target->sink->on_touch(target->unit, t.unsafeGetTensorImpl(), graph, writes);
    });
  }
  std::vector<TouchSink*> counted;
  for (const Target& f : first) {
    f.sink->on_operator_entered(f.unit);
    counted.push_back(f.sink);
  }
  return counted;
}

bool on_pass_thread() {
  // Only the thread running a root's forward, or a thread running backward. Gloo's worker
  // threads, for one, also run operators on our buffers and must be left alone.
  return t_forward_depth > 0 || torch::autograd::get_current_graph_task_id() != -1;
}

// Options::unit_detection == RECORD_FUNCTION: every operator, by its inputs' storage.
std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  ++t_operator_depth;
  auto depth = std::make_unique<DepthContext>();  // on_op_end takes the level back
  if (t_in_callback || !on_pass_thread()) return depth;
  Suppress reentry;  // RAII: an exception never leaves the guard set
  std::shared_lock<std::shared_mutex> lock(g_mutex);
  // The schema, looked up by name only for an operator that touched a unit.
  std::optional<c10::OperatorHandle> handle;
  bool looked_up = false;
  auto schema_of = [&]() -> const c10::FunctionSchema* {
    if (!looked_up) {
      looked_up = true;
      if (auto name = fn.operator_name()) handle = c10::Dispatcher::singleton().findOp(*name);
    }
    return handle && handle->hasSchema() ? &handle->schema() : nullptr;
  };
  const std::vector<TouchSink*> counted = deliver(fn.inputs(), /*record_function=*/true, /*keyed_only=*/false, schema_of);
  for (const Armed& a : g_armed) {
    // Every operator costs this path, whether it touched a unit or not.
    if (a.record_function && std::find(counted.begin(), counted.end(), a.sink) == counted.end()) {
      a.sink->on_operator_entered(std::nullopt);
    }
  }
  return depth;
}

void on_op_end(const at::RecordFunction&, at::ObserverContext* ctx) {
  if (ctx != nullptr && t_operator_depth > 0) --t_operator_depth;
}

void update_callback_locked() {
  const bool enable = std::any_of(g_armed.begin(), g_armed.end(), [](const Armed& a) { return a.record_function; });
  if (enable == g_callback_enabled) return;
  if (g_handle == 0) {
    g_handle = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_op_start, &on_op_end).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  } else if (enable) {
    at::reenableCallback(g_handle);
  } else {
    at::disableCallback(g_handle);
  }
  g_callback_enabled = enable;
}

}  // namespace

void on_keyed_op(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  if (t_in_callback || !on_pass_thread()) return;
  Suppress reentry;
  std::shared_lock<std::shared_mutex> lock(g_mutex);
  if (g_armed.empty()) return;
  const size_t n = op.schema().arguments().size();
  const c10::ArrayRef<c10::IValue> args(stack.data() + stack.size() - n, n);
  deliver(args, /*record_function=*/false, /*keyed_only=*/true, [&op] { return &op.schema(); });
}

void register_storage(TouchSink* sink, size_t unit, const c10::StorageImpl* storage) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_targets[storage] = Target{sink, unit};
}

void unregister_sink(TouchSink* sink) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  for (auto it = g_targets.begin(); it != g_targets.end();) {
    it = it->second.sink == sink ? g_targets.erase(it) : std::next(it);
  }
  g_armed.erase(std::remove_if(g_armed.begin(), g_armed.end(), [&](const Armed& a) { return a.sink == sink; }),
                g_armed.end());
  update_callback_locked();
}

void arm(TouchSink* sink, bool record_function) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  if (!armed(sink)) g_armed.push_back(Armed{sink, record_function});
  update_callback_locked();
}

void disarm(TouchSink* sink) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_armed.erase(std::remove_if(g_armed.begin(), g_armed.end(), [&](const Armed& a) { return a.sink == sink; }),
                g_armed.end());
  update_callback_locked();
}

Suppress::Suppress() : previous_(t_in_callback) { t_in_callback = true; }
Suppress::~Suppress() { t_in_callback = previous_; }
bool suppressed() { return t_in_callback; }

std::vector<std::weak_ptr<void>>* set_forward_nodes(std::vector<std::weak_ptr<void>>* nodes) {
  return std::exchange(t_forward_nodes, nodes);
}

void note_forward_outputs(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  if (t_forward_nodes == nullptr || t_forward_depth == 0 || t_in_callback) return;
  const size_t n = std::min(op.schema().returns().size(), stack.size());
  auto note = [](const at::Tensor& t) {
    if (!t.defined()) return;
    if (const auto& node = t.grad_fn()) t_forward_nodes->emplace_back(node);
  };
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      note(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) note(t);
    }
  }
}

void enter_forward() { ++t_forward_depth; }
void leave_forward() {
  if (t_forward_depth > 0) --t_forward_depth;
}

CheckpointScope::CheckpointScope(Kind kind, std::vector<std::shared_ptr<void>>* keep_alive)
    : previous_kind_(t_checkpoint), previous_keep_(t_keep_alive) {
  t_checkpoint = kind;
  t_keep_alive = keep_alive;
}

CheckpointScope::~CheckpointScope() {
  t_checkpoint = previous_kind_;
  t_keep_alive = previous_keep_;
}

bool nested_operator() { return t_operator_depth > 1; }

bool checkpointed_forward() { return t_checkpoint == CheckpointScope::FORWARD; }
bool recomputing() { return t_checkpoint == CheckpointScope::RECOMPUTE; }

void keep_alive_with_checkpoint(std::shared_ptr<void> node) {
  if (node && t_checkpoint == CheckpointScope::FORWARD && t_keep_alive) t_keep_alive->push_back(std::move(node));
}

OperatorPins::OperatorPins() : previous_(t_operator_pins) { t_operator_pins = &pins_; }
OperatorPins::~OperatorPins() { t_operator_pins = previous_; }

void pin_for_operator(std::shared_ptr<void> node) {
  if (node && t_operator_pins) t_operator_pins->push_back(std::move(node));
}

bool in_root_pass() { return t_forward_depth > 0 || t_in_callback || torch::autograd::get_current_graph_task_id() != -1; }

}  // namespace touch
}  // namespace fsdp
