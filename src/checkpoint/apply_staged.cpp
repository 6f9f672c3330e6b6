// Applying a staged load (apply, checkpoint_reader.h): the staged copies into the model's shards
// and buffers, then the optimizer's group options and per-parameter state. Nothing here fails
// halfway: everything was read and checked when it was staged.
#include "checkpoint/checkpoint_reader.h"

namespace fsdp {

void apply(StagedLoad& staged, torch::optim::Optimizer* optimizer) {
  at::NoGradGuard no_grad;
  for (auto& [dest, src] : staged.copies) dest.copy_(src.view(dest.sizes()));
  if (!optimizer) return;
  auto adapter = OptimizerStateAdapter::for_optimizer(*optimizer);
  for (size_t g = 0; g < staged.group_options.size(); ++g) {
    adapter->set_group_options(optimizer->param_groups()[g], staged.group_options[g]);
  }
  for (auto& [param, st] : staged.optimizer_states) adapter->set(*optimizer, param, st);
}

}  // namespace fsdp
