// One rank's batches (batches.cpp): moved to its device, cut into micro-batches, the global batch's
// mean of a figure over the ranks, and the held-out evaluation (--eval-every, and the run's end).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include <torch/torch.h>

#include "config.h"
#include "fsdp/mesh.h"
#include "trainee.h"
#include "workload.h"

namespace train {

Batch on_device(Batch b, const torch::Device& device);
// Samples [begin, begin + n) of `b`: a micro-batch.
Batch slice(const Batch& b, int64_t begin, int64_t n);
// The global batch's mean of `value` (each rank's mean over an equal slice).
double global_mean(fsdp::Mesh& mesh, const torch::Tensor& value);

// The held-out figures after `step`: the loss of a held-out batch (forward only: no graph, nothing
// gathered stays behind) and what else the workload evaluates (the DHEN's AUC). A collective.
std::map<std::string, double> evaluate_held_out(const Config& c, const Workload& workload, torch::nn::Module& model,
                                                Trainee& trainee, fsdp::Mesh& mesh, const torch::Device& device,
                                                int step);

}  // namespace train
