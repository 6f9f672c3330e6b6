// The runtime's checks (runtime.h): what keeps a loop from going silently wrong. Failures recorded
// where libtorch would swallow them and rethrown where they reach the caller; whether a graph can
// still be backwarded; parameters replaced behind fsdp's back; operators reaching a guarded
// parameter from outside the root's passes (param_guard.h); and the end-of-backward comparison of
// the collectives every rank issued.
#include <stdexcept>

#include "engine/runtime.h"

namespace fsdp {

void Runtime::on_guarded_op(const c10::OperatorHandle& op, size_t u, const at::Tensor& tensor, bool writes) {
  ++detection_.operator_calls_at_rest;
  if (!units_[u]->handle().guarded()) return;  // F = 1 at rest: whole parameters, nothing to check
  touch::Suppress own_work;  // our own set_data and copies below must not come back here
  check_not_failed();
  const FlatParamHandle& h = units_[u]->handle();
  const size_t param = h.param_at(tensor);
  const std::string& fqn = h.layout().entries()[param].fqn;
  const auto& name = op.operator_name().name;
  if (phase_ == Phase::FORWARD_DONE) {
    if (!graph_alive()) {
      end_iteration();  // the forwards since the last backward were abandoned: back to the shards
    } else if (writes) {
      throw std::invalid_argument(
          "fsdp: " + name + " writes parameter '" + fqn + "' while it is gathered for a backward that has not run "
          "yet (a forward's output, or a graph built from it, is still alive). Run backward first, or drop the outputs "
          "of forwards you will not backward (or run them under torch::NoGradGuard), then step.");
    }
  }
  if (h.state() == HandleState::SHARDED && comm_.mesh().shard_size > 1 && guard::consumes_module_shape(op.operator_name())) {
    throw std::invalid_argument(
        "fsdp: " + name + " was called on parameter '" + fqn + "' outside the root's forward, where it holds only "
        "this rank's 1-D shard (" + std::to_string(h.slices()[param].length) + " of " +
        std::to_string(h.layout().entries()[param].numel) + " elements). Call the model through "
        "FullyShardedDataParallel::forward() or forward_with() so that its units are gathered, or read whole "
        "parameters inside summon_full_params() (evaluation, inspection, export).");
  }
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

bool Runtime::graph_alive() const {
  for (const Unit* unit : units_) {
    if (unit->graph_alive()) return true;
  }
  return false;
}

bool Runtime::at_rest() {
  if (phase_ == Phase::FORWARD_DONE && !graph_alive()) end_iteration();
  return phase_ == Phase::IDLE;
}

void Runtime::check_parameters_intact() const {
  if (summoned_) return;
  for (const Unit* unit : units_) {
    const FlatParamHandle& h = unit->handle();
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

void Runtime::check_sequence() {
  if (comm_.mesh().world_size == 1) return;
  const int64_t t0 = Timeline::now_ns();
  const auto h = static_cast<int64_t>(comm_.take_sequence_hash() & ((1ULL << 62) - 1));
  // max(h) and max(-h) in one all-reduce: every rank's h is equal exactly when they cancel.
  at::Tensor t = at::tensor({h, -h}, at::kLong);
  InFlight f = comm_.issue(CommKind::SEQUENCE_CHECK, Over::WORLD, -1, "the collective sequence check",
                           [&] { return Buffers{t, at::Tensor()}; });
  comm_.wait(f);
  overlap_.sequence_check_ns += Timeline::now_ns() - t0;
  if (t[0].item<int64_t>() + t[1].item<int64_t>() == 0) return;
  // Rare: find who differs (one more small collective, on this path only).
  at::Tensor all = at::empty({comm_.mesh().world_size}, at::kLong);
  at::Tensor mine = at::tensor({h}, at::kLong);
  wait_for(comm_.mesh().world_group->_allgather_base(all, mine), "all-gather of sequence hashes");
  std::string differ;
  for (int r = 1; r < comm_.mesh().world_size; ++r) {
    if (all[r].item<int64_t>() != all[0].item<int64_t>()) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  }
  failure_ = "fsdp: the ranks issued different collectives in this iteration (rank(s) " + differ +
             " differ from rank 0; this is rank " + std::to_string(comm_.mesh().rank) +
             "): their control flow differs (a branch or unit taken on some ranks only, a different number of "
             "forwards or backwards) or they were given different options. Every rank must run the same forwards "
             "and backwards of the same model; this step's gradients must not be used.";
  throw std::runtime_error(failure_);
}

}  // namespace fsdp
