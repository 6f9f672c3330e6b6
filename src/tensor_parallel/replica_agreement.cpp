#include "tensor_parallel/replica_agreement.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include <c10/core/GradMode.h>

#include "fsdp/tensor_parallel.h"

namespace fsdp::detail {

std::vector<size_t> differ_across_tensor_parallel(const TensorParallel& tp, const std::vector<at::Tensor>& tensors) {
  if (tp.size() == 1 || tensors.empty()) return {};
  at::NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(tensors.size());
  // [numel, sum, sum of squares] per tensor, computed where the tensors live and brought to the
  // host at once (one device sync).
  c10::Device device(c10::kCPU);
  for (const auto& t : tensors) {
    if (t.defined()) {
      device = t.device();
      break;
    }
  }
  std::vector<at::Tensor> rows;
  rows.reserve(tensors.size());
  for (const auto& t : tensors) {
    if (!t.defined() || t.numel() == 0) {
      rows.push_back(at::zeros({3}, at::TensorOptions().dtype(at::kDouble).device(device)));
      continue;
    }
    const at::Tensor x = t.detach().to(device, at::kDouble);
    rows.push_back(at::stack({at::scalar_tensor(static_cast<double>(t.numel()), x.options()), x.sum(), x.square().sum()}));
  }
  const at::Tensor mine = at::stack(rows).to(at::kCPU);  // [n, 3]
  // Every rank's rows, over the whole job: each rank then judges every TP group alike, so a group
  // that differs is refused on every rank, and none goes on alone to wait for it in a collective.
  const auto& world = tp.world()->world();
  at::Tensor all = at::empty({world->getSize() * mine.numel()}, mine.options());
  try {
    at::Tensor flat = mine.reshape({-1});
    auto work = world->_allgather_base(all, flat);
    if (!work->wait()) throw std::runtime_error("the work did not complete");
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error("fsdp: comparing checksums across the tensor-parallel groups failed on TP rank " +
                             std::to_string(tp.rank()) + ": " + what.substr(0, what.find('\n')));
  }
  const int groups = world->getSize() / tp.size();
  const at::Tensor by_rank = all.view({groups, tp.size(), n, 3});
  const auto a = by_rank.accessor<double, 4>();
  std::vector<size_t> differ;
  for (int64_t i = 0; i < n; ++i) {
    bool differs = false;
    for (int g = 0; g < groups && !differs; ++g) {
      for (int c = 0; c < 3 && !differs; ++c) {
        double hi = a[g][0][i][c];
        double lo = hi;
        bool finite = std::isfinite(hi);
        for (int r = 1; r < tp.size(); ++r) {
          hi = std::max(hi, a[g][r][i][c]);
          lo = std::min(lo, a[g][r][i][c]);
          finite = finite && std::isfinite(a[g][r][i][c]);
        }
        // Overflowed values (inf or NaN, an fp16 step the scaler will skip) are not compared;
        // fp64 sums of equal tensors agree to the last bits, a real difference is far larger.
        if (finite && hi - lo > 1e-9 * std::max(std::abs(hi), std::abs(lo))) differs = true;
      }
    }
    if (differs) differ.push_back(static_cast<size_t>(i));
  }
  return differ;
}

}  // namespace fsdp::detail
