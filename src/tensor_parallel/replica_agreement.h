// Whether the TP ranks of a data-parallel group hold the same thing where they must: the
// replicated parameters of the model they built, the inputs of their first forward, the gradients
// of replicated parameters after a synchronized backward. Each is a checksum per tensor (its
// element count, sum, sum of squares and a position-weighted sum in fp64), every rank's gathered
// over the whole job in one
// all-gather, so every rank reaches the same verdict about every TP group and a refusal never
// leaves a rank waiting. Identical
// tensors give identical checksums; one that differs anywhere is caught unless its sum and sum of
// squares both happen to agree.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp {
class TensorParallel;
namespace detail {

// The indices of `tensors` (undefined ones count as empty) that differ across some TP group of the
// job. Collective over the whole job (tp.world()): every rank must call it with the same number of
// tensors.
std::vector<size_t> differ_across_tensor_parallel(const TensorParallel& tp, const std::vector<at::Tensor>& tensors);

// Integer ids that every TP rank of a data-parallel group must hold alike (an embedding's lookups,
// a loss's targets: a layer a user calls inside forward_with, or with ids inside a type of their
// own, that the root's input check does not see) and that must lie in [0, limit), those equal to
// `ignore` excepted. Their range and a checksum, every rank's gathered over the whole job in one
// all-gather; throws std::invalid_argument on every rank alike, naming the first rank at fault
// and `what` ("the ids of fsdp::vocab_parallel_embedding").
void check_ids_across_tensor_parallel(const TensorParallel& tp, const at::Tensor& ids, int64_t limit,
                                      std::optional<int64_t> ignore, const std::string& what);

}  // namespace detail
}  // namespace fsdp
