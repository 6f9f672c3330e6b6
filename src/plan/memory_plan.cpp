#include "fsdp/plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "engine/flat_param.h"
#include "engine/gradient_reduction.h"
#include "comm/mesh_info.h"
#include "engine/flat_param_handle.h"
#include "engine/param_key.h"
#include "precision/precision.h"
#include "engine/unit_decomposition.h"

namespace fsdp {

MemoryPlan plan_memory(torch::nn::Module& model, int W, const Options& options, int local_world_size) {
  // A wrapped model's parameters hold this rank's 1-D shards (or gathered copies): planned as if
  // they were the model, the figures would be those of a model W times smaller, silently.
  for (const auto& np : model.named_parameters(true)) {
    if (!param_key::has_key(np.value())) continue;
    throw std::invalid_argument(
        "fsdp::plan_memory: parameter '" + np.key() + "' belongs to a FullyShardedDataParallel (it holds that "
        "wrapper's shard, not the whole parameter), so the plan would describe a smaller model. Plan the model before "
        "wrapping it: the same model built normally, or under fsdp::deferred_init, which costs no memory.");
  }
  MemoryPlan plan;
  plan.world_size = W;
  plan.shard_size = sharding_factor(options, W, local_world_size);
  plan.strategy = to_string(options.strategy);
  const int F = plan.shard_size;
  const IgnoredSet ignored = ignored_tensors(model, options);
  const auto units = decompose(model, options.auto_wrap_policy, ignored);
  {
    std::vector<std::string> names;
    for (const auto& u : units) names.push_back(u.name);
    check_per_unit_options(options, names);
  }
  IgnoredSet counted;  // a tied parameter once
  int64_t ignored_saved = 0;  // what a checkpoint holds of them: their values and Adam moments
  for (const auto& p : model.parameters(true)) {
    if (!ignored.count(p.unsafeGetTensorImpl()) || !counted.insert(p.unsafeGetTensorImpl()).second) continue;
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    plan.ignored_state += bytes + (p.requires_grad() ? bytes + 2 * p.numel() * 4 : 0);
    ignored_saved += bytes + (p.requires_grad() ? 2 * p.numel() * 4 : 0);
  }
  std::vector<int64_t> nonroot_bytes;
  // What a gather in flight holds besides the unit's buffer: Gloo's staging copy of its output, or
  // with quantization the records (and their staging copy) instead, per non-root unit.
  std::vector<int64_t> nonroot_staging;
  int64_t kept_units = 0;  // keep_gathered_after_forward: held from their forward to their backward
  bool kept_is_last = false;  // ... and the last non-root unit is one of them (a GPT's last block)
  int64_t root_bytes = 0, all_unsharded = 0, kept_bytes = 0, largest_compute_bytes = 0, largest_reduce_bytes = 0, root_compute_bytes = 0;
  int64_t largest_shard_reduce_bytes = 0;
  // Where the shards will live decides the backend, and with it what a reduce-scatter holds.
  c10::DeviceType device = options.init_device ? options.init_device->type() : c10::kCPU;
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
    if (!options.init_device) device = u.params[0].is_meta() ? c10::kCPU : u.params[0].device().type();
    if (u.is_root) {
      root_bytes = gathered;
      root_compute_bytes = layout.numel() * static_cast<int64_t>(c10::elementSize(compute));
    } else if (reshards_after_forward(options.strategy) && !reshards_unit_after_forward(options, u.name)) {
      kept_bytes += gathered;
      ++kept_units;
      kept_is_last = true;
    } else {
      kept_is_last = false;
      nonroot_bytes.push_back(gathered);
      // What a backward prefetch holds besides the unit's buffer while it is in flight: on the CPU
      // Gloo's staging copy of its output; quantized, the records it gathers into (and on the CPU
      // their staging copy) instead. With hpZ backward gathers the secondary shards, unquantized.
      const bool cpu = device == c10::kCPU;
      const int N = secondary_shard_size(options, u.name, F, local_world_size);  // hpZ: 0 when off
      int64_t staging = cpu ? gathered : 0;
      if (options.quantize_all_gather != AllGatherQuantization::NONE && N == 0 && F > 1 && at::isFloatingType(compute)) {
        staging = (cpu ? 2 : 1) * F * quantization_layout(layout, options.quantization_block).bytes();
      }
      nonroot_staging.push_back(staging);
      // hpZ: 1/N of the unit, in the compute dtype, from its forward until its backward gathers it.
      if (N > 0) plan.secondary_shards += layout.padded_numel() / N * static_cast<int64_t>(c10::elementSize(compute));
    }
    largest_compute_bytes = std::max(largest_compute_bytes, layout.padded_numel() * static_cast<int64_t>(c10::elementSize(compute)));
    largest_reduce_bytes = std::max(largest_reduce_bytes, layout.padded_numel() * static_cast<int64_t>(c10::elementSize(reduce)));
    largest_shard_reduce_bytes = std::max(largest_shard_reduce_bytes, layout.shard_numel() * static_cast<int64_t>(c10::elementSize(reduce)));
  }
  if (reshards_after_forward(options.strategy)) {
    int64_t kept_bytes_outside_held = kept_bytes;
    std::sort(nonroot_bytes.rbegin(), nonroot_bytes.rend());
    std::sort(nonroot_staging.rbegin(), nonroot_staging.rend());
    const size_t held = 1 + (options.backward_prefetch == BackwardPrefetch::NONE ? 0 : static_cast<size_t>(options.prefetch_count)) +
                        (options.forward_prefetch ? static_cast<size_t>(options.prefetch_count) : 0);
    auto largest = [&](size_t n) {
      int64_t sum = 0;
      for (size_t i = 0; i < std::min(n, nonroot_bytes.size()); ++i) sum += nonroot_bytes[i];
      return sum;
    };
    // Every unit kept gathered after forward is held besides the `held` units in flight, except
    // one kept unit that is the last to run forward (the last block, the case keeping is for):
    // it is gathered only from its own forward, and backward computes it first, so it is one of
    // the held units (peak: the others' largest `held` or it with the largest `held` - 1; the
    // default GPT at W = 4 measured 40.4 MB against 46.6 planned before this).
    plan.peak_unsharded_params = root_bytes;
    if (kept_units == 1 && kept_is_last && held > 0) {
      plan.peak_unsharded_params += std::max(largest(held), kept_bytes + largest(held - 1));
      kept_bytes_outside_held = 0;
    } else {
      plan.peak_unsharded_params += largest(held);
      kept_bytes_outside_held = kept_bytes;
    }
    const size_t prefetched = options.backward_prefetch == BackwardPrefetch::BACKWARD_PRE ? static_cast<size_t>(options.prefetch_count) : 0;
    plan.head_unsharded_params = root_bytes;
    for (size_t i = 0; i < std::min(prefetched, nonroot_bytes.size()); ++i) plan.head_unsharded_params += nonroot_bytes[i];
    if (options.backward_prefetch != BackwardPrefetch::NONE) {
      const size_t ahead = static_cast<size_t>(options.prefetch_count);
      for (size_t i = 0; i < std::min(ahead, nonroot_staging.size()); ++i) plan.gather_staging += nonroot_staging[i];
    }
    // Every unit's secondary shard is held when backward starts (an upper bound as it proceeds),
    // and so is every unit kept gathered after forward.
    plan.peak_unsharded_params += plan.secondary_shards + kept_bytes_outside_held;
    plan.head_unsharded_params += plan.secondary_shards + kept_bytes;
  } else {
    plan.peak_unsharded_params = plan.head_unsharded_params = all_unsharded;
  }
  plan.activations = options.memory_budget.activation_bytes;
  plan.head_activations = std::min(options.memory_budget.head_activation_bytes, plan.activations);
  if (options.memory_budget.async_checkpoint) plan.checkpoint_copy = plan.sharded_params + plan.adam_state + ignored_saved;
  plan.backward_units = std::max<int>(1, static_cast<int>(nonroot_bytes.size() + kept_units));
  plan.unit_grads = largest_compute_bytes;
  plan.reduce_buffer = largest_reduce_bytes;
  plan.root_grads = root_compute_bytes;
  // With F = 1 a reduce buffer becomes the gradient shard: nothing stays in flight besides it.
  plan.reductions_in_flight = F > 1 ? kMaxReductionsInFlight : 0;
  // With replicas, the all-reduce of a reduce-scatter's output works in a buffer of its size.
  plan.replica_buffer = (F > 1 && W / F > 1) ? largest_shard_reduce_bytes : 0;
  // A unit's unsharded gradients (compute dtype) while they are flattened into its reduce buffer,
  // and the reduce-scatters still in flight.
  plan.peak_unsharded_grads = plan.unit_grads + plan.reduce_buffer * (1 + plan.reductions_in_flight);
  return plan;
}

