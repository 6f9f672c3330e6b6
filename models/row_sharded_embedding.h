// Sparse embeddings sharded by rows across ranks, outside FSDP: the paper's first approach for
// DHEN's huge embedding tables (§2.3, "activation communication"). Each rank owns a contiguous
// slice of the rows; a lookup sends the row indices to their owners and the looked-up rows back
// (all-to-all), and backward sends the rows' gradients to the owners the same way. The tables'
// parameters are never gathered, so they cost each rank 1/W of their size, and their gradients
// are never all-reduced: only the B x num_tables rows a step touches travel.
#pragma once

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>

namespace models {

// `num_tables` tables of `rows` x `dim`, one categorical feature each, concatenated into ONE
// logical table of N = num_tables * rows rows (table t's row i is logical row t * rows + i).
// Rank r of W holds the logical rows [r * ceil(N/W), min(N, (r+1) * ceil(N/W))) as its parameter
// "weight" [local_rows, dim]; the last ranks may hold none (local_rows 0) when W does not divide N.
//
// Initialization: N(0, 0.1^2), drawn without any rank ever holding more than its own rows. One
// 64-bit seed is drawn from the global torch RNG (so the RNG advances identically at every world
// size), and the logical table's rows are drawn in blocks of 256, block b whole from its own CPU
// generator seeded by (seed, b); a rank draws only the blocks its rows touch and keeps its rows.
// So a model built after the same torch::manual_seed with one process (group null) holds exactly
// the concatenation of every rank's rows, whatever W is, and a table too big for any one machine
// (the paper's DHEN: 768 B sparse parameters) can be built. Under fsdp::deferred_init the rows are
// made at once (fsdp::NotDeferred: they are this rank's own, and fsdp leaves them alone); under
// fsdp::meta_init they are meta.
//
// Forward and backward are collectives when W > 1: every rank of the group must run forward the
// same number of times, and backward through each output the same number of times, in the same
// order. Autograd runs this backward only when the loss depends on the output, so each rank's
// loss must (a rank with an empty batch slice can backward out.sum(), whose gradient is zero).
//
// Checkpoints: under fsdp the rows are ignored parameters, and a checkpoint saves the table whole
// when the job declares which rows each rank holds (fsdp's Options::row_sharded_parameters, from
// row_begin() and local_rows(): apps/train/dhen_workload.cpp); a load at another world size then
// gives each rank its new rows. This header stays free of fsdp's options: the caller declares.
//
// Gradient convention (W > 1): each rank's loss is the mean over its own slice of the global
// batch, and data-parallel training averages gradients over ranks, so the gradient delivered to
// the local weight is the sum of every rank's contributions divided by W. The embedding's
// gradient then equals local training's gradient of the global batch's mean loss, as fsdp's
// averaged dense gradients do.
struct RowShardedEmbeddingImpl : torch::nn::Module {
  // group null: one process, the whole table (rank must be 0 and world_size 1). Otherwise the
  // group's rank and size must be `rank` and `world_size`, and it must support alltoall_base on
  // the weight's device (Gloo: CPU tensors; NCCL: CUDA tensors).
  RowShardedEmbeddingImpl(int64_t num_tables, int64_t rows, int64_t dim,
                          c10::intrusive_ptr<c10d::Backend> group, int rank, int world_size);

  // ids: int64 [B, num_tables], ids[b][t] in [0, rows) -> [B, num_tables, dim]: logical row
  // t * rows + ids[b][t]. W == 1: a plain index_select of the whole table (no communication).
  torch::Tensor forward(const torch::Tensor& ids);

  int64_t row_begin() const { return row_begin_; }    // first logical row held here
  int64_t local_rows() const { return local_rows_; }  // weight.size(0); may be 0
  int64_t rows_per_rank() const { return rows_per_rank_; }  // ceil(N / W)

  const int64_t num_tables, rows, dim;
  torch::Tensor weight;  // [local_rows, dim], registered as "weight"

 private:
  c10::intrusive_ptr<c10d::Backend> group_;
  int rank_, world_size_;
  int64_t rows_per_rank_, row_begin_, local_rows_;
};
TORCH_MODULE(RowShardedEmbedding);

}  // namespace models
