// Model decomposition (paper §3, §4.2): which parameters form which FSDP unit. Units are the
// modules marked with fully_shard() or picked by the auto-wrap policy, claimed bottom-up so an
// inner unit takes its parameters before its ancestors see them; whatever no unit claimed goes to
// the root unit. A parameter shared by several modules (tied weights) is claimed once, by the
// first unit that reaches it, and identified by its TensorImpl, not its name.
#pragma once

#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/nn/module.h>

#include "fsdp/options.h"

namespace fsdp {

struct UnitPlan {
  std::string name;                     // module path, "" for the root
  const torch::nn::Module* module = nullptr;
  std::vector<std::string> fqns;        // first name each parameter has in the root's named_parameters()
  std::vector<at::Tensor> params;       // the model's own parameter tensors (same TensorImpls)
  std::unordered_set<const torch::nn::Module*> subtree;  // modules inside this unit's module
  bool is_root = false;
};

// Whether fully_shard() marked `module` (and the mark's module is still this one).
bool is_marked_unit(const torch::nn::Module& module);

// The parameters Options::ignored_modules and ignored_parameters leave to the caller, by
// TensorImpl. Throws std::invalid_argument for an ignored module or parameter that is not part of
// `root`, or a module both ignored and marked with fully_shard().
using IgnoredSet = std::unordered_set<const c10::TensorImpl*>;
IgnoredSet ignored_tensors(const torch::nn::Module& root, const Options& options);

// Units in claim order (inner before outer), the root unit last if it got any parameters.
// Parameters in `ignored` go to no unit.
std::vector<UnitPlan> decompose(torch::nn::Module& root, const WrapPolicy& policy, const IgnoredSet& ignored = {});

}  // namespace fsdp
