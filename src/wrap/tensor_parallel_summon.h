// summon_full_params of a model split for tensor parallelism (fsdp/tensor_parallel.h): fsdp's
// gather makes each parameter whole over the data-parallel ranks, which under TP is still this TP
// rank's part; this puts the TP parts together too, so that inside the scope every parameter is
// the whole tensor a FULL checkpoint holds (its original shape, a padded vocabulary without its
// padding). With writeback, each rank's part of what the scope left in the whole tensor is written
// back into its view before fsdp writes the views back into the shards.
#pragma once

#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "fsdp/tensor_parallel.h"

namespace fsdp::detail {

class TensorParallelSummon {
 public:
  // Collective over each TP group, in the module's parameter order (every TP rank holds the same
  // structure). `held`: this rank holds its parameters unsharded (rank0_only's other data-parallel
  // ranks do not, and neither do the other ranks of their TP group, which share their DP rank).
  void begin(torch::nn::Module& module, bool held);
  // Local: this rank's part of each whole tensor into its view (with `writeback`), and the views
  // back in the parameters. Does not throw.
  void end(bool writeback) noexcept;
  bool active() const { return !swapped_.empty(); }

 private:
  struct Swapped {
    at::Tensor param;  // the model's parameter (its TensorImpl), now holding `whole`
    at::Tensor view;   // what it held: this TP rank's part, a view into fsdp's unsharded unit
    at::Tensor whole;
    TensorParallelPlacement placement;
  };
  std::vector<Swapped> swapped_;
};

}  // namespace fsdp::detail
