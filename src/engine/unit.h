// One FSDP unit's training state within an iteration (paper §3, §4.3), like FSDP2's
// FSDPParamGroup: its storage (FlatParamHandle), its gradient pipeline (GradientReduction), the
// spans it shows in the timeline and which of its gradients this backward will bring.
//
//   IDLE ──pre_forward──▶ FORWARD ──post_forward──▶ IDLE          (again for a unit used twice,
//                                                                  or for a second forward)
//   IDLE ──pre_backward──▶ PRE_BACKWARD ──post_backward──▶ POST_BACKWARD
//   any ──end_iteration──▶ IDLE
//
// PRE_BACKWARD: backward has reached the unit (its parameters are needed again, or a gradient of
// one of them is about to be accumulated). POST_BACKWARD: every gradient that forward made
// possible has been accumulated; its reduction is under way and it needs nothing more this
// iteration. When to gather, free and reduce is the runtime's decision (runtime.h); the unit
// records where it is.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>

#include "comm/comm_context.h"
#include "engine/flat_param_handle.h"
#include "engine/gradient_reduction.h"
#include "engine/unit_decomposition.h"

namespace fsdp {

class Unit {
 public:
  enum class State { IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD };

  Unit(int index, UnitPlan plan, CommContext& comm, const std::optional<MixedPrecision>& mixed_precision,
       std::optional<c10::Device> device);
  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  int index() const { return index_; }
  const std::string& name() const { return name_; }  // module path, "" for the root unit
  bool is_root() const { return is_root_; }
  State state() const { return state_; }
  FlatParamHandle& handle() { return handle_; }
  const FlatParamHandle& handle() const { return handle_; }
  GradientReduction& reduction() { return reduction_; }
  const GradientReduction& reduction() const { return reduction_; }
  // Whether `other`'s module is inside this unit's module (a unit nested in this one).
  bool contains(const Unit& other) const { return subtree_.count(other.module_) > 0; }

  void pre_forward();    // IDLE -> FORWARD
  void post_forward();   // FORWARD -> IDLE
  void pre_backward();   // IDLE -> PRE_BACKWARD (stashes the gradients the parameters hold)
  void post_backward();  // PRE_BACKWARD -> POST_BACKWARD
  // -> IDLE, bookkeeping cleared; `keep_expected`: a retained graph may be backwarded again and
  // will bring the same gradients.
  void end_iteration(bool keep_expected = false);

  // Forward touched `tensor` with grad mode on: if it is one of this unit's parameters that
  // requires grad, backward will accumulate its gradient, and the graph being built holds the
  // parameter's AccumulateGrad node (kept here weakly: while one lives, a backward can come).
  // Returns that node (null when `tensor` is not such a parameter).
  std::shared_ptr<torch::autograd::Node> expect_grad(const c10::TensorImpl* tensor);
  // Which of the unit's parameters `tensor` is (the parameter itself, not a view of it).
  std::optional<size_t> param_of(const c10::TensorImpl* tensor) const;
  bool graph_alive() const;
  // Whether no parameter of the unit requires grad now: backward passes through it (for its
  // inputs' gradients) without bringing it any.
  bool frozen() const;
  // The nodes noted since the last call (a retained graph's outlive its iteration).
  std::vector<std::weak_ptr<torch::autograd::Node>> take_graph_refs();
  // A gradient was accumulated into parameter `param`. True when it was the last one expected:
  // the unit's backward is complete.
  bool grad_accumulated(size_t param);
  // An operator call touching this unit entered fsdp (counted into the open compute span).
  void count_operator() { ++span_operators_; }

 private:
  void transition(State from, State to, const char* what);

  int index_;
  std::string name_;
  bool is_root_;
  const torch::nn::Module* module_;
  std::unordered_set<const torch::nn::Module*> subtree_;
  CommContext& comm_;
  FlatParamHandle handle_;
  GradientReduction reduction_;
  State state_ = State::IDLE;
  std::optional<size_t> span_;  // the open forward or backward compute span
  int64_t span_operators_ = 0;  // operator calls that entered fsdp for this unit since it opened
  std::unordered_map<const c10::TensorImpl*, size_t> param_index_;
  std::vector<bool> expected_;  // per parameter: forward used it with grad mode on
  int expected_count_ = 0, ready_count_ = 0;
  // AccumulateGrad nodes of graphs built through this unit (a parameter can have several: libtorch
  // makes a new one when set_data changes its dtype, as mixed precision does).
  std::vector<std::weak_ptr<torch::autograd::Node>> graph_refs_;
};

}  // namespace fsdp
