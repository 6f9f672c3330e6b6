#include "wrap/sharded_root.h"

#include <set>
#include <stdexcept>

#include <c10/core/GradMode.h>

#include "observe/chrome_trace.h"
#include "init/deferred_init_internal.h"
#include "memory/device.h"
#include "fsdp/plan.h"
#include "fsdp/process_memory.h"
#include "fsdp/deferred_init.h"
#include "fsdp/tensor_parallel.h"
#include "engine/grad_norm.h"
#include "engine/param_key.h"
#include "comm/mesh_info.h"
#include "comm/mesh_state.h"
#include "engine/model_fingerprint.h"
#include "engine/param_key.h"
#include "engine/unit_decomposition.h"
#include "tensor_parallel/replica_agreement.h"

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

void ShardedRoot::check_tensor_parallel() {
  // A model split by fsdp::parallelize holds parts that differ across its TP group: wrapped over
  // the world, fsdp would average different parameters together; without the group, clipping
  // would miss the other ranks' parts. Both would train wrong without an error.
  const auto& tp = options_.tensor_parallel;
  for (const auto& np : module_->named_parameters(true)) {
    const auto placement = tensor_parallel_placement(np.value());
    if (!placement || placement->tp->size() == 1) continue;
    if (!tp) {
      throw std::invalid_argument("fsdp: parameter '" + np.key() + "' is split for tensor parallelism "
                                  "(fsdp::parallelize) but Options::tensor_parallel is not set: set it to the "
                                  "TensorParallel the plan used and wrap over its data_parallel() mesh");
    }
    if (placement->tp != tp) {
      throw std::invalid_argument("fsdp: parameter '" + np.key() + "' is split over another TensorParallel than "
                                  "Options::tensor_parallel");
    }
  }
  for (const auto& np : module_->named_parameters(true)) {
    const auto partial = tensor_parallel_partial_gradient(np.value());
    if (!partial || partial->size() == 1) continue;
    if (partial != tp) {
      throw std::invalid_argument("fsdp: parameter '" + np.key() + "' is named by a partial_gradient_rule of a "
                                  "TensorParallel that is not Options::tensor_parallel: set Options::tensor_parallel "
                                  "to the TensorParallel the plan used");
    }
  }
  if (tp && tp->size() > 1 && mesh_ != tp->data_parallel()) {
    throw std::invalid_argument("fsdp: with Options::tensor_parallel of " + std::to_string(tp->size()) +
                                " ranks, wrap the model over tensor_parallel->data_parallel() (the " +
                                std::to_string(tp->data_parallel()->world_size()) + " data-parallel ranks), not " +
                                "a mesh of " + std::to_string(mesh_->world_size()));
  }
}

void ShardedRoot::check_tensor_parallel_replicas() {
  // Each TP rank keeps its part of the model it built: parts of models built from different seeds
  // (or with weights loaded on some ranks only) are no model at all, and sync_module_states cannot
  // mend that (it broadcasts whole tensors within the data-parallel mesh and the replicated ones
  // over the TP group, never a split one's parts). Ranks that built different models differ in
  // their replicated parameters too: compared here, after the data-parallel broadcast if any.
  const auto& tp = options_.tensor_parallel;
  if (!tp || tp->size() == 1) return;
  std::vector<at::Tensor> replicated;
  std::vector<std::string> names;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& np : module_->named_parameters(true)) {
    const at::Tensor& p = np.value();
    if (ignored_.count(p.unsafeGetTensorImpl()) || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    const auto placement = tensor_parallel_placement(p);
    if (placement && placement->tp->size() > 1) continue;
    replicated.push_back(p);
    names.push_back(np.key());
  }
  const auto differ = differ_across_tensor_parallel(*tp, replicated);
  if (differ.empty()) return;
  throw std::invalid_argument(
      "fsdp: the " + std::to_string(tp->size()) + " tensor-parallel ranks of this job built different models: "
      "replicated parameter '" + names[differ[0]] + "'" + (differ.size() > 1 ? " (and " + std::to_string(differ.size() - 1) +
      " more)" : "") + " differs across the TP group. Each TP rank keeps its part of the model it built, so every rank "
      "must build the model whole from the same seed (torch::manual_seed before constructing it) and load the same "
      "weights, before fsdp::parallelize; sync_module_states cannot join parts of different models into one.");
}

