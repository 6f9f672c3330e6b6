// The generators of this process's TP-rank streams (fsdp::seed_tensor_parallel_rng): what a
// checkpoint saves beside the default generators and restores, so that dropout under tensor
// parallelism resumes bit for bit.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Generator.h>

namespace fsdp::detail {

// ("tp_cpu", generator) and, with CUDA, ("tp_cuda", generator); empty before the first seeding.
std::vector<std::pair<std::string, at::Generator>> tensor_parallel_generators();

}  // namespace fsdp::detail
