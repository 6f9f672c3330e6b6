#include "wrap/tensor_parallel_summon.h"

#include <unordered_set>

#include "tensor_parallel/replica_agreement.h"

namespace fsdp::detail {

void TensorParallelSummon::begin(torch::nn::Module& module, bool held) {
  tp_.reset();
  if (!held) return;
  std::unordered_set<const c10::TensorImpl*> seen;  // a tied weight is one parameter
  try {
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      auto placement = tensor_parallel_placement(p);
      if (!placement || placement->tp->size() == 1) continue;
      at::NoGradGuard no_grad;
      tp_ = placement->tp;
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

std::string TensorParallelSummon::differing(torch::nn::Module& module) const {
  std::vector<std::string> names;
  std::vector<at::Tensor> values;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    names.push_back(item.key());
    values.push_back(item.value().detach());
  }
  const auto differ = differ_across_tensor_parallel(*tp_, values);
  return differ.empty() ? std::string() : names.at(differ.front());
}

bool TensorParallelSummon::verdicts_differ(bool verdict) const {
  return !differ_across_tensor_parallel(*tp_, {at::full({1}, verdict ? 1.0 : 0.0, at::kDouble)}).empty();
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
  swapped_.clear();  // tp_ stays: verdicts_differ() runs after end()
}

}  // namespace fsdp::detail
