// What wrapping refuses a model for (sharded_root.h): a tensor-parallel model wrapped without its
// TensorParallel or over the wrong mesh, TP ranks that built different models, a model wrapped
// twice. Each would train wrong without an error; kept apart from the construction that calls them.
#include "wrap/sharded_root.h"

#include <set>
#include <stdexcept>

#include "fsdp/tensor_parallel.h"
#include "engine/param_key.h"
#include "tensor_parallel/replica_agreement.h"

namespace fsdp::detail {

void ShardedRoot::check_tensor_parallel() {
  // A model split by fsdp::parallelize holds parts that differ across its TP group: wrapped over
  // the world, fsdp would average different parameters together; without the group, clipping
  // would miss the other ranks' parts. Both would train wrong without an error.
  const auto& tp = options_.tensor_parallel;
  for (const auto& np : module_->named_parameters(true)) {
    const auto placement = tensor_parallel_placement(np.value());
    if (!placement || placement->tp->size() == 1) continue;
    if (!tp) {
      throw std::invalid_argument("fsdp: parameter '" + np.key() + "' is split for tensor parallelism "
                                  "(fsdp::parallelize) but Options::tensor_parallel is not set: set it to the "
                                  "TensorParallel the plan used and wrap over its data_parallel() mesh");
    }
    if (placement->tp != tp) {
      throw std::invalid_argument("fsdp: parameter '" + np.key() + "' is split over another TensorParallel than "
                                  "Options::tensor_parallel");
    }
  }
  for (const auto& np : module_->named_parameters(true)) {
    const auto partial = tensor_parallel_partial_gradient(np.value());
    if (!partial || partial->size() == 1) continue;
    if (partial != tp) {
      throw std::invalid_argument("fsdp: parameter '" + np.key() + "' is named by a partial_gradient_rule of a "
                                  "TensorParallel that is not Options::tensor_parallel: set Options::tensor_parallel "
                                  "to the TensorParallel the plan used");
    }
  }
  if (tp && tp->size() > 1 && mesh_ != tp->data_parallel()) {
    throw std::invalid_argument("fsdp: with Options::tensor_parallel of " + std::to_string(tp->size()) +
                                " ranks, wrap the model over tensor_parallel->data_parallel() (the " +
                                std::to_string(tp->data_parallel()->world_size()) + " data-parallel ranks), not " +
                                "a mesh of " + std::to_string(mesh_->world_size()));
  }
}

void ShardedRoot::check_tensor_parallel_replicas() {
  // Each TP rank keeps its part of the model it built: parts of models built from different seeds
  // (or with weights loaded on some ranks only) are no model at all, and sync_module_states cannot
  // mend that (it broadcasts whole tensors within the data-parallel mesh and the replicated ones
  // over the TP group, never a split one's parts). Ranks that built different models differ in
  // their replicated parameters too: compared here, after the data-parallel broadcast if any.
  const auto& tp = options_.tensor_parallel;
  if (!tp || tp->size() == 1) return;
  std::vector<at::Tensor> replicated;
  std::vector<std::string> names;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& np : module_->named_parameters(true)) {
    const at::Tensor& p = np.value();
    if (ignored_.count(p.unsafeGetTensorImpl()) || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    const auto placement = tensor_parallel_placement(p);
    if (placement && placement->tp->size() > 1) continue;
    replicated.push_back(p);
    names.push_back(np.key());
  }
  const auto differ = differ_across_tensor_parallel(*tp, replicated);
  if (differ.empty()) return;
  throw std::invalid_argument(
      "fsdp: the " + std::to_string(tp->size()) + " tensor-parallel ranks of this job built different models: "
      "replicated parameter '" + names[differ[0]] + "'" + (differ.size() > 1 ? " (and " + std::to_string(differ.size() - 1) +
      " more)" : "") + " differs across the TP group. Each TP rank keeps its part of the model it built, so every rank "
      "must build the model whole from the same seed (torch::manual_seed before constructing it) and load the same "
      "weights, before fsdp::parallelize; sync_module_states cannot join parts of different models into one.");
}

void ShardedRoot::check_not_wrapped_already() const {
  // A parameter another wrapper already points at its shard (or gathered copy) carries fsdp's key:
  // wrapping it again would flatten that wrapper's 1-D shards as if they were the parameters (its
  // ranks' shapes differ) or, with F = 1, take the parameters away from the first wrapper. Local
  // and alike on every rank: refused before any collective.
  for (const auto& np : module_->named_parameters(true)) {
    if (ignored_.count(np.value().unsafeGetTensorImpl()) || !param_key::has_key(np.value())) continue;
    throw std::invalid_argument(
        "fsdp: parameter '" + np.key() + "' already belongs to a FullyShardedDataParallel (it holds that wrapper's "
        "shard, even after the wrapper is gone): a model, or a module inside it, is wrapped once. Wrap the whole "
        "model once, and make the modules that should be units of their own units with fsdp::fully_shard(*module) "
        "or Options::auto_wrap_policy before wrapping it. To run it again, call the first wrapper's forward (under "
        "torch::NoGradGuard for inference); for a plain copy, take fsdp::full_state_dict or fsdp::export_full from "
        "the first wrapper and load it into a newly built model.");
  }
}

}  // namespace fsdp::detail