void ShardedRoot::check_inputs(const std::vector<at::Tensor>& inputs) {
  const auto& tp = options_.tensor_parallel;
  // Every forward, not the first only: an evaluation forward on a shared batch may come first,
  // and the vocabulary-parallel lookup would hide the slip from every later check (its all-reduce
  // sums the TP ranks' different rows into one activation all of them hold).
  if (!checks_inputs_ || !tp) return;
  const auto differ = differ_across_tensor_parallel(*tp, inputs);
  if (!differ.empty()) {
    throw Refusal("fsdp: the " + std::to_string(tp->size()) + " tensor-parallel ranks of data-parallel rank " +
                  std::to_string(mesh_->rank()) + " gave forward different inputs (argument " +
                  std::to_string(differ[0] + 1) + "): the TP ranks of a data-parallel group compute one model on the "
                  "same rows. Slice the global batch by the data-parallel rank and size "
                  "(tp->data_parallel()->rank() of tp->data_parallel()->world_size()), not by the world rank, and "
                  "give every TP rank the same data order.");
  }
}

void ShardedRoot::check_not_wrapped_already() const {
  // A parameter another wrapper already points at its shard (or gathered copy) carries fsdp's key:
  // wrapping it again would flatten that wrapper's 1-D shards as if they were the parameters (its
  // ranks' shapes differ) or, with F = 1, take the parameters away from the first wrapper. Local
  // and alike on every rank: refused before any collective.
  for (const auto& np : module_->named_parameters(true)) {
    if (ignored_.count(np.value().unsafeGetTensorImpl()) || !param_key::has_key(np.value())) continue;
    throw std::invalid_argument(
        "fsdp: parameter '" + np.key() + "' already belongs to a FullyShardedDataParallel (it holds that wrapper's "
        "shard, even after the wrapper is gone): a model, or a module inside it, is wrapped once. Wrap the whole "
        "model once, and make the modules that should be units of their own units with fsdp::fully_shard(*module) "
        "or Options::auto_wrap_policy before wrapping it. To run it again, call the first wrapper's forward (under "
        "torch::NoGradGuard for inference); for a plain copy, take fsdp::full_state_dict or fsdp::export_full from "
        "the first wrapper and load it into a newly built model.");
  }
}

