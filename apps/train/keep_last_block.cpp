// fsdp-train's --keep-gathered-after-forward last|none (keep_last_block.h).
#include "keep_last_block.h"

#include <algorithm>
#include <set>
#include <stdexcept>

#include "fsdp/plan.h"

namespace train {

bool keeps_only_by_default(const std::vector<std::string>& values) {
  return std::all_of(values.begin(), values.end(), [](const std::string& v) { return v == "last" || v == "none"; });
}

void resolve_keep_gathered(fsdp::Options& options, torch::nn::Module& model, int world_size, int local_world_size) {
  auto& kept = options.keep_gathered_after_forward;
  if (std::find(kept.begin(), kept.end(), "") != kept.end()) {
    throw std::invalid_argument("--keep-gathered-after-forward '': name units (e.g. blocks.3), 'last' for the model's "
                                "last block, or 'none'");
  }
  const bool none = std::find(kept.begin(), kept.end(), "none") != kept.end();
  if (none && kept.size() > 1) {
    throw std::invalid_argument("--keep-gathered-after-forward none keeps no unit gathered: give it alone, or name the "
                                "units (e.g. blocks.3) or 'last'");
  }
  if (none) kept.clear();
  const auto last = std::remove(kept.begin(), kept.end(), "last");  // "last,last" is "last"
  if (last == kept.end()) return;
  kept.erase(last, kept.end());
  if (options.strategy != fsdp::ShardingStrategy::FULL_SHARD && options.strategy != fsdp::ShardingStrategy::HYBRID_SHARD) {
    return;  // every unit stays gathered after forward already
  }
  // The units the wrapper will make, from the plan (the policy decides them bottom-up; the plan
  // runs it as wrapping does), with the names given so far left out of the check.
  fsdp::Options probe = options;
  probe.keep_gathered_after_forward.clear();
  std::set<std::string> units;
  for (const auto& u : fsdp::plan_memory(model, world_size, probe, local_world_size).units) {
    if (!u.is_root) units.insert(u.name);
  }
  std::string name;
  for (const auto& m : model.named_modules("", /*include_self=*/false)) {
    if (units.count(m.key())) name = m.key();  // the last one in module order
  }
  if (name.empty() || std::find(kept.begin(), kept.end(), name) != kept.end()) return;
  const auto hpz = options.reshard_after_forward_to_by_unit.find(name);
  const int n = hpz != options.reshard_after_forward_to_by_unit.end() ? hpz->second : options.reshard_after_forward_to;
  if (n != 0) return;  // hpZ keeps a secondary shard of it instead
  kept.push_back(name);
}

}  // namespace train
