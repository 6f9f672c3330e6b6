// Building one wrapped model (sharded_root.h): decomposition into units, the cross-rank structure
// check, the device and process groups, materializing a deferred model's buffers and ignored
// parameters, rank 0's values broadcast (sync_module_states), buffers cast, the runtime made. The
// checks it refuses a model with are in sharded_root_wrap_checks.cpp.
#include "wrap/sharded_root.h"

#include <set>
#include <stdexcept>

#include <c10/core/GradMode.h>

#include "init/deferred_init_internal.h"
#include "fsdp/plan.h"
#include "fsdp/process_memory.h"
#include "fsdp/deferred_init.h"
#include "fsdp/tensor_parallel.h"
#include "comm/mesh_info.h"
#include "comm/mesh_state.h"
#include "engine/model_fingerprint.h"
#include "engine/unit_decomposition.h"

namespace fsdp::detail {

ShardedRoot::ShardedRoot(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<Mesh> mesh, Options options)
    : module_(std::move(module)), mesh_(std::move(mesh)), options_(std::move(options)) {
  TORCH_CHECK(module_ && mesh_, "fsdp: FullyShardedDataParallel needs a module and a mesh");
  install_host_allocator();  // live tensor bytes counted, large blocks reused (process_memory.h)
  TORCH_CHECK(options_.prefetch_count >= 1, "fsdp: prefetch_count must be >= 1, got ", options_.prefetch_count);
  check_tensor_parallel();
  const int F = sharding_factor(options_, mesh_->world_size(), mesh_->env().local_world_size);
  ignored_ = ignored_tensors(*module_, options_);
  check_not_wrapped_already();
  std::vector<UnitPlan> plans = decompose(*module_, options_.auto_wrap_policy, ignored_);
  {
    std::vector<std::string> names;
    for (const auto& p : plans) names.push_back(p.name);
    check_per_unit_options(options_, names);
  }

  // A meta parameter with no recorded initialization cannot be materialized: a deferred_init
  // model split by fsdp::parallelize (its parts keep no record; tensor parallelism splits a model
  // built whole), or a model moved to the meta device by other means. Refused here, by name, on
  // every rank alike, rather than from inside materialization.
  for (const auto& plan : plans) {
    for (size_t i = 0; i < plan.params.size(); ++i) {
      const at::Tensor& p = plan.params[i];
      if (!p.is_meta() || is_deferred(p)) continue;
      throw std::invalid_argument(
          "fsdp: parameter '" + plan.fqns[i] + "' is a meta tensor without a recorded initialization to make its "
          "values from" + std::string(tensor_parallel_placement(p) ? " (a deferred_init model split by "
          "fsdp::parallelize: tensor parallelism splits a model built whole, so build it normally, every TP rank from "
          "the same seed, then parallelize and wrap it)" : "") + "; build the model with fsdp::deferred_init, or "
          "normally");
    }
  }

  // Every rank must cut the same model the same way: compared before the first collective on
  // parameters.
  const std::string desc = describe_model(*module_, plans, options_, F, ignored_);
  MeshState::of(*mesh_).check_same_on_all_ranks("the model structure (parameter names, shapes, dtypes) or the FSDP options",
                                                fingerprint(desc), desc);
  // Which ignored parameters are rows of a table, checked across the ranks before anything waits
  // on them: every rank refuses a wrong declaration alike.
  row_sharded_ = resolve_row_sharded(*module_, options_, ignored_, MeshState::of(*mesh_));

  // Where the shards will live: the parameters' device, the CPU for a deferred (meta) model, or
  // init_device. Its type picks the backend: Gloo for CPU, NCCL for CUDA.
  const bool deferred = !plans.empty() && !plans[0].params.empty() && plans[0].params[0].is_meta();
  device_ = plans.empty() || plans[0].params.empty() || deferred ? c10::Device(c10::kCPU) : plans[0].params[0].device();
  if (options_.init_device) device_ = *options_.init_device;
  check_memory_budget(*module_, *mesh_, options_, device_);
  if (deferred) {
    if (options_.sync_module_states) {
      throw std::invalid_argument("fsdp: sync_module_states with a deferred_init model: there is nothing to broadcast "
                                  "yet, and replaying the recorded initialization gives every rank the same values "
                                  "when every rank built the model with the same seed; drop sync_module_states. To "
                                  "start every rank from weights in a file, wrap the model and load them with "
                                  "fsdp::load_model_file (each rank reads only the elements it holds); or build the "
                                  "model normally, load them on rank 0 and keep sync_module_states");
    }
    materialize_buffers();
    materialize_ignored();
  }
  comm_ = std::make_unique<CommContext>(device_, make_mesh_info(*mesh_, options_, device_.type()));
  comm_->set_param_quantization(options_.quantize_all_gather, options_.quantization_block);
  if (options_.sync_module_states) {
    broadcast_module_states();  // checks the TP ranks' replicas between its two broadcasts
  } else {
    check_tensor_parallel_replicas();
  }
  checks_inputs_ = options_.tensor_parallel && options_.tensor_parallel->size() > 1;
  if (const auto& mp = options_.mixed_precision) {
    // Buffers are not sharded: cast them once, here, instead of at every forward. Not those of
    // ignored modules: they are the caller's, computed with its own (uncast) parameters, and a
    // BatchNorm among them would meet bf16 running statistics with fp32 inputs.
    at::NoGradGuard no_grad;
    std::set<const c10::TensorImpl*> ignored_buffers;
    for (const auto& m : options_.ignored_modules) {
      for (const auto& b : m->buffers(true)) ignored_buffers.insert(b.unsafeGetTensorImpl());
    }
    for (auto& b : module_->buffers(true)) {
      if (b.defined() && at::isFloatingType(b.scalar_type()) && !ignored_buffers.count(b.unsafeGetTensorImpl())) {
        b.set_data(b.to(mp->buffer_dtype));
      }
    }
  }
  std::vector<std::string> names;
  std::vector<Unit*> units;
  std::vector<bool> reshards;  // after forward, per unit
  for (size_t u = 0; u < plans.size(); ++u) {
    names.push_back(plans[u].name);
    reshards.push_back(reshards_unit_after_forward(options_, plans[u].name));
    const std::string name = plans[u].name;
    units_.push_back(std::make_unique<Unit>(static_cast<int>(u), std::move(plans[u]), *comm_,
                                            options_.mixed_precision, options_.init_device));
    units_.back()->handle().set_secondary_size(
        secondary_shard_size(options_, name, comm_->mesh().shard_size, mesh_->env().local_world_size));
    units.push_back(units_.back().get());
  }
  comm_->set_unit_names(std::move(names));
  for (const auto& p : module_->parameters(true)) wrapped_params_.insert(p.unsafeGetTensorImpl());
  runtime_ = std::make_shared<Runtime>(std::move(units), *comm_, options_, std::move(reshards));
  runtime_->install_hooks();
  // A model built whole has just been freed, but for its shards: give that memory back.
  if (device_.is_cpu()) release_free_memory();
}

void ShardedRoot::materialize_buffers() {
  // Buffers are not sharded: each is materialized whole, on the target device.
  for (auto& b : module_->buffers(true)) {
    if (!b.defined() || !is_deferred(b)) continue;
    at::Tensor value = at::empty(b.sizes(), b.options().device(c10::kCPU));
    materialize_into(b, value);
    at::Tensor target = value.to(device_);
    adopt(b, target);
  }
}

void ShardedRoot::materialize_ignored() {
  // The caller's parameters: whole, on every rank, on the target device, like buffers.
  for (auto& p : module_->parameters(true)) {
    if (!ignored_.count(p.unsafeGetTensorImpl()) || !is_deferred(p)) continue;
    at::Tensor value = at::empty(p.sizes(), p.options().device(c10::kCPU));
    materialize_into(p, value);
    at::Tensor target = value.to(device_);
    adopt(p, target);
  }
}

void ShardedRoot::broadcast_module_states() {
  // Rank 0's values win; parameters and buffers in registration order, which the fingerprint
  // has already shown to be the same on every rank. One group of all W ranks.
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> tensors;
  std::set<const c10::TensorImpl*> seen;  // a tied weight once
  // Ignored parameters, and the buffers of ignored modules, are the caller's (each rank may hold
  // its own rows of a table): left as they are.
  std::set<const c10::TensorImpl*> ignored_buffers;
  for (const auto& m : options_.ignored_modules) {
    for (const auto& b : m->buffers(true)) ignored_buffers.insert(b.unsafeGetTensorImpl());
  }
  std::vector<bool> split;  // split for tensor parallelism: each TP rank's own part
  for (const auto& p : module_->parameters(true)) {
    if (ignored_.count(p.unsafeGetTensorImpl())) continue;
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    tensors.push_back(p.detach());
    const auto placement = tensor_parallel_placement(p);
    split.push_back(placement && placement->tp->size() > 1);
  }
  for (const auto& b : module_->buffers(true)) {
    if (!b.defined() || ignored_buffers.count(b.unsafeGetTensorImpl())) continue;
    tensors.push_back(b.detach());
    split.push_back(false);
  }
  if (tensors.empty()) return;
  if (mesh_->world_size() > 1) {
    // On the tensors' own device (they have not moved to init_device yet).
    const GroupPtr& group = MeshState::of(*mesh_).groups_for(mesh_->world_size(), tensors[0].device().type()).shard;
    for (auto& t : tensors) {
      std::vector<at::Tensor> one{t};
      c10d::BroadcastOptions opts;
      opts.rootRank = 0;
      wait_for(group->broadcast(one, opts), "broadcast of rank 0's parameters and buffers (sync_module_states)");
    }
  }
  // With tensor parallelism the mesh is one TP place's data-parallel ranks: the broadcast above
  // gave each TP rank its first DP rank's values. Split parameters are each TP rank's own part,
  // but every TP rank must hold the same replicated parameters and buffers (each computes the
  // same gradient for them, and nothing reduces them across the TP group): the first TP rank's
  // values, so that the job's rank 0 decides them all. Ranks that built the model from different
  // seeds would otherwise train different replicas of them, silently.
  const auto& tp = options_.tensor_parallel;
  if (!tp || tp->size() == 1) return;
  check_tensor_parallel_replicas();
  const auto& tp_group = tp->group(tensors[0].device().type());
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (split[i]) continue;
    std::vector<at::Tensor> one{tensors[i]};
    c10d::BroadcastOptions opts;
    opts.rootRank = 0;
    wait_for(tp_group->broadcast(one, opts),
             "broadcast of the first TP rank's replicated parameters and buffers (sync_module_states)");
  }
}

}  // namespace fsdp::detail
