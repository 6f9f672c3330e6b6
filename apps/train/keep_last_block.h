// fsdp-train keeps the model's last block gathered from its forward to its backward by default
// (--keep-gathered-after-forward last): backward needs that block first, and resharding it after
// forward only to gather it again as backward starts is an all-gather nothing can hide (FSDP2's
// reshard_after_forward=False on the last block, as torchtitan sets it; docs/performance.md,
// "Where a step's time goes"). The library takes unit names only: this turns fsdp-train's words
// ("last", "none") into them.
#pragma once

#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "fsdp/options.h"

namespace train {

// True when the flag's values are fsdp-train's words only ("last" or "none"): nothing a plain run
// (--local, --ddp-baseline) would have to refuse.
bool keeps_only_by_default(const std::vector<std::string>& values);

// Replaces "last" in options.keep_gathered_after_forward by the name of the model's last unit in
// module order (blocks.3 of the default GPT, T5's last decoder block), or drops it where keeping
// a unit gathered means nothing: a strategy that keeps every unit gathered after forward already
// (shard_grad_op, no_shard and their hybrids) or hpZ resharding that unit. "none" empties the list.
// `model` is the (meta) model with options.auto_wrap_policy set; W and the ranks per host are the
// data-parallel ones the model is planned for.
void resolve_keep_gathered(fsdp::Options& options, torch::nn::Module& model, int world_size, int local_world_size);

}  // namespace train
