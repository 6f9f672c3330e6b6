// Checkpoints of a tensor-parallel model (docs/checkpoints.md, "Tensor parallelism"): the same
// checkpoint as of the model without TP, every tensor whole under its original name and shape.
// Each TP rank's fsdp holds shards of its parts; a save puts the parts of each gathered unit
// together over the TP group (FULL kind), and a load reads, for each split parameter, the runs of
// the whole saved tensor that make up this rank's elements of its part. Agreements and checks run
// over the job (every TP rank of every data-parallel rank), so that a failure on one TP rank
// reaches all of them.
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include <ATen/ATen.h>

#include "comm/collectives.h"
#include "fsdp/tensor_parallel.h"
#include "wrap/sharded_root.h"

namespace fsdp {

// The model's TP (null without one, or with a TP group of one rank).
const TensorParallel* tensor_parallel_of(detail::ShardedRoot& root);
// Parameter i of handle h's split, when it is split across a TP group of more than one rank.
std::optional<TensorParallelPlacement> split_placement(const FlatParamHandle& h, size_t i);
// Its whole shape (its own when not split).
std::vector<int64_t> whole_shape(const FlatParamHandle& h, size_t i);

// The job's group, rank and size: all W ranks under TP (the TP world's), fsdp's world otherwise.
GroupPtr job_group(detail::ShardedRoot& root);
int job_rank(detail::ShardedRoot& root);
int job_size(detail::ShardedRoot& root);
// Whether this rank writes whole tensors (FULL files, export_full): rank 0 of the job.
bool writes_whole(detail::ShardedRoot& root);

// The whole tensor of parameter i from this rank's `part` (its local shape): a collective over
// this rank's TP group when split (every TP rank calls it for the same parameter), else `part`.
at::Tensor whole_of(const FlatParamHandle& h, size_t i, const at::Tensor& part);

// Elements [begin, begin + dest.numel()) of this rank's part of a tensor of shape `whole` split as
// `shard` over `size` ranks, read with `read_range(whole_begin, into)` (which fills `into` with
// elements [whole_begin, whole_begin + into.numel()) of the flattened whole tensor), one contiguous
// run of the whole tensor at a time: a row-parallel weight's part is a run per row.
void read_part(const std::function<void(int64_t, at::Tensor)>& read_range, const std::vector<int64_t>& whole,
               const TensorParallelShard& shard, int rank, int size, int64_t begin, at::Tensor dest);

}  // namespace fsdp
