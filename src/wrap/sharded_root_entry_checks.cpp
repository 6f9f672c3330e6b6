// What the entry points check on a wrapped model at each call (sharded_root.h): forward's inputs
// across the TP group and parameters registered since wrapping, and that a checkpoint is taken at
// rest. Per call, not once at wrapping (sharded_root_wrap_checks.cpp).
#include "wrap/sharded_root.h"

#include "tensor_parallel/replica_agreement.h"

namespace fsdp::detail {

void ShardedRoot::check_inputs(const std::vector<at::Tensor>& inputs) {
  const auto& tp = options_.tensor_parallel;
  // Every forward, not the first only: an evaluation forward on a shared batch may come first,
  // and the vocabulary-parallel lookup would hide the slip from every later check (its all-reduce
  // sums the TP ranks' different rows into one activation all of them hold).
  if (!checks_inputs_ || !tp) return;
  const auto differ = differ_across_tensor_parallel(*tp, inputs);
  if (!differ.empty()) {
    throw Refusal("fsdp: the " + std::to_string(tp->size()) + " tensor-parallel ranks of data-parallel rank " +
                  std::to_string(mesh_->rank()) + " gave forward different inputs (argument " +
                  std::to_string(differ[0] + 1) + "): the TP ranks of a data-parallel group compute one model on the "
                  "same rows. Slice the global batch by the data-parallel rank and size "
                  "(tp->data_parallel()->rank() of tp->data_parallel()->world_size()), not by the world rank, and "
                  "give every TP rank the same data order.");
  }
}

void ShardedRoot::check_no_new_parameters() const {
  // A parameter the model gained after wrapping (a registered adapter, a replaced layer) is in no
  // unit: never sharded, gathered or reduced, so every rank would train its own copy on its own
  // rows. Local and alike on every rank (the same model): refused before the forward's first
  // collective. One walk of the parameters per forward.
  for (const auto& np : module_->named_parameters(true)) {
    if (wrapped_params_.count(np.value().unsafeGetTensorImpl())) continue;
    throw Refusal("fsdp: parameter '" + np.key() + "' was registered after the model was wrapped (a submodule "
                  "registered or replaced since): it is in no unit, so every rank would train its own copy of it "
                  "on its own rows, never averaged. Register every submodule before wrapping the model (or wrap a new "
                  "model that has it), or take it away again (unregister_module) to go on; a module whose parameters "
                  "are yours to keep consistent goes in Options::ignored_modules, before wrapping.");
  }
}

void ShardedRoot::check_checkpointable(const char* what) {
  runtime_->check_not_failed();
  throw_pending_refusal();
  TORCH_CHECK(!summoned_, "fsdp: ", what, " cannot run inside a summon_full_params scope; end it first");
  TORCH_CHECK(runtime_->at_rest(), "fsdp: ", what, " must be called outside forward and backward, not between a "
                                   "forward and its backward");
}

}  // namespace fsdp::detail
