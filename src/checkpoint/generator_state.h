// The random number generators a rank's training draws from, as a checkpoint saves them (hex text
// in the manifest) and restores them (checked on clones first, applied only after every rank has
// checked its own).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Generator.h>
#include <nlohmann/json.hpp>

namespace fsdp {

// This rank's generators: the CPU one, with CUDA the current device's, and the tensor-parallel
// streams (fsdp::seed_tensor_parallel_rng), by name.
nlohmann::json rng_state();

// A rank's saved generator states, checked by setting them on clones of the generators (a state of
// the wrong size or version throws here, while nothing has changed), applied only after every rank
// has checked its own.
struct StagedRng {
  std::vector<std::pair<at::Generator, at::Tensor>> states;

  static StagedRng check(const nlohmann::json& j, const std::string& origin);
  void apply();
};

}  // namespace fsdp