int64_t MemoryPlan::backward_peak() const {
  const int n = std::max(1, backward_units);
  const int64_t spread = activations - head_activations;  // the units' own, freed unit by unit
  // The head's backward: nothing freed yet, the root's gradients arriving.
  // (The all-gather the root's backward prefetches has long finished when the head's gradients
  // peak; a unit's starts while the next one is being waited for: gather_staging from there on.)
  int64_t peak = head_unsharded_params + activations + root_grads;
  for (int j = 0; j < n; ++j) {
    const int64_t in_flight = static_cast<int64_t>(std::min(j, reductions_in_flight)) * (reduce_buffer + replica_buffer);
    // The sharded gradients of the j units done (taken as equal shares).
    const int64_t done = sharded_grads * j / n;
    // While unit j runs its backward: its activations still held, its gradients accumulating.
    const int64_t during = spread * (n - j) / n + root_grads + unit_grads + in_flight + done;
    // When its backward is over: its activations freed, its gradients flattened into the buffer.
    const int64_t after = spread * (n - j - 1) / n + root_grads + unit_grads + reduce_buffer + in_flight + done;
    peak = std::max({peak, peak_unsharded_params + gather_staging + during, peak_unsharded_params + gather_staging + after});
  }
  return peak;
}

std::string format_bytes(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", b / (1024.0 * 1024 * 1024));
  } else if (b >= 1024.0 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", b / (1024.0 * 1024));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f KiB", b / 1024.0);
  }
  return buf;
}

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
    for (const auto& p : plans) out << " " << format_bytes(p.*field) << " |";
    out << "\n";
  };
  row("sharded parameters", &MemoryPlan::sharded_params);
  row("sharded gradients", &MemoryPlan::sharded_grads);
  row("Adam state (fp32 exp_avg, exp_avg_sq)", &MemoryPlan::adam_state);
  if (std::any_of(plans.begin(), plans.end(), [](const MemoryPlan& p) { return p.checkpoint_copy > 0; })) {
    row("asynchronous checkpoint copy", &MemoryPlan::checkpoint_copy);
  }
  if (std::any_of(plans.begin(), plans.end(), [](const MemoryPlan& p) { return p.ignored_state > 0; })) {
    row("ignored parameters (the caller's: values, gradients, Adam state)", &MemoryPlan::ignored_state);
  }
  row("peak gathered parameters", &MemoryPlan::peak_unsharded_params);
  if (std::any_of(plans.begin(), plans.end(), [](const MemoryPlan& p) { return p.secondary_shards > 0; })) {
    row("  of which hpZ secondary shards (forward to backward)", &MemoryPlan::secondary_shards);
  }
  if (std::any_of(plans.begin(), plans.end(), [](const MemoryPlan& p) { return p.gather_staging > 0; })) {
    row("all-gather staging copies in flight (Gloo)", &MemoryPlan::gather_staging);
  }
  row("peak unsharded gradients + reduce buffers", &MemoryPlan::peak_unsharded_grads);
  const bool with_activations = std::any_of(plans.begin(), plans.end(), [](const MemoryPlan& p) { return p.activations > 0; });
  if (with_activations) row("activations (estimate)", &MemoryPlan::activations);
  out << (with_activations ? "| **peak (backward: activations freed as gradients arrive)** |"
                            : "| **peak, without activations** |");
  for (const auto& p : plans) out << " **" << format_bytes(p.total()) << "** |";
  out << "\n";
  return out.str();
}

}  // namespace fsdp
