#include "tensor_parallel/group_ops.h"

#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/tensor_parallel.h"

namespace fsdp::detail {
namespace {

std::mutex keys_mutex;
// The TensorParallel lives as long as any placement names it; a weak entry never keeps it alive.
std::vector<std::weak_ptr<TensorParallel>>& keys() {
  static std::vector<std::weak_ptr<TensorParallel>> k;
  return k;
}

// Runs a collective and waits; an exception becomes one line naming what and where.
template <typename Issue>
void run(const TensorParallel& tp, const char* op, const char* what, Issue issue) {
  try {
    auto work = issue();
    if (!work->wait()) throw std::runtime_error("the work did not complete");
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("fsdp: the tensor-parallel ") + op + " of " + what + " failed on TP rank " +
                             std::to_string(tp.rank()) + " of " + std::to_string(tp.size()) + ": " +
                             std::string(e.what()).substr(0, std::string(e.what()).find('\n')));
  }
}

}  // namespace

int64_t key_of(const std::shared_ptr<TensorParallel>& tp) {
  std::lock_guard<std::mutex> lock(keys_mutex);
  auto& k = keys();
  for (size_t i = 0; i < k.size(); ++i)
    if (k[i].lock() == tp) return static_cast<int64_t>(i);
  k.push_back(tp);
  return static_cast<int64_t>(k.size() - 1);
}

std::shared_ptr<TensorParallel> by_key(int64_t key) {
  std::lock_guard<std::mutex> lock(keys_mutex);
  auto tp = keys().at(static_cast<size_t>(key)).lock();
  if (!tp) throw std::runtime_error("fsdp: a tensor-parallel layer's group ended before its backward");
  return tp;
}

void all_reduce_(at::Tensor& t, c10d::ReduceOp op, const TensorParallel& tp, const char* what) {
  run(tp, "all-reduce", what, [&]() {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    return tp.group(t.device().type())->allreduce(v, o);
  });
}

at::Tensor all_gather_along(const at::Tensor& x, int64_t dim, const TensorParallel& tp, const char* what) {
  at::Tensor mine = x.contiguous();
  // The parts stacked along dimension 0 as the collective lays them out (Gloo's all-gather compares
  // each part's shape with the input's, so a flat buffer is refused for inputs of more than one
  // dimension), then, for another dimension, put side by side along it in one copy, made here
  // while the gathered buffer dies with this call: the operator after it (a matmul, forward or
  // backward, folds only a contiguous input) would copy it again, and both would live together.
  std::vector<int64_t> stacked = mine.sizes().vec();
  stacked[0] *= tp.size();
  at::Tensor all = at::empty(stacked, mine.options());
  run(tp, "all-gather", what, [&]() { return tp.group(mine.device().type())->_allgather_base(all, mine); });
  if (dim == 0) return all;
  std::vector<int64_t> parts = {tp.size()};
  parts.insert(parts.end(), mine.sizes().begin(), mine.sizes().end());
  std::vector<int64_t> whole = mine.sizes().vec();
  whole[static_cast<size_t>(dim)] *= tp.size();
  return all.view(parts).movedim(0, dim).reshape(whole).contiguous();
}

at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, const TensorParallel& tp, const char* what) {
  if (x.size(dim) % tp.size() != 0) {
    throw std::invalid_argument(std::string("fsdp: the tensor-parallel reduce-scatter of ") + what + ": dimension " +
                                std::to_string(dim) + " holds " + std::to_string(x.size(dim)) +
                                ", which does not split into " + std::to_string(tp.size()) + " equal parts");
  }
  at::Tensor moved = x.movedim(dim, 0).contiguous();
  std::vector<int64_t> shape = moved.sizes().vec();
  shape[0] /= tp.size();
  at::Tensor mine = at::empty(shape, moved.options());
  run(tp, "reduce-scatter", what, [&]() {
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    return tp.group(moved.device().type())->_reduce_scatter_base(mine, moved, o);
  });
  return mine.movedim(0, dim);
}

std::optional<TensorParallelPlacement> active(const at::Tensor& weight) {
  auto placement = tensor_parallel_placement(weight);
  if (!placement || placement->tp->size() == 1) return std::nullopt;
  return placement;
}

int64_t wrap_dim(int64_t dim, const at::Tensor& x) {
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  if (d < 0 || d >= x.dim()) {
    throw std::invalid_argument("fsdp: dimension " + std::to_string(dim) + " of a tensor of " + std::to_string(x.dim()) +
                                " dimensions");
  }
  return d;
}

}  // namespace fsdp::detail
