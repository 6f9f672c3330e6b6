#include "wrap/tensor_parallel_summon.h"

#include <unordered_set>

namespace fsdp::detail {

void TensorParallelSummon::begin(torch::nn::Module& module, bool held) {
  if (!held) return;
  std::unordered_set<const c10::TensorImpl*> seen;  // a tied weight is one parameter
  try {
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      auto placement = tensor_parallel_placement(p);
      if (!placement || placement->tp->size() == 1) continue;
      at::NoGradGuard no_grad;
      Swapped s{p, p.data(), {}, *placement};
      s.whole = tensor_parallel_whole(s.view, *placement);
      at::Tensor param = p;
      param.set_data(s.whole);
      swapped_.push_back(std::move(s));
    }
  } catch (...) {
    end(/*writeback=*/false);
    throw;
  }
}

void TensorParallelSummon::end(bool writeback) noexcept {
  for (auto& s : swapped_) {
    try {
      at::NoGradGuard no_grad;
      if (writeback) {
        s.view.copy_(tensor_parallel_part(s.whole, s.placement.shard, s.placement.tp->rank(), s.placement.tp->size()));
      }
    } catch (...) {
      // The whole tensor's shape changed inside the scope (set_data of another shape): nothing of
      // it is written back; the view keeps the values it had.
    }
    at::Tensor param = s.param;
    param.set_data(s.view);
  }
  swapped_.clear();
}

}  // namespace fsdp::detail
