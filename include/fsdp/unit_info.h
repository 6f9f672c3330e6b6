// What an FSDP unit looks like after construction: for accounting, tests, logs and the memory plan.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

struct UnitInfo {
  std::string name;                // module path ("" for the root unit)
  std::vector<std::string> fqns;   // its original parameters, by their first name in the model
  int64_t numel = 0;               // Σ ψ of its parameters
  int64_t padded_numel = 0;        // rounded up to a multiple of F
  int64_t shard_numel = 0;         // = ceil(numel / F), what each rank keeps
  int64_t element_size = 4;        // bytes per element of the sharded parameters
  bool is_root = false;
};

}  // namespace fsdp