void ShardedRoot::check_no_new_parameters() const {
  // A parameter the model gained after wrapping (a registered adapter, a replaced layer) is in no
  // unit: never sharded, gathered or reduced, so every rank would train its own copy on its own
  // rows. Local and alike on every rank (the same model): refused before the forward's first
  // collective. One walk of the parameters per forward.
  for (const auto& np : module_->named_parameters(true)) {
    if (wrapped_params_.count(np.value().unsafeGetTensorImpl())) continue;
    throw Refusal("fsdp: parameter '" + np.key() + "' was registered after the model was wrapped (a submodule "
                  "registered or replaced since): it is in no unit, so every rank would train its own copy of it "
                  "on its own rows, never averaged. Register every submodule before wrapping the model (or wrap a new "
                  "model that has it), or take it away again (unregister_module) to go on; a module whose parameters "
                  "are yours to keep consistent goes in Options::ignored_modules, before wrapping.");
  }
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

Metrics ShardedRoot::metrics() const {
  Metrics m;
  m.step = step_;
  m.comm = comm_->bytes();
  m.quantization = comm_->quantization_tally().read();
  m.memory = runtime_->memory();
  m.overlap = runtime_->overlap();
  m.detection = runtime_->detection();
  m.phases = runtime_->phases();
  m.device = device_memory_stats(device_);
  m.device.num_alloc_retries -= alloc_retries_at_reset_;
  m.memory.sharded_grads = 0;
  for (const auto& u : units_) m.memory.sharded_grads += u->reduction().sharded_grad_bytes();
  return m;
}

void ShardedRoot::reset_step() {
  comm_->bytes() = CommBytes{};
  comm_->quantization_tally() = QuantizationTally{};
  runtime_->reset_step();
  comm_->timeline().clear();
  reset_device_peaks(device_);
  alloc_retries_at_reset_ = device_memory_stats(device_).num_alloc_retries;
  ++step_;
}

double ShardedRoot::clip_grad_norm(double max_norm, const std::vector<at::Tensor>& model_parallel) {
  runtime_->check_not_failed();
  throw_pending_refusal();
  TORCH_CHECK(runtime_->at_rest(), "fsdp: clip_grad_norm_ must be called after backward, before the optimizer step, "
                                   "not between a forward and its backward");
  runtime_->check_no_unreduced_gradients("clip_grad_norm_");
  std::vector<const Unit*> units;
  for (const auto& u : units_) units.push_back(u.get());
  for (const auto& p : model_parallel) {
    if (!ignored_.count(p.unsafeGetTensorImpl())) {
      throw std::invalid_argument(
          "fsdp: clip_grad_norm_: a tensor listed as model-parallel is not among the parameters fsdp ignores "
          "(Options::ignored_modules / ignored_parameters): fsdp's own parameters are counted already, so listing "
          "one would count it twice. List only the ignored parameters each rank holds its own part of.");
    }
  }
  struct ClipPhase {
    Runtime& rt;
    bool opened;
    ~ClipPhase() {
      if (opened) rt.close_phase(StepPhase::CLIP);
    }
  } clip_phase{*runtime_, runtime_->open_phase(StepPhase::CLIP)};
  return fsdp::clip_grad_norm(units, *comm_, max_norm, model_parallel, options_.tensor_parallel.get());
}

void ShardedRoot::summon(bool rank0_only, bool writeback) {
  runtime_->check_not_failed();
  throw_pending_refusal();
  TORCH_CHECK(!summoned_, "fsdp: summon_full_params is already active for this model; end the first scope first");
  TORCH_CHECK(!(rank0_only && writeback), "fsdp: summon_full_params(rank0_only, writeback) cannot write back: only "
                                          "rank 0 holds the whole parameters. Pass writeback = false.");
  TORCH_CHECK(runtime_->at_rest(), "fsdp: summon_full_params must be called outside forward and backward, not "
                                   "between a forward and its backward");
  TORCH_CHECK(!runtime_->any_pinned(), "fsdp: summon_full_params inside an unshard() scope: the scope holds units "
                                       "gathered for forward and backward. End the unshard() scope first (let the "
                                       "object unshard() returned go out of scope), then summon.");
  const bool keep = !rank0_only || mesh_->rank() == 0;
  for (auto& u : units_) u->handle().summon(keep);
  if (options_.tensor_parallel && options_.tensor_parallel->size() > 1) {
    // Whole tensors, not this TP rank's parts (wrap/tensor_parallel_summon.h).
    try {
      tp_summon_.begin(*module_, keep);
    } catch (...) {
      for (auto& u : units_) u->handle().end_summon(false);
      throw;
    }
  }
  summoned_ = true;
  summon_writes_ = writeback;
  runtime_->set_summoned(true);
}

void ShardedRoot::check_checkpointable(const char* what) {
  runtime_->check_not_failed();
  throw_pending_refusal();
  TORCH_CHECK(!summoned_, "fsdp: ", what, " cannot run inside a summon_full_params scope; end it first");
  TORCH_CHECK(runtime_->at_rest(), "fsdp: ", what, " must be called outside forward and backward, not between a "
                                   "forward and its backward");
}

void ShardedRoot::end_summon(bool writeback) noexcept {
  // Each rank writes back only its own shard of what it holds: a change made on some ranks only
  // would land half-applied (F = W: the elements the changing ranks own) or on some replicas only
  // (F < W), and training would go on from parameters no single process has. Compared first.
  const bool asked = writeback && summon_writes_;
  writeback = asked;
  const bool split = tp_summon_.active();
  if (asked && split) {
    // Under TP each rank holds every parameter whole: compared across the TP ranks too (a change
    // made on some TP ranks only would leave the replicated copies and the parts apart).
    try {
      const std::string name = tp_summon_.differing(*module_);
      if (!name.empty()) {
        writeback = false;
        pending_refusal_ =
            "fsdp: summon_full_params: the whole parameters written back when the scope ended differ across the "
            "tensor-parallel ranks (parameter '" + name + "', and maybe more): a change made on some TP ranks only "
            "would have left the replicated copies and the split parts apart. The changes were discarded on every "
            "rank: the model is as it was before the scope. Make the same change on every rank.";
      }
    } catch (const std::exception& e) {
      writeback = false;
      pending_refusal_ = std::string("fsdp: summon_full_params: the check that every TP rank wrote back the same "
                                     "values failed, so nothing was written back: ") + e.what();
    }
  }
  tp_summon_.end(writeback);
  if (writeback && mesh_->world_size() > 1) writeback = summoned_values_agree();
  if (asked && split) {
    // The data-parallel check ran per TP place: every rank keeps or discards together.
    try {
      if (tp_summon_.verdicts_differ(writeback)) {
        writeback = false;
        if (pending_refusal_.empty()) {
          pending_refusal_ = "fsdp: summon_full_params: the whole parameters written back differ across the ranks of "
                             "another tensor-parallel place's data-parallel group; the changes were discarded on every "
                             "rank. Make the same change on every rank.";
        }
      }
    } catch (const std::exception& e) {
      writeback = false;
      pending_refusal_ = std::string("fsdp: summon_full_params: the writeback check failed: ") + e.what();
    }
  }
  for (auto& u : units_) u->handle().end_summon(writeback);
  summoned_ = false;
  summon_writes_ = false;
  runtime_->set_summoned(false);
}

bool ShardedRoot::summoned_values_agree() {
  try {
    std::vector<int64_t> sums;
    for (const auto& u : units_) {
      for (int64_t h : u->handle().summoned_checksums()) sums.push_back(h & ((1LL << 62) - 1));
    }
    if (sums.empty()) return true;
    // max(h) and max(-h) per parameter in one all-reduce: equal on every rank exactly when they cancel.
    const int64_t n = static_cast<int64_t>(sums.size());
    at::Tensor t = at::empty({2 * n}, at::kLong);
    for (int64_t i = 0; i < n; ++i) {
      t[i] = sums[static_cast<size_t>(i)];
      t[n + i] = -sums[static_cast<size_t>(i)];
    }
    InFlight f = comm_->issue(CommKind::SEQUENCE_CHECK, Over::WORLD, -1, "the summon_full_params writeback check",
                              [&] { return Buffers{t, at::Tensor()}; });
    comm_->wait(f);
    const auto* v = t.data_ptr<int64_t>();
    int64_t i = 0;
    while (i < n && v[i] + v[n + i] == 0) ++i;
    if (i == n) return true;
    std::string fqn, unit;
    for (const auto& u : units_) {
      const auto& entries = u->handle().layout().entries();
      if (i < static_cast<int64_t>(entries.size())) {
        fqn = entries[static_cast<size_t>(i)].fqn;
        unit = u->name();
        break;
      }
      i -= static_cast<int64_t>(entries.size());
    }
    pending_refusal_ =
        "fsdp: summon_full_params: the whole parameters written back when the scope ended differ across ranks "
        "(parameter '" + fqn + "' of unit '" + unit + "', and maybe more): each rank would have kept its own "
        "change in its own shard, and training would have gone on from parameters no single process holds. The "
        "changes were discarded on every rank: the model is as it was before the scope. Make the same change on "
        "every rank (compute or load the values on every rank, or broadcast rank 0's first), or use "
        "summon_full_params({.writeback = false}) to change nothing.";
  } catch (const std::exception& e) {
    pending_refusal_ = std::string("fsdp: summon_full_params: the check that every rank wrote back the same values "
                                   "failed, so nothing was written back: ") + e.what();
  }
  return false;
}

void ShardedRoot::throw_pending_refusal() {
  if (pending_refusal_.empty()) return;
  const std::string what = std::move(pending_refusal_);
  pending_refusal_.clear();
  throw Refusal(what);
}

std::vector<std::pair<std::string, at::Tensor>> ShardedRoot::unique_named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& item : module_->named_parameters(true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  }
  return out;
}

