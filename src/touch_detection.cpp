#include "touch_detection.h"

#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/graph_task.h>

namespace fsdp {
namespace touch {
namespace {

struct Target {
  const c10::StorageImpl* storage;
  TouchSink* sink;
  size_t unit;
};

std::shared_mutex g_mutex;               // guards g_targets and g_armed (rarely written)
std::vector<Target> g_targets;
std::vector<TouchSink*> g_armed;
at::CallbackHandle g_handle = 0;
bool g_enabled = false;

thread_local bool t_in_callback = false;     // our own collectives and copies run operators too
thread_local bool t_forward_thread = false;
thread_local CheckpointScope::Kind t_checkpoint = CheckpointScope::NONE;
thread_local std::vector<std::shared_ptr<void>>* t_keep_alive = nullptr;

// Whether the operator will record an autograd node: grad mode on and an input that requires grad.
bool builds_graph(const at::RecordFunction& fn) {
  if (!t_forward_thread) return false;
  // Without grad mode, but the checkpoint's node will recompute this operator in backward.
  if (t_checkpoint == CheckpointScope::FORWARD) return true;
  if (!c10::GradMode::is_enabled()) return false;
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) {
      if (v.toTensor().requires_grad()) return true;
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) {
        if (t.requires_grad()) return true;
      }
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor() && e.toTensor().requires_grad()) return true;
      }
    }
  }
  return false;
}

// Tells the sink of the unit whose storage `t` is, if any.
void inspect(const at::Tensor& t, const at::RecordFunction& fn) {
  if (!t.defined() || !t.has_storage()) return;
  const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  for (const Target& target : g_targets) {
    if (target.storage != s) continue;
    if (std::find(g_armed.begin(), g_armed.end(), target.sink) == g_armed.end()) return;
    target.sink->on_touch(target.unit, t.unsafeGetTensorImpl(), builds_graph(fn));
    return;
  }
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  if (t_in_callback) return nullptr;
  // Only the thread running a root's forward, or a thread running backward. Gloo's worker
  // threads, for one, also run operators on our buffers and must be left alone.
  if (!t_forward_thread && torch::autograd::get_current_graph_task_id() == -1) return nullptr;
  Suppress reentry;  // RAII: an exception never leaves the guard set
  std::shared_lock<std::shared_mutex> lock(g_mutex);
  if (g_armed.empty()) return nullptr;
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) {
      inspect(v.toTensor(), fn);
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorVector()) inspect(t, fn);
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) inspect(e.toTensor(), fn);
      }
    }
  }
  return nullptr;
}

void set_enabled_locked(bool enable) {
  if (enable == g_enabled) return;
  if (g_handle == 0) {
    g_handle = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_op_start).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  } else if (enable) {
    at::reenableCallback(g_handle);
  } else {
    at::disableCallback(g_handle);
  }
  g_enabled = enable;
}

}  // namespace

void register_storage(TouchSink* sink, size_t unit, const c10::StorageImpl* storage) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_targets.push_back(Target{storage, sink, unit});
}

void unregister_sink(TouchSink* sink) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_targets.erase(std::remove_if(g_targets.begin(), g_targets.end(),
                                 [&](const Target& t) { return t.sink == sink; }),
                  g_targets.end());
  g_armed.erase(std::remove(g_armed.begin(), g_armed.end(), sink), g_armed.end());
  set_enabled_locked(!g_armed.empty());
}

void arm(TouchSink* sink) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  if (std::find(g_armed.begin(), g_armed.end(), sink) == g_armed.end()) g_armed.push_back(sink);
  set_enabled_locked(true);
}

void disarm(TouchSink* sink) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  g_armed.erase(std::remove(g_armed.begin(), g_armed.end(), sink), g_armed.end());
  set_enabled_locked(!g_armed.empty());
}

Suppress::Suppress() : previous_(t_in_callback) { t_in_callback = true; }
Suppress::~Suppress() { t_in_callback = previous_; }

void set_forward_thread(bool on) { t_forward_thread = on; }

CheckpointScope::CheckpointScope(Kind kind, std::vector<std::shared_ptr<void>>* keep_alive)
    : previous_kind_(t_checkpoint), previous_keep_(t_keep_alive) {
  t_checkpoint = kind;
  t_keep_alive = keep_alive;
}

CheckpointScope::~CheckpointScope() {
  t_checkpoint = previous_kind_;
  t_keep_alive = previous_keep_;
}

bool checkpointed_forward() { return t_checkpoint == CheckpointScope::FORWARD; }
bool recomputing() { return t_checkpoint == CheckpointScope::RECOMPUTE; }

void keep_alive_with_checkpoint(std::shared_ptr<void> node) {
  if (node && t_checkpoint == CheckpointScope::FORWARD && t_keep_alive) t_keep_alive->push_back(std::move(node));
}

bool in_root_pass() {
  return t_forward_thread || t_in_callback || torch::autograd::get_current_graph_task_id() != -1;
}

}  // namespace touch
}  // namespace fsdp
