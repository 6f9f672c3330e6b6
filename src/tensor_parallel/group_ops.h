// The collectives of the tensor-parallel layers and regions (parallel_layers.cpp,
// sequence_parallel.cpp): each over the TP group, on the calling thread (the layer's in forward,
// autograd's in backward), waited for at once (the next operator needs its result), and throwing
// what failed and on which TP rank. The autograd Functions that call them carry their group as a
// key (an IValue cannot hold a shared_ptr of a plain class).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace fsdp {
class TensorParallel;
struct TensorParallelPlacement;
namespace detail {

// The key of `tp` in a process-wide table, and back (throws when the group has ended).
int64_t key_of(const std::shared_ptr<TensorParallel>& tp);
std::shared_ptr<TensorParallel> by_key(int64_t key);

// In place on `t` (a fresh, contiguous tensor). `what` names the tensor in the error.
void all_reduce_(at::Tensor& t, c10d::ReduceOp op, const TensorParallel& tp, const char* what);
// Every rank's `x` side by side along `dim`, in rank order (a new, contiguous tensor).
at::Tensor all_gather_along(const at::Tensor& x, int64_t dim, const TensorParallel& tp, const char* what);
// The sum over the group of `x`, this rank's part of `dim` (which the group size divides).
at::Tensor reduce_scatter_along(const at::Tensor& x, int64_t dim, const TensorParallel& tp, const char* what);

// The weight's placement when it is split over more than one rank (one registry lookup per call).
std::optional<TensorParallelPlacement> active(const at::Tensor& weight);

// `dim` counted from the front (a negative one from the back); throws when out of range.
int64_t wrap_dim(int64_t dim, const at::Tensor& x);

}  // namespace detail
}  // namespace fsdp
