// Whether the TP ranks of a data-parallel group hold the same thing where they must: the
// replicated parameters of the model they built, the inputs of their first forward, the gradients
// of replicated parameters after a synchronized backward. Each is a checksum per tensor (its
// element count, sum and sum of squares in fp64), every rank's gathered over the whole job in one
// all-gather, so every rank reaches the same verdict about every TP group and a refusal never
// leaves a rank waiting. Identical
// tensors give identical checksums; one that differs anywhere is caught unless its sum and sum of
// squares both happen to agree.
#pragma once

#include <cstddef>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp {
class TensorParallel;
namespace detail {

// The indices of `tensors` (undefined ones count as empty) that differ across some TP group of the
// job. Collective over the whole job (tp.world()): every rank must call it with the same number of
// tensors.
std::vector<size_t> differ_across_tensor_parallel(const TensorParallel& tp, const std::vector<at::Tensor>& tensors);

}  // namespace detail
}  // namespace fsdp
