// Staging the optimizer's state for a load (stage_optimizer, checkpoint_reader.h): the saved groups
// matched to the optimizer's by their parameters' names, each group's state keys checked, and this
// rank's elements of every state tensor read.
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/ignored_state.h"
#include "checkpoint/piece_reader.h"
#include "checkpoint/tensor_parallel_state.h"

#include <set>

namespace fsdp {
namespace {

using reading::PieceReader;
using reading::read_into;

}  // namespace

void stage_optimizer(detail::ShardedRoot& root, torch::optim::Optimizer& optimizer, const SavedTensors& saved,
                     const nlohmann::json& mo, StagedLoad& out) {
  at::NoGradGuard no_grad;
  auto adapter = OptimizerStateAdapter::for_optimizer(optimizer);
  if (mo.is_null()) {
    reading::fail(saved.origin, "it holds no optimizer state; load it without an optimizer, or start the optimizer fresh");
  }
  const std::string type = mo.value("type", "");
  if (type != adapter->name()) {
    reading::fail(saved.origin, "its optimizer state is " + type + "'s, and this optimizer is " + adapter->name());
  }
  // Groups: the same parameters, by name, in the same groups.
  std::map<const c10::TensorImpl*, std::string> name_of = saved_parameter_names(root);
  for (auto& group : optimizer.param_groups()) {
    std::set<std::string> names;
    for (const auto& p : group.params()) names.insert(name_of.count(p.unsafeGetTensorImpl()) ? name_of[p.unsafeGetTensorImpl()] : "?");
    const nlohmann::json* match = nullptr;
    std::set<std::string> closest;  // the saved group sharing the most parameters with this one
    size_t closest_shared = 0;
    for (const auto& g : mo.at("groups")) {
      std::set<std::string> saved_names;
      for (const auto& n : g.at("params")) {
        const std::string s = n.get<std::string>();
        auto a = saved.alias_of.find(s);
        saved_names.insert(a == saved.alias_of.end() ? s : a->second);
      }
      if (saved_names == names) match = &g;
      size_t shared = 0;
      for (const auto& n : names) shared += saved_names.count(n);
      if (shared > closest_shared) {
        closest_shared = shared;
        closest = saved_names;
      }
    }
    if (!match) {
      // Name the parameters that differ from the closest saved group (a parameter left out of
      // this rank's optimizer, one added), so that the message says what to change.
      std::string lacks, extra;
      for (const auto& n : closest) {
        if (!names.count(n)) lacks += (lacks.empty() ? "" : ", ") + n;
      }
      for (const auto& n : names) {
        if (!closest.count(n)) extra += (extra.empty() ? "" : ", ") + n;
      }
      std::string diff;
      if (!lacks.empty()) diff += "; it lacks " + lacks + ", which the saved group has";
      if (!extra.empty()) diff += "; it has " + extra + ", which the saved group lacks";
      reading::fail(saved.origin, "no saved optimizer group has the parameters of this optimizer's group that starts with " +
                             (names.empty() ? std::string("(empty)") : *names.begin()) + diff +
                             " (the optimizer was built with other groups: build it from the same parameters and "
                             "groups as the one saved)");
    }
    // Checked now on a copy, so that apply() cannot fail halfway.
    torch::optim::OptimizerParamGroup probe(std::vector<at::Tensor>{}, group.options().clone());
    adapter->set_group_options(probe, match->at("options"));
    out.group_options.push_back(match->at("options"));
  }
  const nlohmann::json& steps = mo.at("steps");
  // Within a group every parameter with state has the same state tensors (the options that decide
  // them, momentum or amsgrad, are the group's): a parameter that lacks one would step from a
  // state libtorch never made (an undefined exp_avg).
  for (auto& group : optimizer.param_groups()) {
    std::map<std::string, std::string> first;  // key -> a parameter that has it
    std::vector<std::pair<std::string, std::set<std::string>>> keys_of;
    for (const auto& p : group.params()) {
      auto n = name_of.find(p.unsafeGetTensorImpl());
      if (n == name_of.end() || !steps.contains(n->second)) continue;
      std::set<std::string> keys;
      for (const std::string& key : adapter->tensor_keys()) {
        if (saved.pieces.count("state." + n->second + "." + key)) {
          keys.insert(key);
          first.emplace(key, n->second);
        }
      }
      keys_of.emplace_back(n->second, keys);
    }
    for (const auto& [param, keys] : keys_of) {
      for (const auto& [key, other] : first) {
        if (!keys.count(key)) {
          reading::fail(saved.origin, "its optimizer state of \"" + param + "\" lacks \"" + key + "\", which \"" + other +
                                 "\" of the same group has (a piece missing from the manifest?)");
        }
      }
    }
  }
  PieceReader reader(saved, out.files_read);
  // `param`'s state: elements [begin, begin + param.numel()) of each saved state tensor of `fqn`.
  auto stage = [&](const std::string& fqn, const at::Tensor& param, int64_t begin,
                   const std::optional<TensorParallelPlacement>& split) {
    ParamOptimState st;
    if (steps.contains(fqn)) {
      st.present = true;
      st.step = steps[fqn].get<int64_t>();
      for (const std::string& key : adapter->tensor_keys()) {
        const std::string name = "state." + fqn + "." + key;
        if (!saved.pieces.count(name)) continue;
        // Read on the CPU (pread), then moved to the parameter's device.
        at::Tensor t = at::empty({param.numel()}, param.options().device(c10::kCPU));
        read_into(reader, name, split, begin, t);
        st.tensors[key] = t.view(param.sizes()).to(param.device());
      }
    }
    out.optimizer_states.emplace_back(param, std::move(st));
  };
  for (const auto& unit : root.unit_list()) {
    const FlatParamHandle& h = unit->handle();
    for (size_t i = 0; i < h.params().size(); ++i) {
      stage(h.layout().entries()[i].fqn, h.params()[i], h.slices()[i].param_begin, split_placement(h, i));
    }
  }
  for (const IgnoredParam& p : ignored_params(root)) stage(p.name, p.param, p.flat_begin, std::nullopt);
}

}  // namespace fsdp
