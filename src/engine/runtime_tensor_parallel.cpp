// What the runtime checks for tensor parallelism (fsdp/tensor_parallel.h), so that a slip in a
// user's model is refused by name instead of training silently wrong:
//   - in forward, an operator that reaches a split parameter outside a tensor-parallel layer (fsdp's
//     column_parallel / row_parallel / vocab_parallel_embedding, or a TensorParallelLayerScope):
//     it would use this rank's part as if it were the whole. The tied head written
//     at::linear(h, emb->weight) gives local training's loss while every parameter before it gets
//     only this rank's share of its gradient;
//   - after every synchronized backward, that each replicated parameter's gradient agrees across
//     the TP group: every TP rank computes the same gradient for a replicated parameter unless it
//     was applied to split activations (a QK-norm over this rank's heads) without a
//     partial_gradient_rule, or the ranks' inputs differ. One checksum all-gather per backward.
#include <c10/core/GradMode.h>

#include "engine/runtime.h"
#include "fsdp/tensor_parallel.h"
#include "tensor_parallel/layer_scope.h"
#include "tensor_parallel/replica_agreement.h"

namespace fsdp {

void Runtime::check_split_use(size_t u, const c10::TensorImpl* tensor) {
  if (detail::in_tensor_parallel_layer() || touch::recomputing()) return;
  const auto i = units_[u]->param_of(tensor);
  if (!i || !tp_split_[u][*i]) return;
  throw Refusal("fsdp: an operator of the forward used parameter '" + units_[u]->handle().layout().entries()[*i].fqn +
                "', which is split for tensor parallelism (this rank holds its part), outside a tensor-parallel "
                "layer: it computes with the part as if it were the whole tensor, and the gradients of everything "
                "before it would be this rank's share only. Call it through fsdp::column_parallel / row_parallel / "
                "vocab_parallel_embedding (a tied head: column_parallel(h, embedding->weight)); in a layer of your "
                "own built from the region primitives, open an fsdp::TensorParallelLayerScope around its use.");
}

void Runtime::check_replicated_gradients() {
  const auto& tp = options_.tensor_parallel;
  if (!tp || tp->size() == 1) return;
  touch::Suppress own_work;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  std::vector<std::string> names;
  for (size_t u = 0; u < units_.size(); ++u) {
    // A unit an unshard() scope holds shows stand-ins (its gradients are checked when they are
    // restored, at the next synchronized backward); one left with no_sync sums holds partial ones.
    if (pinned(u) || units_[u]->reduction().form() != GradientReduction::Form::SHARDED) continue;
    const auto& params = units_[u]->handle().params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!tp_split_[u].empty() && tp_split_[u][i]) continue;
      grads.push_back(params[i].grad());
      names.push_back(units_[u]->handle().layout().entries()[i].fqn);
    }
  }
  const std::vector<size_t> differ = detail::differ_across_tensor_parallel(*tp, grads);
  if (differ.empty()) return;
  std::string list;
  for (size_t k = 0; k < differ.size() && k < 4; ++k) list += (k ? ", '" : "'") + names[differ[k]] + "'";
  if (differ.size() > 4) list += " and " + std::to_string(differ.size() - 4) + " more";
  throw Refusal("fsdp: after backward the gradient of replicated parameter(s) " + list + " differs across the " +
                std::to_string(tp->size()) + " tensor-parallel ranks (TP rank " + std::to_string(tp->rank()) +
                "), which must all compute the same whole gradient for a parameter every one of them holds whole; "
                "the optimizer step would let the replicas drift apart. Either such a parameter is applied to this "
                "rank's part of split activations (" +
                std::string(tp->sequence_parallel()
                                ? "under sequence parallelism: a norm or a row-parallel bias applied to this rank's "
                                  "chunk of the sequence; or "
                                : "") +
                "a QK-norm over its heads, a per-head scale, key/value "
                "projections replicated for fewer KV heads than TP ranks): name it in the plan with "
                "fsdp::partial_gradient_rule, and fsdp sums its gradient over the TP group; or a split parameter "
                "is used outside fsdp's tensor-parallel layers inside a TensorParallelLayerScope without the "
                "region primitives around it; or the TP ranks of a data-parallel group ran different inputs or "
                "dropout masks.");
}

}  // namespace fsdp
