// What a wrapped model answers through the public API (sharded_root.h): metrics and their reset,
// gradient clipping, its parameters and units, unit names resolved, the Chrome trace. Reads of the
// built model, apart from building it (sharded_root.cpp).
#include "wrap/sharded_root.h"

#include <set>
#include <stdexcept>

#include "observe/chrome_trace.h"
#include "memory/device.h"
#include "engine/grad_norm.h"

namespace fsdp::detail {

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
