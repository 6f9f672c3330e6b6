// The runtime's checks (runtime.h): what keeps a loop from going silently wrong. Failures recorded
// where libtorch would swallow them and rethrown where they reach the caller; whether a graph can
// still be backwarded; parameters replaced behind fsdp's back; operators reaching a guarded
// parameter from outside the root's passes (param_guard.h); and the end-of-backward comparison of
// the collectives every rank issued.
#include <algorithm>
#include <stdexcept>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include "engine/runtime.h"

namespace fsdp {

std::string Runtime::on_guarded_op(const c10::OperatorHandle& op, size_t u, const at::Tensor& tensor, bool writes) {
  ++detection_.operator_calls_at_rest;
  const FlatParamHandle& h = units_[u]->handle();
  const auto& name = op.operator_name().name;
  if (writes && units_[u]->reduction().holds_unreduced_no_sync()) {
    // An optimizer's first write (AdamW's weight decay), before it could change anything.
    touch::Suppress own_work;
    throw Refusal("fsdp: " + name + " writes parameter '" + h.layout().entries()[h.param_at(tensor)].fqn +
                  "' while its unit holds the unreduced gradients of no_sync backwards (each rank its own sum: "
                  "stepping now would move the replicas apart). Run the synchronized backward (outside no_sync()) "
                  "before clip_grad_norm_ and the optimizer step, or call zero_grad() to drop what was accumulated.");
  }
  if (writes && pinned(u) && h.has_unsharded_buffer()) {
    touch::Suppress own_work;
    throw Refusal("fsdp: " + name + " writes parameter '" + h.layout().entries()[h.param_at(tensor)].fqn +
                  "' inside an unshard() scope, where it holds the gathered copy (the optimizer steps this rank's "
                  "shard). End the unshard() scope before the optimizer step.");
  }
  if (!h.guarded() && !points_at_freed_gathered(h, tensor)) return "";  // F = 1 at rest: whole parameters
  touch::Suppress own_work;  // our own set_data and copies below must not come back here
  check_not_failed();
  const size_t param = h.param_at(tensor);
  const std::string& fqn = h.layout().entries()[param].fqn;
  std::string if_it_fails;
  if (phase_ == Phase::FORWARD_DONE) {
    const std::string pending =
        "while it is gathered for a backward that has not run yet (a forward's output, or a graph built from it, is "
        "still alive). Run backward first, or drop the outputs of forwards you will not backward (or run them under "
        "torch::NoGradGuard), then step.";
    if (!graph_alive()) {
      end_iteration();  // the forwards since the last backward were abandoned: back to the shards
    } else if (writes) {
      throw std::invalid_argument("fsdp: " + name + " writes parameter '" + fqn + "' " + pending);
    } else if (h.state() != HandleState::SHARDED && makes_a_tensor_like(name)) {
      // An optimizer's first step creates its state like the parameter (Adam's moments, RMSprop's
      // average): shaped like the gathered whole now, it would break every later step, which meets
      // this rank's shard.
      throw std::invalid_argument("fsdp: " + name + " makes a tensor shaped like parameter '" + fqn + "', which "
                                  "holds the whole parameter now, not this rank's shard that its gradient and an "
                                  "optimizer's state belong to, " + pending);
    } else if (h.state() != HandleState::SHARDED) {
      // Reading the whole parameter is legal (a look at the weights); an optimizer that reads it
      // first (weight decay, Adam's moments) meets the gradient's shard and fails in ATen.
      if_it_fails = "fsdp: " + name + " failed on parameter '" + fqn + "', which holds the whole parameter, not this "
                    "rank's shard that its gradient and the optimizer's state belong to, " + pending;
    }
  }
  if (points_at_freed_gathered(h, tensor)) {
    // A shallow copy of the parameter (p.data(), which libtorch's SGD takes for its weight decay
    // and update) made while its unit was gathered, reaching an operator after the unit went back
    // to its shard: just now (the forward above was abandoned) or at its backward. It aliases the
    // parameter, as it would in local training, so it follows it to the shard.
    const FlatParamEntry& entry = h.layout().entries()[param];
    if (tensor.sizes() != c10::IntArrayRef(entry.shape) ||
        tensor.storage_offset() != h.unsharded().storage_offset() + entry.offset) {
      throw Refusal("fsdp: " + name + " reads a view of parameter '" + fqn + "' taken while its unit was gathered "
                    "for a forward, after the unit went back to this rank's shard (its backward ran, or the forward's "
                    "output was dropped): the gathered copy it viewed is freed. Take views of parameters after the "
                    "step, or inside summon_full_params() for whole values.");
    }
    tensor.set_data(h.params()[param]);
  }
  if (h.state() == HandleState::SHARDED && comm_.mesh().shard_size > 1 && name == "aten::clone" &&
      tensor.unsafeGetTensorImpl() == h.params()[param].unsafeGetTensorImpl()) {
    // The parameter itself, as libtorch's Module::clone() copies each (an EMA or a teacher model):
    // the copy would be a model of 1-D shards, failing in its first forward with a shape error.
    throw Refusal(
        "fsdp: clone of parameter '" + fqn + "' outside forward, where it holds this rank's 1-D shard (" +
        std::to_string(h.slices()[param].length) + " of " + std::to_string(h.layout().entries()[param].numel) +
        " elements): a Module::clone() of the wrapped model, or a copy of this parameter, would hold shards, not "
        "the model. Clone inside summon_full_params() to copy whole parameters (an EMA or a teacher model); to copy "
        "this rank's shard itself, clone a view of it (p.detach().clone()).");
  }
  if (h.state() == HandleState::SHARDED && comm_.mesh().shard_size > 1 && guard::consumes_module_shape(op.operator_name())) {
    throw std::invalid_argument(
        "fsdp: " + name + " was called on parameter '" + fqn + "' outside the root's forward, where it holds only "
        "this rank's 1-D shard (" + std::to_string(h.slices()[param].length) + " of " +
        std::to_string(h.layout().entries()[param].numel) + " elements). Call the model through "
        "FullyShardedDataParallel::forward() or forward_with() so that its units are gathered, or read whole "
        "parameters inside summon_full_params() (evaluation, inspection, export).");
  }
  return if_it_fails;
}

void Runtime::on_unreduced_grad_op(const c10::OperatorHandle& op, size_t u, bool writes) {
  ++detection_.operator_calls_at_rest;
  if (units_[u]->reduction().held()) {
    const std::string& name = op.operator_name().name;
    // Detaching is how both zero_grads start (the optimizer's detach_(), the module's detach() before
    // it resets the gradient to None); zeroing the stand-in in place is refused below.
    if (name == "aten::detach_" || name == "aten::detach") return;
    touch::Suppress own_work;
    throw Refusal("fsdp: " + name + (writes ? " writes" : " reads") + " a gradient of unit '" +
                  comm_.unit_name(static_cast<int>(u)) + "' inside an unshard() scope, which holds the unit's "
                  "reduced gradients until it ends (the parameters hold whole values, not the shards the gradients "
                  "belong to): an optimizer step or a clip here would skip them. End the unshard() scope before "
                  "clip_grad_norm_ and the optimizer step; zero_grad() to None inside the scope drops them, as in "
                  "local training.");
  }
  if (writes) return;  // zero_grad's detach_() and zero_(): clearing them is what the loop should do
  throw Refusal("fsdp: " + op.operator_name().name + " reads a gradient of unit '" + comm_.unit_name(static_cast<int>(u)) +
                "' that holds the unreduced sum of no_sync backwards (this rank's own, in the whole parameter's "
                "shape): clipping or stepping with it would move the replicas apart. Run the synchronized backward "
                "(outside no_sync()) first, or call zero_grad() to drop what was accumulated.");
}

void Runtime::check_no_unreduced_gradients(const char* what) const {
  for (const Unit* unit : units_) {
    if (unit->reduction().held()) {
      throw Refusal(std::string("fsdp: ") + what + " inside an unshard() scope after a backward: unit '" +
                    comm_.unit_name(unit->index()) + "' holds its reduced gradients until the scope ends. End the "
                    "unshard() scope before clip_grad_norm_ and the optimizer step.");
    }
    if (!unit->reduction().holds_unreduced_no_sync()) continue;
    throw Refusal(std::string("fsdp: ") + what + " after no_sync backwards whose gradients are not reduced yet (unit '" +
                  comm_.unit_name(unit->index()) + "' holds this rank's own sum): the result would differ across "
                  "ranks. Run the synchronized backward (outside no_sync()) first, or call zero_grad() to drop what "
                  "was accumulated.");
  }
}

std::string Runtime::grad_of_parameters() const {
  const auto* exec = torch::autograd::get_current_graph_task_exec_info();
  if (exec == nullptr || exec->empty()) return "";  // backward() of everything
  // The captured AccumulateGrad nodes, by the tensor they accumulate into: a parameter can have
  // several (libtorch makes a new one when set_data changes its dtype, as mixed precision does).
  for (const auto& [node, info] : *exec) {
    if (!info.captures_ || info.captures_->empty()) continue;
    const auto* accumulate = dynamic_cast<const torch::autograd::AccumulateGrad*>(node);
    if (accumulate == nullptr) continue;
    for (const Unit* unit : units_) {
      const auto& params = unit->handle().params();
      for (size_t i = 0; i < params.size(); ++i) {
        if (accumulate->variable.unsafeGetTensorImpl() != params[i].unsafeGetTensorImpl()) continue;
        return "fsdp: torch::autograd::grad was asked for the gradient of parameter '" +
               unit->handle().layout().entries()[i].fqn + "': under fsdp it would return this rank's unreduced "
               "gradient of the whole parameter, not the reduced shard the parameter holds (assigning it to .grad "
               "fails, using it moves the replicas apart). Call backward() (or backward with inputs = the "
               "parameters) and read each parameter's .grad, which holds its reduced shard; torch::autograd::grad "
               "with respect to inputs and activations works as usual.";
      }
    }
  }
  return "";
}

void Runtime::check_not_failed() const {
  if (!failure_.empty()) throw std::runtime_error(failure_);
}

void Runtime::fail(const std::string& what, size_t unit) {
  if (failure_.empty()) {
    failure_ = what;
    if (failure_.rfind("fsdp:", 0) != 0) failure_ = "fsdp: unit '" + comm_.unit_name(static_cast<int>(unit)) + "': " + failure_;
  }
  units_[unit]->handle().poison();
}

bool Runtime::makes_a_tensor_like(const std::string& op_name) {
  return op_name == "aten::zeros_like" || op_name == "aten::empty_like" || op_name == "aten::ones_like" ||
         op_name == "aten::full_like";
}

bool Runtime::points_at_freed_gathered(const FlatParamHandle& h, const at::Tensor& tensor) {
  return h.state() == HandleState::SHARDED && h.has_unsharded_buffer() && tensor.has_storage() &&
         tensor.storage().unsafeGetStorageImpl() == h.unsharded_storage();
}

bool Runtime::graph_alive() const {
  // The forwards' own nodes where they are known: the key's fallback notes them (not the
  // RECORD_FUNCTION detection), and a checkpointed forward builds its nodes only in backward.
  // The parameters' AccumulateGrad nodes below are alive as long as any graph through them is,
  // one already backwarded too (a loss still in scope).
  if (!forward_nodes_.empty() && !forward_checkpointed_) {
    return std::any_of(forward_nodes_.begin(), forward_nodes_.end(), [](const auto& n) { return !n.expired(); });
  }
  for (const Unit* unit : units_) {
    if (unit->graph_alive()) return true;
  }
  return false;
}

void Runtime::end_abandoned_forward() {
  if (phase_ != Phase::FORWARD_DONE) return;
  // Nodes of a graph whose losses are gone can still be held by tasks a backward that threw left
  // in this thread's ready queue (runtime.h, drain_ready_queue): another model's backward, which
  // this one never took part in (a GAN's discriminator threw before the generator was reached).
  // Outside any backward, a drain drops them; a graph that is really alive stays alive.
  if (graph_alive() && torch::autograd::get_current_graph_task_id() == -1) drain_ready_queue();
  if (!graph_alive()) end_iteration();
}

bool Runtime::at_rest() {
  end_abandoned_forward();
  return phase_ == Phase::IDLE;
}

void Runtime::check_parameters_intact() const {
  if (summoned_) return;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (pinned(u)) continue;  // an unshard() scope holds it gathered
    const FlatParamHandle& h = units_[u]->handle();
    const auto& params = h.params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].has_storage() && params[i].storage().unsafeGetStorageImpl() == h.shard_storage() &&
          params[i].scalar_type() == h.dtypes().master) {
        continue;
      }
      throw std::invalid_argument(
          "fsdp: parameter '" + h.layout().entries()[i].fqn + "' no longer holds this rank's shard (now " +
          std::string(c10::toString(params[i].scalar_type())) + " on " + params[i].device().str() +
          "): it was replaced after wrapping (model->to(), set_data() or a load into it). Move or cast the model "
          "before wrapping it (or set Options::init_device), and change parameter values in place or inside "
          "summon_full_params().");
    }
  }
}

