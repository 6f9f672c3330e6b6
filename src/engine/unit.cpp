#include "engine/unit.h"

#include <torch/csrc/autograd/variable.h>

namespace fsdp {
namespace {
const char* name_of(Unit::State s) {
  switch (s) {
    case Unit::State::IDLE: return "IDLE";
    case Unit::State::FORWARD: return "FORWARD";
    case Unit::State::PRE_BACKWARD: return "PRE_BACKWARD";
    case Unit::State::POST_BACKWARD: return "POST_BACKWARD";
  }
  return "?";
}
}  // namespace

Unit::Unit(int index, UnitPlan plan, CommContext& comm, const std::optional<MixedPrecision>& mixed_precision,
           std::optional<c10::Device> device)
    : index_(index),
      name_(plan.name),
      is_root_(plan.is_root),
      module_(plan.module),
      subtree_(std::move(plan.subtree)),
      comm_(comm),
      handle_(index, plan.fqns, plan.params, comm, mixed_precision, device),
      reduction_(index, handle_, comm) {
  for (size_t i = 0; i < handle_.params().size(); ++i) {
    param_index_.emplace(handle_.params()[i].unsafeGetTensorImpl(), i);
  }
  expected_.assign(handle_.params().size(), false);
}

void Unit::transition(State from, State to, const char* what) {
  TORCH_INTERNAL_ASSERT(state_ == from, "fsdp: unit '", name_, "' ", what, " in state ", name_of(state_),
                        " (expected ", name_of(from), ")");
  state_ = to;
}

void Unit::pre_forward() {
  transition(State::IDLE, State::FORWARD, "pre_forward");
  span_ = comm_.timeline().begin(SpanKind::FORWARD, index_, false);
  span_operators_ = 0;
}

void Unit::post_forward() {
  transition(State::FORWARD, State::IDLE, "post_forward");
  if (span_) comm_.timeline().end(*span_, span_operators_);
  span_.reset();
}

void Unit::pre_backward() {
  transition(State::IDLE, State::PRE_BACKWARD, "pre_backward");
  span_ = comm_.timeline().begin(SpanKind::BACKWARD, index_, true);
  span_operators_ = 0;
  // Here, not at forward: whatever the user did to the gradients since (zero_grad) counts.
  reduction_.stash();
}

void Unit::post_backward() {
  transition(State::PRE_BACKWARD, State::POST_BACKWARD, "post_backward");
  if (span_) comm_.timeline().end(*span_, span_operators_);
  span_.reset();
}

void Unit::end_iteration(bool keep_expected) {
  if (span_) comm_.timeline().end(*span_, span_operators_);
  span_.reset();
  state_ = State::IDLE;
  ready_count_ = 0;
  if (keep_expected) return;
  std::fill(expected_.begin(), expected_.end(), false);
  expected_count_ = 0;
}

std::shared_ptr<torch::autograd::Node> Unit::expect_grad(const c10::TensorImpl* tensor) {
  auto it = param_index_.find(tensor);
  if (it == param_index_.end()) return nullptr;
  const size_t i = it->second;
  const at::Tensor& p = handle_.params()[i];
  if (!p.requires_grad()) return nullptr;
  if (!expected_[i]) {
    expected_[i] = true;
    ++expected_count_;
  }
  // The node the operator being recorded will point its graph at (made now if need be: autograd
  // would make the same one a moment later).
  const std::shared_ptr<torch::autograd::Node> node = torch::autograd::impl::grad_accumulator(p);
  for (const auto& ref : graph_refs_) {
    if (!ref.owner_before(node) && !node.owner_before(ref)) return node;  // already noted
  }
  graph_refs_.emplace_back(node);
  return node;
}

std::optional<size_t> Unit::param_of(const c10::TensorImpl* tensor) const {
  auto it = param_index_.find(tensor);
  if (it == param_index_.end()) return std::nullopt;
  return it->second;
}

bool Unit::frozen() const {
  for (const auto& p : handle_.params()) {
    if (p.requires_grad()) return false;
  }
  return true;
}

bool Unit::graph_alive() const {
  for (const auto& ref : graph_refs_) {
    if (!ref.expired()) return true;
  }
  return false;
}

std::vector<std::weak_ptr<torch::autograd::Node>> Unit::take_graph_refs() {
  auto refs = std::move(graph_refs_);
  graph_refs_.clear();
  return refs;
}

bool Unit::grad_accumulated(size_t param) {
  if (!expected_[param]) return false;
  return ++ready_count_ == expected_count_;
}

}  // namespace fsdp

