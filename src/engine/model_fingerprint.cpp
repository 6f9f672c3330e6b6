#include "engine/model_fingerprint.h"

#include <sstream>

namespace fsdp {

std::string describe_model(const torch::nn::Module& root, const std::vector<UnitPlan>& units, const Options& options,
                           int shard_size, const IgnoredSet& ignored) {
  std::ostringstream desc;
  desc << "strategy " << to_string(options.strategy) << " F=" << shard_size << "\n";
  // Every option that decides which collectives run, and when: ranks that differ in any of them
  // would pair up different collectives.
  desc << "backward_prefetch " << to_string(options.backward_prefetch) << " forward_prefetch " << options.forward_prefetch
       << " prefetch_count " << options.prefetch_count << " limit_all_gathers " << options.limit_all_gathers
       << " sync_module_states " << options.sync_module_states << " init_device "
       << (options.init_device ? options.init_device->str() : std::string("unset")) << " memory_budget "
       << options.memory_budget.max_bytes_per_rank << " activation_bytes " << options.memory_budget.activation_bytes
       << " async_checkpoint " << options.memory_budget.async_checkpoint << "\n";
  if (const auto& mp = options.mixed_precision) {
    desc << "mixed precision param " << dtype_name(mp->param_dtype) << " reduce " << dtype_name(mp->reduce_dtype)
         << " buffer " << dtype_name(mp->buffer_dtype) << " keep_low_precision_grads " << mp->keep_low_precision_grads << "\n";
  }
  for (const auto& item : root.named_parameters(true)) {
    if (ignored.count(item.value().unsafeGetTensorImpl())) {
      // The caller's (e.g. this rank's rows of a table): the name and dtype must agree, the shape may not.
      desc << "ignored param " << item.key() << " " << item.value().dtype()
           << " (ignored parameters may differ in shape across ranks, not in name or number)\n";
      continue;
    }
    desc << "param " << item.key() << " " << item.value().sizes() << " " << item.value().dtype()
         << " requires_grad=" << item.value().requires_grad() << "\n";
  }
  for (const auto& u : units) {
    desc << "unit '" << u.name << "':";
    for (const auto& f : u.fqns) desc << " " << f;
    desc << "\n";
  }
  return desc.str();
}

uint64_t fingerprint(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

}  // namespace fsdp
