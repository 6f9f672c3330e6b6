#include "tensor_parallel/replica_agreement.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include <c10/core/GradMode.h>

#include "fsdp/tensor_parallel.h"

namespace fsdp::detail {
namespace {
constexpr int kStats = 4;  // per tensor: numel, sum, sum of squares, a position-weighted sum
}  // namespace

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
      rows.push_back(at::zeros({kStats}, at::TensorOptions().dtype(at::kDouble).device(device)));
      continue;
    }
    const at::Tensor x = t.detach().to(device, at::kDouble).reshape({-1});
    // The weighted sum sees the order too (the same rows shuffled differently on each TP rank).
    const at::Tensor weights = at::arange(x.numel(), x.options()).remainder_(997.0).add_(1.0);
    rows.push_back(at::stack({at::scalar_tensor(static_cast<double>(t.numel()), x.options()), x.sum(), x.square().sum(),
                              x.mul(weights).sum()}));
  }
  const at::Tensor mine = at::stack(rows).to(at::kCPU);  // [n, kStats]
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
  const at::Tensor by_rank = all.view({groups, tp.size(), n, kStats});
  const auto a = by_rank.accessor<double, 4>();
  std::vector<size_t> differ;
  for (int64_t i = 0; i < n; ++i) {
    bool differs = false;
    for (int g = 0; g < groups && !differs; ++g) {
      for (int c = 0; c < kStats && !differs; ++c) {
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

void check_ids_across_tensor_parallel(const TensorParallel& tp, const at::Tensor& ids, int64_t limit,
                                      std::optional<int64_t> ignore, const std::string& what) {
  if (tp.size() == 1) return;
  at::NoGradGuard no_grad;
  const at::Tensor x = ids.detach().to(at::kCPU, at::kLong).reshape({-1});
  const at::Tensor counted = ignore ? x.masked_select(x.ne(*ignore)) : x;
  // [lowest, highest, sum, position-weighted sum, count]: int64 arithmetic, equal for equal ids.
  const at::Tensor weights = at::arange(x.numel(), x.options()).remainder_(997).add_(1);
  const bool any = counted.numel() > 0;
  at::Tensor mine = at::stack({any ? counted.min() : at::scalar_tensor(0, x.options()),
                               any ? counted.max() : at::scalar_tensor(0, x.options()), x.sum(), x.mul(weights).sum(),
                               at::scalar_tensor(x.numel(), x.options())});
  const auto& world = tp.world()->world();
  at::Tensor all = at::empty({world->getSize() * mine.numel()}, mine.options());
  try {
    auto work = world->_allgather_base(all, mine);
    if (!work->wait()) throw std::runtime_error("the work did not complete");
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    throw std::runtime_error("fsdp: comparing " + what + " across the tensor-parallel groups failed on TP rank " +
                             std::to_string(tp.rank()) + ": " + msg.substr(0, msg.find('\n')));
  }
  const int64_t ranks = world->getSize();
  const at::Tensor table = all.view({ranks, 5});
  const auto a = table.accessor<int64_t, 2>();
  for (int64_t r = 0; r < ranks; ++r) {
    if (a[r][0] >= 0 && a[r][1] < limit) continue;
    const int64_t bad = a[r][0] < 0 ? a[r][0] : a[r][1];
    throw std::invalid_argument("fsdp: " + what + " hold " + std::to_string(bad) + " on rank " + std::to_string(r) +
                                ", outside [0, " + std::to_string(limit) + ")" +
                                (ignore ? " (and not the ignore_index " + std::to_string(*ignore) + ")" : "") +
                                ": each indexes the whole table or class list, split over the TP ranks, so an id "
                                "outside it would silently be on no rank (a plain lookup raises 'index out of "
                                "range'). Check that the tokenizer's vocabulary matches the model's");
  }
  for (int64_t g = 0; g < ranks / tp.size(); ++g) {
    for (int64_t r = g * tp.size() + 1; r < (g + 1) * tp.size(); ++r) {
      if (a[r][2] == a[g * tp.size()][2] && a[r][3] == a[g * tp.size()][3] && a[r][4] == a[g * tp.size()][4]) continue;
      throw std::invalid_argument(
          "fsdp: the " + std::to_string(tp.size()) + " tensor-parallel ranks of data-parallel rank " + std::to_string(g) +
          " gave " + what + " different values (ranks " + std::to_string(g * tp.size()) + " and " + std::to_string(r) +
          "): the TP ranks of a data-parallel group compute one model on the same rows. Slice the global batch by "
          "the data-parallel rank and size (tp->data_parallel()->rank() of tp->data_parallel()->world_size()), not "
          "by the world rank, and draw anything random in the data (masks, label noise) from a generator seeded "
          "alike on the TP ranks");
    }
  }
}

}  // namespace fsdp::detail
