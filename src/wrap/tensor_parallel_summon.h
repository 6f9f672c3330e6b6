// summon_full_params of a model split for tensor parallelism (fsdp/tensor_parallel.h): fsdp's
// gather makes each parameter whole over the data-parallel ranks, which under TP is still this TP
// rank's part; this puts the TP parts together too, so that inside the scope every parameter is
// the whole tensor a FULL checkpoint holds (its original shape, a padded vocabulary without its
// padding). With writeback, each rank's part of what the scope left in the whole tensor is written
// back into its view before fsdp writes the views back into the shards.
#pragma once

#include <memory>
#include <string>
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
  // Before end() with writeback: the name of the first parameter of `module` (whole, split or not)
  // whose value differs across the TP ranks of some data-parallel group, "" when none: a change
  // made on some TP ranks only. The same answer on every rank (collective over the job).
  std::string differing(torch::nn::Module& module) const;
  // Whether `verdict` (each rank's writeback decision) differs across the TP ranks of some
  // data-parallel group, on every rank alike (collective over the job): the data-parallel check
  // runs per TP place, and every rank must keep or discard together.
  bool verdicts_differ(bool verdict) const;
  // Local: this rank's part of each whole tensor into its view (with `writeback`), and the views
  // back in the parameters. Does not throw.
  void end(bool writeback) noexcept;
  bool active() const { return !swapped_.empty(); }  // begin() swapped parameters (until end())

 private:
  struct Swapped {
    at::Tensor param;  // the model's parameter (its TensorImpl), now holding `whole`
    at::Tensor view;   // what it held: this TP rank's part, a view into fsdp's unsharded unit
    at::Tensor whole;
    TensorParallelPlacement placement;
  };
  std::vector<Swapped> swapped_;
  std::shared_ptr<TensorParallel> tp_;  // of the swapped parameters
};

}  // namespace fsdp::detail
