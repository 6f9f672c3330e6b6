// Options::row_sharded_parameters (include/fsdp/options.h), checked and resolved when a model is
// wrapped: each declared table's name, whole shape and every rank's rows, agreed by all ranks.
// The ranks exchange their declarations and every rank runs the same checks on the same data, so
// a wrong declaration is refused on every rank alike: no rank goes on to a collective that a
// refusing rank never joins. Checkpoints (src/checkpoint/ignored_state.h) use the result to save
// each table whole and to put it together from the ranks' rows.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "comm/mesh_state.h"
#include "engine/unit_decomposition.h"
#include "fsdp/options.h"

namespace fsdp::detail {

struct RowShardedTable {
  std::string name;            // the parameter's first name in the model's named_parameters()
  at::Tensor param;            // this rank's rows [local_rows, ...]
  std::vector<int64_t> shape;  // the whole table's: [rows, ...the parameter's other dimensions]
  int64_t row_begin = 0;       // the table's row that this rank's first row is
  // Every rank of the mesh's rows [begin, end), by rank (empty for a rank that holds none).
  std::vector<std::pair<int64_t, int64_t>> ranks;

  int64_t row_numel() const;  // elements in one row
};

// The declarations of `options`, checked: each names a parameter of `model` that is in `ignored`,
// once; its rows lie in its table; and, across the ranks of `mesh`, the tables have the same
// name, rows, row shape and dtype, and their row ranges tile the table, each row held by one
// rank. Collective over the mesh's world (one small all-gather) unless the mesh has one rank or
// is simulated (Mesh::simulated: no peers to compare with; only this rank's declaration is
// checked). Throws std::invalid_argument on every rank, naming the parameter and what to fix.
std::vector<RowShardedTable> resolve_row_sharded(const torch::nn::Module& model, const Options& options,
                                                 const IgnoredSet& ignored, MeshState& mesh);

}  // namespace fsdp::detail
