// The end of a run: text the trained GPT writes after a prompt (--prompt, --sample-tokens), so the
// result can be read as well as measured. It runs through the public API a user calls for
// inference, in one of two ways (--sample-via):
//  - summon (the default): summon_full_params({writeback = false, rank0_only = true}) gathers
//    every unit once; rank 0 calls the model's own forward for each token while the other ranks
//    keep their shards and wait at the end of the scope;
//  - sharded: the wrapped model's forward for each token on every rank, which gathers and frees
//    each unit per token; rank 0's logits are broadcast so that every rank samples the same token.
//    Under --tp always this one, the split logits gathered over the TP ranks first.
// Both give the same text (ctest -R MainJobEndsWithSomethingToKeep); the first gathers the model
// once instead of once per token (docs/performance.md, "The end of the main job").
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "config.h"
#include "fsdp/mesh.h"
#include "fsdp/tensor_parallel.h"
#include "trainee.h"
#include "workload.h"

namespace train {

struct TextSample {
  std::string prompt;
  std::string text;       // the prompt and what the model wrote after it
  int64_t tokens = 0;     // tokens written
  double seconds = 0;     // generation's wall time
  std::string via;        // "summon_full_params" or "sharded forward" (or "the local model")
};

// A collective under fsdp (`tp`: the job's tensor parallelism, or null): every rank calls it. Rank 0 returns the sample; the other ranks, and
// every rank of a workload that writes no text or of --sample-tokens 0, return nothing.
std::optional<TextSample> sample_text(const Config& c, const Workload& workload, torch::nn::Module& model,
                                      Trainee& trainee, fsdp::Mesh& mesh, const torch::Device& device,
                                      const std::shared_ptr<fsdp::TensorParallel>& tp);

}  // namespace train