void Runtime::check_unit_intact_for_backward(size_t u) const {
  if (summoned_ || pinned(u)) return;
  const FlatParamHandle& h = units_[u]->handle();
  // Where the parameters must point now: the gathered buffer once the unit is unsharded (unless it
  // has none: F = 1 computes on the shard), else the shard (a gather in flight has not moved them).
  const c10::StorageImpl* expected =
      h.state() == HandleState::UNSHARDED && h.has_unsharded_buffer() ? h.unsharded_storage() : h.shard_storage();
  const auto& params = h.params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].has_storage() && params[i].storage().unsafeGetStorageImpl() == expected) continue;
    throw Refusal("fsdp: parameter '" + h.layout().entries()[i].fqn +
                  "' was replaced (set_data() or a load into it) between the forward and its backward: the graph "
                  "saved the values forward used, and fsdp's shard no longer backs the parameter, so backward "
                  "would accumulate into a tensor the optimizer never steps. Change parameters before the "
                  "forward or after the optimizer step, in place, or inside summon_full_params().");
  }
}

void Runtime::check_sequence() {
  // Which parameters got a gradient in this backward (GradientReduction::settle): compared in the
  // same all-reduce as the collectives' hash, so that it costs nothing when the ranks agree.
  std::vector<int64_t> present;
  for (Unit* unit : units_) unit->reduction().presence(present);
  const auto settle = [&](const int64_t* any) {
    size_t offset = 0;
    for (Unit* unit : units_) {
      unit->reduction().settle(any == nullptr ? nullptr : any + offset);
      offset += unit->handle().params().size();
    }
  };
  if (comm_.mesh().world_size == 1) {
    settle(nullptr);
    return;
  }
  const int64_t t0 = Timeline::now_ns();
  constexpr uint64_t kMask = (1ULL << 62) - 1;
  const uint64_t seq = comm_.take_sequence_hash() & kMask;
  uint64_t g = 1469598103934665603ULL;  // FNV-1a over the flags
  for (int64_t f : present) g = (g ^ static_cast<uint64_t>(f + 1)) * 1099511628211ULL;
  g &= kMask;
  const auto h = static_cast<int64_t>(seq ^ g);
  // max(h) and max(-h) in one all-reduce: every rank's h is equal exactly when they cancel.
  at::Tensor t = at::tensor({h, -h}, at::kLong);
  InFlight f = comm_.issue(CommKind::SEQUENCE_CHECK, Over::WORLD, -1, "the collective sequence check",
                           [&] { return Buffers{t, at::Tensor()}; });
  comm_.wait(f);
  overlap_.sequence_check_ns += Timeline::now_ns() - t0;
  if (t[0].item<int64_t>() + t[1].item<int64_t>() == 0) {
    settle(nullptr);
    return;
  }
  // Rare: find who differs, and in what (one more small collective, on this path only).
  const int W = comm_.mesh().world_size;
  at::Tensor all = at::empty({W * 2}, at::kLong);
  at::Tensor mine = at::tensor({static_cast<int64_t>(seq), static_cast<int64_t>(g)}, at::kLong);
  wait_for(comm_.mesh().world_group->_allgather_base(all, mine), "all-gather of sequence hashes");
  std::string differ;
  for (int r = 1; r < W; ++r) {
    if (all[2 * r].item<int64_t>() != all[0].item<int64_t>()) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  }
  if (differ.empty()) {
    // The same collectives, but not the same parameters got gradients: the ranks used different
    // parameters of a unit (each its own expert). Every rank's reduced shards hold the others'
    // contributions; a parameter has a gradient when any rank gave it one, as in local training
    // over the whole batch.
    at::Tensor any = at::tensor(present, at::kLong);
    InFlight flags = comm_.issue(CommKind::SEQUENCE_CHECK, Over::WORLD, -1, "which parameters got gradients",
                                 [&] { return Buffers{any, at::Tensor()}; });
    comm_.wait(flags);
    settle(any.data_ptr<int64_t>());
    return;
  }
  settle(nullptr);
  failure_ = "fsdp: the ranks issued different collectives in this iteration (rank(s) " + differ +
             " differ from rank 0; this is rank " + std::to_string(comm_.mesh().rank) +
             "): their control flow differs (a branch or unit taken on some ranks only, a different number of "
             "forwards or backwards) or they were given different options. Every rank must run the same forwards "
             "and backwards of the same model; this step's gradients must not be used.";
  throw std::runtime_error(failure_);
}

}  // namespace fsdp
