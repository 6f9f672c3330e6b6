// The public wrapper's non-template part (include/fsdp/fsdp.h): forwards to the ShardedRoot.
#include "fsdp/fsdp.h"

#include "wrap/sharded_root.h"

namespace fsdp {

FullyShardedDataParallelBase::FullyShardedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                                           std::shared_ptr<Mesh> mesh, Options options)
    : root_(std::make_shared<detail::ShardedRoot>(std::move(module), std::move(mesh), std::move(options))) {}

void FullyShardedDataParallelBase::begin_forward() {
  root_->throw_pending_refusal();
  root_->check_no_new_parameters();
  root_->runtime().begin_forward();
}
void FullyShardedDataParallelBase::end_forward(bool ok) { root_->runtime().end_forward(ok); }

std::optional<c10::ScalarType> FullyShardedDataParallelBase::input_dtype() const {
  if (!root_->options().mixed_precision) return std::nullopt;
  return root_->options().mixed_precision->param_dtype;
}

bool FullyShardedDataParallelBase::checks_inputs() const { return root_->checks_inputs(); }
void FullyShardedDataParallelBase::check_inputs(const std::vector<at::Tensor>& inputs) { root_->check_inputs(inputs); }

FullyShardedDataParallelBase::NoSync::NoSync(detail::ShardedRoot* root) : root_(root) {
  root_->runtime().set_no_sync(true);
}
FullyShardedDataParallelBase::NoSync::~NoSync() {
  if (root_) root_->runtime().set_no_sync(false);
}
FullyShardedDataParallelBase::NoSync::NoSync(NoSync&& other) noexcept : root_(other.root_) { other.root_ = nullptr; }
FullyShardedDataParallelBase::NoSync FullyShardedDataParallelBase::no_sync() { return NoSync(root_.get()); }

FullyShardedDataParallelBase::FullParams::FullParams(detail::ShardedRoot* root, bool writeback)
    : root_(root), writeback_(writeback) {}
FullyShardedDataParallelBase::FullParams::FullParams(FullParams&& other) noexcept
    : root_(other.root_), writeback_(other.writeback_) {
  other.root_ = nullptr;
}
FullyShardedDataParallelBase::FullParams::~FullParams() {
  if (root_) root_->end_summon(writeback_);
}
FullyShardedDataParallelBase::FullParams FullyShardedDataParallelBase::summon_full_params(SummonOptions options) {
  root_->summon(options.rank0_only, options.writeback);
  return FullParams(root_.get(), options.writeback);
}

FullyShardedDataParallelBase::Unsharded::Unsharded(detail::ShardedRoot* root, std::vector<size_t> units)
    : root_(root), units_(std::move(units)) {}
FullyShardedDataParallelBase::Unsharded::Unsharded(Unsharded&& other) noexcept
    : root_(other.root_), units_(std::move(other.units_)) {
  other.root_ = nullptr;
}
FullyShardedDataParallelBase::Unsharded::~Unsharded() {
  if (root_) root_->runtime().unpin(units_);
}
FullyShardedDataParallelBase::Unsharded FullyShardedDataParallelBase::unshard(const std::vector<std::string>& unit_names) {
  root_->throw_pending_refusal();
  std::vector<size_t> units = root_->unit_indices(unit_names);
  root_->runtime().pin(units);
  return Unsharded(root_.get(), std::move(units));
}

std::vector<std::pair<std::string, at::Tensor>> FullyShardedDataParallelBase::named_parameters() const {
  return root_->unique_named_parameters();
}
std::vector<at::Tensor> FullyShardedDataParallelBase::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& kv : root_->unique_named_parameters()) out.push_back(kv.second);
  return out;
}

double FullyShardedDataParallelBase::clip_grad_norm_(double max_norm, const std::vector<at::Tensor>& model_parallel) {
  return root_->clip_grad_norm(max_norm, model_parallel);
}
FullyShardedDataParallelBase::PhaseScope FullyShardedDataParallelBase::record_phase(StepPhase phase) {
  const int p = static_cast<int>(phase);
  TORCH_CHECK(p >= 0 && p < kNumStepPhases, "fsdp: record_phase(", p, "): not a StepPhase; use StepPhase::FORWARD, ",
              "BACKWARD, CLIP or OPTIMIZER");
  return PhaseScope(root_, phase, root_->runtime().open_phase(phase));
}
FullyShardedDataParallelBase::PhaseScope::PhaseScope(PhaseScope&& other) noexcept
    : root_(std::move(other.root_)), phase_(other.phase_), opened_(other.opened_) {
  other.opened_ = false;
}
FullyShardedDataParallelBase::PhaseScope::~PhaseScope() {
  // The model may be gone (a scope kept past it): then there is nothing to close.
  if (!opened_) return;
  if (const auto root = root_.lock()) root->runtime().close_phase(phase_);
}

Metrics FullyShardedDataParallelBase::metrics() const { return root_->metrics(); }
void FullyShardedDataParallelBase::reset_step() { root_->reset_step(); }
std::vector<UnitInfo> FullyShardedDataParallelBase::units() const { return root_->units(); }
std::vector<Span> FullyShardedDataParallelBase::timeline() const { return root_->timeline(); }
void FullyShardedDataParallelBase::write_trace(const std::string& path) const { root_->write_trace(path); }
int FullyShardedDataParallelBase::shard_size() const { return root_->shard_size(); }

}  // namespace fsdp
