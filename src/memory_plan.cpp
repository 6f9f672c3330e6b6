#include "fsdp/plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "flat_param.h"
#include "mesh_info.h"
#include "precision.h"
#include "unit_decomposition.h"

namespace fsdp {

MemoryPlan plan_memory(torch::nn::Module& model, int W, const Options& options, int local_world_size) {
  MemoryPlan plan;
  plan.world_size = W;
  plan.shard_size = sharding_factor(options, W, local_world_size);
  plan.strategy = to_string(options.strategy);
  const int F = plan.shard_size;
  const auto units = decompose(model, options.auto_wrap_policy);
  std::vector<int64_t> nonroot_bytes;
  int64_t root_bytes = 0, all_unsharded = 0, largest_compute_bytes = 0, largest_reduce_bytes = 0;
  for (const auto& u : units) {
    if (u.params.empty()) continue;
    std::vector<std::vector<int64_t>> shapes;
    for (const auto& p : u.params) shapes.push_back(p.sizes().vec());
    FlatParamLayout layout(u.fqns, shapes, F);
    const UnitDtypes dt = unit_dtypes(u.params[0].scalar_type(), options.mixed_precision);
    const auto master = dt.master, compute = dt.compute, reduce = dt.reduce, grad = dt.grad;
    const int64_t me = static_cast<int64_t>(c10::elementSize(master));
    plan.master_dtype = dtype_name(master);
    plan.param_dtype = dtype_name(compute);
    plan.reduce_dtype = dtype_name(reduce);

    UnitInfo info;
    info.name = u.name;
    info.fqns = u.fqns;
    info.numel = layout.numel();
    info.padded_numel = layout.padded_numel();
    info.shard_numel = layout.shard_numel();
    info.element_size = me;
    info.is_root = u.is_root;
    plan.units.push_back(info);

    plan.total_numel += layout.numel();
    plan.largest_unit_numel = std::max(plan.largest_unit_numel, layout.numel());
    plan.sharded_params += layout.shard_numel() * me;
    plan.sharded_grads += layout.shard_numel() * static_cast<int64_t>(c10::elementSize(grad));
    plan.adam_state += 2 * layout.shard_numel() * 4;
    // What gathering it costs: nothing extra when F = 1 and no cast (the shard is the parameter).
    const int64_t gathered = (F > 1 || compute != master) ? layout.padded_numel() * static_cast<int64_t>(c10::elementSize(compute)) : 0;
    all_unsharded += gathered;
    if (u.is_root) root_bytes = gathered; else nonroot_bytes.push_back(gathered);
    largest_compute_bytes = std::max(largest_compute_bytes, layout.padded_numel() * static_cast<int64_t>(c10::elementSize(compute)));
    largest_reduce_bytes = std::max(largest_reduce_bytes, layout.padded_numel() * static_cast<int64_t>(c10::elementSize(reduce)));
  }
  if (reshards_after_forward(options.strategy)) {
    std::sort(nonroot_bytes.rbegin(), nonroot_bytes.rend());
    const size_t held = 1 + (options.backward_prefetch == BackwardPrefetch::NONE ? 0 : static_cast<size_t>(options.prefetch_count)) +
                        (options.forward_prefetch ? static_cast<size_t>(options.prefetch_count) : 0);
    plan.peak_unsharded_params = root_bytes;
    for (size_t i = 0; i < std::min(held, nonroot_bytes.size()); ++i) plan.peak_unsharded_params += nonroot_bytes[i];
  } else {
    plan.peak_unsharded_params = all_unsharded;
  }
  plan.peak_unsharded_grads = largest_compute_bytes + largest_reduce_bytes;
  return plan;
}

namespace {
std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}
}  // namespace

std::string format_plans(const std::vector<MemoryPlan>& plans) {
  std::ostringstream out;
  if (plans.empty()) return "";
  const MemoryPlan& p0 = plans[0];
  char head[256];
  std::snprintf(head, sizeof(head), "%.3f B parameters in %zu units (largest %.3f B), W = %d, F = %d, %s\n",
                p0.total_numel / 1e9, p0.units.size(), p0.largest_unit_numel / 1e9, p0.world_size, p0.shard_size,
                p0.strategy.c_str());
  out << head << "\n| per rank |";
  for (const auto& p : plans) out << " params " << p.master_dtype << ", compute " << p.param_dtype << ", reduce " << p.reduce_dtype << " |";
  out << "\n|---|";
  for (size_t i = 0; i < plans.size(); ++i) out << "---|";
  out << "\n";
  auto row = [&](const char* name, int64_t MemoryPlan::*field) {
    out << "| " << name << " |";
    for (const auto& p : plans) out << " " << gib(p.*field) << " |";
    out << "\n";
  };
  row("sharded parameters", &MemoryPlan::sharded_params);
  row("sharded gradients", &MemoryPlan::sharded_grads);
  row("Adam state (fp32 exp_avg, exp_avg_sq)", &MemoryPlan::adam_state);
  row("peak gathered parameters", &MemoryPlan::peak_unsharded_params);
  row("peak unsharded gradients + reduce buffer", &MemoryPlan::peak_unsharded_grads);
  out << "| **total, without activations** |";
  for (const auto& p : plans) out << " **" << gib(p.total()) << "** |";
  out << "\n";
  return out.str();
}

}  // namespace fsdp
