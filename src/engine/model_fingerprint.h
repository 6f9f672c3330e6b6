// Every rank must cut the same model the same way with the same options, or the collectives would
// pair up different buffers (or hang): a readable description of the model's structure and the
// options, compared across ranks before the first collective on parameters.
#pragma once

#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "fsdp/options.h"
#include "engine/unit_decomposition.h"

namespace fsdp {

// One item per line: the options, each parameter's name, shape, dtype and requires_grad, and each
// unit's parameters (an ignored parameter by name and dtype only: its shape is the caller's, e.g.
// this rank's rows of a table). Equal descriptions on every rank are what "the same model" means.
std::string describe_model(const torch::nn::Module& root, const std::vector<UnitPlan>& units, const Options& options,
                           int shard_size, const IgnoredSet& ignored = {});

// FNV-1a, for comparing descriptions across ranks cheaply.
uint64_t fingerprint(const std::string& description);

}  // namespace fsdp
