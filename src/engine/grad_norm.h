// Gradient clipping by the exact global 2-norm over all ranks' sharded gradients.
#pragma once

#include <vector>

#include "comm/comm_context.h"
#include "engine/unit.h"

namespace fsdp {

class TensorParallel;

// Scales every unit's sharded gradients by min(1, max_norm / (norm + 1e-6)) and returns the
// norm. Each element of a flat parameter lives on exactly one rank of its shard group (replicas
// hold copies), so the shard group's sum of squares is the global one. A tied weight is one
// parameter of one unit: counted once.
// `model_parallel`: tensors outside the units of which each rank holds its own part: their squares
// are summed over the world group into the norm, and they are scaled too.
// `tp` (tensor parallelism, may be null): parameters split across its group (fsdp::parallelize)
// hold each TP rank's own part, so their squares are summed over the TP group as well; the
// replicated ones (norms, row-parallel biases) are the same on every TP rank and counted once.
double clip_grad_norm(const std::vector<const Unit*>& units, CommContext& comm, double max_norm,
                      const std::vector<at::Tensor>& model_parallel = {}, const TensorParallel* tp = nullptr);

}  // namespace fsdp