std::vector<UnitInfo> ShardedRoot::units() const {
  std::vector<UnitInfo> out;
  for (const auto& u : units_) {
    const FlatParamHandle& h = u->handle();
    UnitInfo info;
    info.name = u->name();
    info.fqns.reserve(h.layout().entries().size());
    for (const auto& e : h.layout().entries()) info.fqns.push_back(e.fqn);
    info.numel = h.layout().numel();
    info.padded_numel = h.layout().padded_numel();
    info.shard_numel = h.layout().shard_numel();
    info.element_size = static_cast<int64_t>(c10::elementSize(h.dtypes().master));
    info.is_root = u->is_root();
    out.push_back(std::move(info));
  }
  return out;
}

std::vector<size_t> ShardedRoot::unit_indices(const std::vector<std::string>& names) const {
  std::vector<size_t> out;
  if (names.empty()) {
    for (size_t u = 0; u < units_.size(); ++u) out.push_back(u);
    return out;
  }
  for (const std::string& name : names) {
    size_t u = 0;
    while (u < units_.size() && units_[u]->name() != name) ++u;
    if (u == units_.size()) {
      std::string known;
      for (const auto& unit : units_) known += (known.empty() ? "'" : ", '") + unit->name() + "'";
      throw std::invalid_argument("fsdp: unshard(): '" + name + "' is not a unit of this model; its units are " + known +
                                  " ('' is the root unit)");
    }
    out.push_back(u);
  }
  return out;
}

void ShardedRoot::write_trace(const std::string& path) const {
  std::vector<std::string> names;
  for (const auto& u : units_) names.push_back(u->name());
  write_chrome_trace(path, comm_->timeline().spans(), names, mesh_->rank());
}

}  // namespace fsdp::detail
