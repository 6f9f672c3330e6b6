// State dicts in memory, by name, as PyTorch's FSDP gives them: full_state_dict (whole tensors,
// on every rank or rank 0 only) and sharded_state_dict (this rank's pieces with their offsets).
#include "fsdp/checkpoint.h"

#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "checkpoint/ignored_state.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/tensor_parallel_state.h"
#include "wrap/sharded_root.h"

namespace fsdp {

std::vector<std::pair<std::string, at::Tensor>> full_state_dict(FullyShardedDataParallelBase& model, bool rank0_only) {
  detail::ShardedRoot& root = detail::RootAccess::of(model);
  root.check_checkpointable("full_state_dict");
  check_replicated_agree(root, "full_state_dict");
  const bool keep = !rank0_only || writes_whole(root);
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> by_param;
  gather_units(
      root,
      shard_slice,
      [&](const Unit& u, const at::Tensor& full) {
        const FlatParamHandle& h = u.handle();
        for (size_t i = 0; i < h.layout().entries().size(); ++i) {
          // Under TP every rank that received the unit puts its parameters together (collective).
          const at::Tensor whole = whole_of(h, i, view_of_param(full, h.layout().entries()[i]));
          if (keep) {
            out.emplace_back(h.layout().entries()[i].fqn, split_placement(h, i) ? whole : whole.clone());
            by_param.emplace(h.params()[i].unsafeGetTensorImpl(), out.back().second);
          }
        }
      },
      rank0_only ? GatherTo::TO_RANK0 : GatherTo::TO_ALL);
  append_whole_ignored(root, out, keep, rank0_only ? GatherTo::TO_RANK0 : GatherTo::TO_ALL);
  if (keep) {
    // A tensor registered under several names (a tied weight, a module registered twice) is in
    // the state dict under each of them, the same tensor, as the module's own named_parameters()
    // lists it: a plain model loads it by any of its names.
    std::unordered_set<std::string> named;
    for (const auto& [name, t] : out) named.insert(name);
    for (const auto& p : root.module().named_parameters(true)) {
      auto it = by_param.find(p.value().unsafeGetTensorImpl());
      if (it != by_param.end() && !named.count(p.key())) out.emplace_back(p.key(), it->second);
    }

    for (const auto& b : root.module().named_buffers(true)) {
      if (b.value().defined()) out.emplace_back(b.key(), b.value().detach().clone());
    }
  }
  return out;
}

std::vector<std::pair<std::string, ShardedTensor>> sharded_state_dict(FullyShardedDataParallelBase& model) {
  detail::ShardedRoot& root = detail::RootAccess::of(model);
  root.check_checkpointable("sharded_state_dict");
  if (const TensorParallel* tp = tensor_parallel_of(root)) {
    throw std::invalid_argument("fsdp: sharded_state_dict of a model split for tensor parallelism (" +
                                std::to_string(tp->size()) + " ranks): a rank's piece of a split parameter is not one "
                                "range of the whole tensor; use full_state_dict");
  }
  std::vector<std::pair<std::string, ShardedTensor>> out;
  for (const StatePiece& p : collect_rank_state(root, nullptr).pieces) {
    out.emplace_back(p.key, ShardedTensor{p.shape, p.flat_begin, p.local});
  }
  return out;
}

}  // namespace fsdp
