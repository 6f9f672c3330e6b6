#include "runtime.h"

#include "device.h"
#include "fsdp/deferred_init.h"

#include <cmath>
#include <set>
#include <sstream>

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace fsdp {
namespace {

// Fires inside AccumulateGrad once a parameter's gradient for this backward is complete: the
// paper's signal for "this unit's gradients may be reduced now" (§4.3).
struct GradReadyHook : torch::autograd::PostAccumulateGradHook {
  GradReadyHook(std::weak_ptr<Runtime> rt, size_t unit, size_t param) : rt_(std::move(rt)), unit_(unit), param_(param) {}
  void operator()(const torch::autograd::Variable&) override {
    if (auto rt = rt_.lock()) rt->on_grad_accumulated(unit_, param_);
  }
  std::weak_ptr<Runtime> rt_;
  size_t unit_, param_;
};

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

}  // namespace

Runtime::Runtime(std::shared_ptr<torch::nn::Module> root, std::shared_ptr<Mesh> mesh, Options options)
    : root_(std::move(root)), mesh_(std::move(mesh)), options_(std::move(options)) {
  TORCH_CHECK(root_ && mesh_, "fsdp: FullyShardedDataParallel needs a module and a mesh");
  const int W = mesh_->world_size();
  shard_size_ = sharding_factor(options_, W, mesh_->env().local_world_size);
  reshard_after_forward_ = reshards_after_forward(options_.strategy);

  plans_ = decompose(*root_, options_.auto_wrap_policy);

  // Every rank must cut the same model the same way, or the collectives below would pair up
  // different buffers (or hang): compare a fingerprint before the first collective on parameters.
  std::ostringstream desc;
  desc << "strategy " << to_string(options_.strategy) << " F=" << shard_size_ << "\n";
  if (const auto& mp = options_.mixed_precision) {
    desc << "mixed precision param " << dtype_name(mp->param_dtype) << " reduce " << dtype_name(mp->reduce_dtype)
         << " buffer " << dtype_name(mp->buffer_dtype) << " keep_low_precision_grads " << mp->keep_low_precision_grads << "\n";
  }
  for (const auto& item : root_->named_parameters(true)) {
    desc << "param " << item.key() << " " << item.value().sizes() << " " << item.value().dtype()
         << " requires_grad=" << item.value().requires_grad() << "\n";
  }
  for (const auto& u : plans_) {
    desc << "unit '" << u.name << "':";
    for (const auto& f : u.fqns) desc << " " << f;
    desc << "\n";
  }
  mesh_->check_same_on_all_ranks("the model structure (parameter names, shapes, dtypes) or the FSDP options",
                                 fnv1a(desc.str()), desc.str());

  // Where the shards will live: the parameters' device, the CPU for a deferred (meta) model, or
  // init_device. Its type picks the backend: Gloo for CPU, NCCL for CUDA.
  const bool deferred = !plans_.empty() && !plans_[0].params.empty() && plans_[0].params[0].is_meta();
  device_ = plans_.empty() || plans_[0].params.empty() || deferred ? c10::Device(c10::kCPU) : plans_[0].params[0].device();
  if (options_.init_device) device_ = *options_.init_device;
  if (deferred) {
    if (options_.sync_module_states) {
      throw std::invalid_argument("fsdp: sync_module_states with a deferred_init model: there is nothing to broadcast "
                                  "yet, and replaying the recorded initialization gives every rank the same values "
                                  "when every rank built the model with the same seed; drop sync_module_states");
    }
    materialize_buffers();
  }
  const ShardingGroups& groups = mesh_->groups(shard_size_, device_.type());
  TORCH_CHECK(options_.prefetch_count >= 1, "fsdp: prefetch_count must be >= 1, got ", options_.prefetch_count);
  streams_ = std::make_unique<CommStreams>(device_);
  limiter_ = std::make_unique<RateLimiter>(options_.limit_all_gathers, /*device_frees=*/streams_->active());
  // Gloo runs up to this many collectives of one group at once (mesh.cpp); NCCL one per stream.
  timeline_.set_workers_per_group(streams_->active() ? 1 : kGlooThreadsPerGroup);
  HandleConfig cfg;
  cfg.shard_size = shard_size_;
  cfg.shard_rank = mesh_->rank() % shard_size_;
  cfg.world_size = W;
  cfg.shard_group = groups.shard;
  cfg.replicate_group = groups.replicate;
  cfg.streams = streams_.get();
  cfg.mixed_precision = options_.mixed_precision;
  cfg.device = options_.init_device;
  if (options_.sync_module_states) broadcast_module_states();
  if (const auto& mp = options_.mixed_precision) {
    // Buffers are not sharded: cast them once, here, instead of at every forward.
    at::NoGradGuard no_grad;
    for (auto& b : root_->buffers(true)) {
      if (b.defined() && at::isFloatingType(b.scalar_type())) b.set_data(b.to(mp->buffer_dtype));
    }
  }
  cfg.timeline = &timeline_;
  shard_group_ = groups.shard;
  for (size_t u = 0; u < plans_.size(); ++u) {
    handles_.push_back(std::make_unique<FlatParamHandle>(plans_[u].name.empty() ? "<root>" : plans_[u].name,
                                                         plans_[u].fqns, plans_[u].params, cfg, &comm_,
                                                         static_cast<int>(u)));
    touch::register_storage(this, u, handles_[u]->shard_storage());
    if (handles_[u]->has_unsharded_buffer()) touch::register_storage(this, u, handles_[u]->unsharded_storage());
    for (size_t i = 0; i < plans_[u].params.size(); ++i) {
      param_index_.emplace(plans_[u].params[i].unsafeGetTensorImpl(), std::make_pair(u, i));
    }
    if (plans_[u].is_root) root_unit_ = u;
  }
  expected_.resize(handles_.size());
  for (size_t u = 0; u < handles_.size(); ++u) expected_[u].assign(handles_[u]->params().size(), false);
  expected_count_.assign(handles_.size(), 0);
  ready_count_.assign(handles_.size(), 0);
  forward_span_.assign(handles_.size(), std::nullopt);
  backward_span_.assign(handles_.size(), std::nullopt);
  backward_started_.assign(handles_.size(), false);
  backward_done_.assign(handles_.size(), false);
  for (const auto& h : handles_) memory_.sharded_params += h->sharded_param_bytes();
}

void Runtime::materialize_buffers() {
  // Buffers are not sharded: each is materialized whole, on the target device.
  for (auto& b : root_->buffers(true)) {
    if (!b.defined() || !is_deferred(b)) continue;
    at::Tensor value = at::empty(b.sizes(), b.options().device(c10::kCPU));
    materialize_into(b, value);
    at::Tensor target = value.to(device_);
    adopt(b, target);
  }
}

void Runtime::broadcast_module_states() {
  // Rank 0's values win; parameters and buffers in registration order, which the fingerprint
  // above has already shown to be the same on every rank. One group of all W ranks.
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> tensors;
  std::set<const c10::TensorImpl*> seen;  // a tied weight once
  for (const auto& p : root_->parameters(true)) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) tensors.push_back(p.detach());
  }
  for (const auto& b : root_->buffers(true)) {
    if (b.defined()) tensors.push_back(b.detach());
  }
  if (tensors.empty() || mesh_->world_size() == 1) return;
  // On the tensors' own device (they have not moved to init_device yet).
  const GroupPtr& group = mesh_->groups(mesh_->world_size(), tensors[0].device().type()).shard;
  for (auto& t : tensors) {
    std::vector<at::Tensor> one{t};
    c10d::BroadcastOptions opts;
    opts.rootRank = 0;
    wait_for(group->broadcast(one, opts), "broadcast of rank 0's parameters and buffers (sync_module_states)");
  }
}

void Runtime::install_hooks() {
  for (size_t u = 0; u < handles_.size(); ++u) {
    const auto& params = handles_[u]->params();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].requires_grad()) continue;
      // Runs just before AccumulateGrad: the parameter must have its unsharded shape then, even
      // when no backward operator read it (the first layer's weight when the input needs no grad).
      std::weak_ptr<Runtime> weak = weak_from_this();
      at::Tensor(params[i]).register_hook([weak, u](const at::Tensor&) {
        if (auto rt = weak.lock()) rt->on_grad_arriving(u);
      });
      torch::autograd::impl::set_post_acc_grad_hooks(
          params[i], std::make_unique<GradReadyHook>(weak_from_this(), u, i));
    }
  }
}

Runtime::~Runtime() { touch::unregister_sink(this); }

bool Runtime::contains(size_t outer, size_t inner) const {
  return plans_[outer].subtree.count(plans_[inner].module) > 0;
}

void Runtime::note_memory() {
  int64_t cur = 0, grads = 0;
  for (const auto& h : handles_) {
    cur += h->unsharded_bytes();
    grads += h->unsharded_grad_bytes();
  }
  memory_.unsharded_current = cur;
  memory_.unsharded_peak = std::max(memory_.unsharded_peak, cur);
  memory_.unsharded_grads_current = grads;
  memory_.unsharded_grads_peak = std::max(memory_.unsharded_grads_peak, grads);
}

void Runtime::gather(size_t unit, bool backward_pass) {
  if (handles_[unit]->state() != HandleState::SHARDED) return;
  touch::Suppress own_work;
  if (shard_size_ > 1) {
    const int64_t t0 = Timeline::now_ns();
    if (const int64_t blocked = limiter_->before_issue()) {
      timeline_.add(SpanKind::RATE_LIMIT, static_cast<int>(unit), backward_pass, t0, t0 + blocked);
      overlap_.rate_limiter_wait_ns += blocked;
    }
  }
  if (WorkPtr work = handles_[unit]->begin_unshard(backward_pass)) {
    limiter_->issued(unit, std::move(work));
    overlap_.max_all_gathers_in_flight = std::max(overlap_.max_all_gathers_in_flight, limiter_->in_flight());
  }
  note_memory();
}

void Runtime::use(size_t unit, bool backward_pass) {
  if (handles_[unit]->state() == HandleState::UNSHARDED) return;  // the common case: one check per operator
  gather(unit, backward_pass);
  if (handles_[unit]->state() != HandleState::GATHERING) return;
  touch::Suppress own_work;
  overlap_.exposed_all_gather_ns += handles_[unit]->finish_unshard();
  limiter_->consumed(unit);
}

void Runtime::reshard_unit(size_t unit) {
  if (handles_[unit]->state() == HandleState::SHARDED) return;
  touch::Suppress own_work;
  if (handles_[unit]->state() == HandleState::GATHERING) {
    // A prefetch nobody used: its buffer can only be freed once the collective is done with it.
    overlap_.exposed_all_gather_ns += handles_[unit]->finish_unshard();
  }
  handles_[unit]->reshard();
  if (shard_size_ > 1) limiter_->freed(unit, streams_->mark_compute());
  note_memory();
}

void Runtime::begin_forward() {
  TORCH_CHECK(phase_ != Phase::BACKWARD && phase_ != Phase::FORWARD,
              "fsdp: the root's forward was called inside its own forward or backward; "
              "call it once per micro-batch, outside backward");
  if (phase_ == Phase::IDLE) {
    for (auto& h : handles_) h->stash_grads();
    order_.start_iteration();
    touch::arm(this);
  }
  phase_ = Phase::FORWARD;
  touch::set_forward_thread(true);
}

void Runtime::forward_begins(size_t unit) {
  order_.forward_started(unit);
  gather(unit, false);
  if (options_.forward_prefetch) {
    // Issued before this unit's all-gather is waited for: both are in flight while it arrives.
    const auto next = order_.next_in_forward(unit, options_.prefetch_count, [](size_t) { return false; });
    for (size_t v : next) gather(v, false);
  }
  use(unit, false);
  forward_span_[unit] = timeline_.begin(SpanKind::FORWARD, static_cast<int>(unit), false);
}

void Runtime::forward_ends(size_t unit) {
  if (forward_span_[unit]) timeline_.end(*forward_span_[unit]);
  forward_span_[unit].reset();
  order_.forward_ended(unit);
}

void Runtime::end_forward(const std::vector<at::Tensor>& outputs, bool ok) {
  touch::set_forward_thread(false);
  if (current_unit_) forward_ends(*current_unit_);
  current_unit_.reset();
  if (root_unit_ && forward_span_[*root_unit_]) forward_ends(*root_unit_);
  bool builds_graph = false;
  if (ok) {
    for (const auto& out : outputs) {
      if (!out.defined() || !out.requires_grad()) continue;
      builds_graph = true;
      // The first gradient reaching a root output marks the start of backward.
      std::weak_ptr<Runtime> weak = weak_from_this();
      at::Tensor(out).register_hook([weak](const at::Tensor&) {
        if (auto rt = weak.lock()) rt->on_backward_started();
      });
    }
  }
  backward_pending_ = backward_pending_ || builds_graph;
  for (size_t u = 0; u < handles_.size(); ++u) {
    // Also frees forward prefetches that were not used (the guess from the last iteration was off).
    if (!ok || (reshard_after_forward_ && u != root_unit_)) reshard_unit(u);
  }
  if (backward_pending_) {
    phase_ = Phase::FORWARD_DONE;
  } else {
    end_iteration();  // inference, or a forward without grad: nothing will come back
  }
}

void Runtime::on_touch(size_t unit, const c10::TensorImpl* tensor) {
  switch (phase_) {
    case Phase::FORWARD: {
      if (unit != root_unit_) {
        // The previous unit's forward is over once another unit (not nested in it) starts.
        if (current_unit_ && *current_unit_ != unit && !contains(*current_unit_, unit)) {
          forward_ends(*current_unit_);
          if (reshard_after_forward_) reshard_unit(*current_unit_);
        }
        if (current_unit_ != unit && !forward_span_[unit]) forward_begins(unit);
        current_unit_ = unit;
      } else if (!forward_span_[unit]) {
        forward_begins(unit);  // the root, at its first operator of each forward
      }
      use(unit, false);
      if (c10::GradMode::is_enabled()) {
        auto it = param_index_.find(tensor);
        if (it != param_index_.end() && it->second.first == unit) {
          const size_t i = it->second.second;
          if (!expected_[unit][i] && handles_[unit]->params()[i].requires_grad()) {
            expected_[unit][i] = true;
            ++expected_count_[unit];
          }
        }
      }
      break;
    }
    case Phase::FORWARD_DONE:
    case Phase::BACKWARD:
      backward_needs(unit);
      break;
    case Phase::IDLE:
      break;
  }
}

void Runtime::on_backward_started() {
  if (phase_ != Phase::FORWARD_DONE) return;
  phase_ = Phase::BACKWARD;
  std::weak_ptr<Runtime> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto rt = weak.lock()) rt->finish_backward();
  });
}

void Runtime::backward_needs(size_t unit) {
  on_backward_started();
  if (phase_ != Phase::BACKWARD) return;
  if (backward_started_[unit]) {
    use(unit, true);
    return;
  }
  backward_started_[unit] = true;
  gather(unit, true);
  if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_PRE) prefetch_backward(unit);
  use(unit, true);
  backward_span_[unit] = timeline_.begin(SpanKind::BACKWARD, static_cast<int>(unit), true);
}

void Runtime::prefetch_backward(size_t unit) {
  // The root stays gathered through backward; units whose backward is over need nothing more.
  const auto next = order_.next_in_backward(unit, options_.prefetch_count, [this](size_t u) {
    return u == root_unit_ || backward_done_[u] || backward_started_[u];
  });
  for (size_t v : next) gather(v, true);
}

void Runtime::on_grad_arriving(size_t unit) { backward_needs(unit); }

void Runtime::on_grad_accumulated(size_t unit, size_t param) {
  on_backward_started();
  if (phase_ != Phase::BACKWARD || !expected_[unit][param]) return;
  if (++ready_count_[unit] != expected_count_[unit]) return;
  // Every gradient forward made possible for this unit is in: its backward is over.
  if (backward_span_[unit]) timeline_.end(*backward_span_[unit]);
  backward_span_[unit].reset();
  backward_done_[unit] = true;
  if (options_.backward_prefetch == BackwardPrefetch::BACKWARD_POST) prefetch_backward(unit);
  reduce_unit(unit);
  reshard_unit(unit);
}

void Runtime::reduce_unit(size_t unit) {
  touch::Suppress own_work;
  // A unit reduced twice in one backward: finish everything issued so far first, in issue order,
  // so its all-reduce cannot overtake another unit's on some ranks only.
  if (handles_[unit]->reduce_pending()) finish_reductions();
  handles_[unit]->begin_reduce(no_sync_, phase_ == Phase::BACKWARD);
  if (handles_[unit]->reduce_pending()) reduce_fifo_.push_back(unit);
  advance_reductions();
}

void Runtime::advance_reductions() {
  // In issue order, stopping at the first reduce-scatter still running: the all-reduces across
  // replicas then go out in the same order on every rank, whatever the timing.
  for (size_t u : reduce_fifo_) {
    if (handles_[u]->advance_reduce()) break;
  }
}

void Runtime::finish_reductions() {
  touch::Suppress own_work;
  for (size_t u : reduce_fifo_) overlap_.exposed_reduce_ns += handles_[u]->finish_reduce();
  reduce_fifo_.clear();
}

void Runtime::finish_backward() {
  touch::Suppress own_work;
  finish_reductions();
  // Units whose gradients did not all arrive through the hooks (a parameter forward touched whose
  // gradient never flowed) are reduced here, in unit order, the same on every rank.
  for (size_t u = 0; u < handles_.size(); ++u) {
    if (backward_span_[u]) timeline_.end(*backward_span_[u]);
    backward_span_[u].reset();
    if (handles_[u]->has_unreduced_grads()) reduce_unit(u);
  }
  finish_reductions();
  note_memory();
  end_iteration();
}

void Runtime::end_iteration() {
  for (size_t u = 0; u < handles_.size(); ++u) {
    reshard_unit(u);
    handles_[u]->restore_grads();
    std::fill(expected_[u].begin(), expected_[u].end(), false);
    if (forward_span_[u]) timeline_.end(*forward_span_[u]);
    forward_span_[u].reset();
  }
  std::fill(expected_count_.begin(), expected_count_.end(), 0);
  std::fill(ready_count_.begin(), ready_count_.end(), 0);
  std::fill(backward_started_.begin(), backward_started_.end(), false);
  std::fill(backward_done_.begin(), backward_done_.end(), false);
  backward_pending_ = false;
  current_unit_.reset();
  phase_ = Phase::IDLE;
  touch::disarm(this);
}

Metrics Runtime::metrics() const {
  Metrics m;
  m.step = step_;
  m.comm = comm_;
  m.memory = memory_;
  m.overlap = overlap_;
  m.device = device_memory_stats(device_);
  m.device.num_alloc_retries -= alloc_retries_at_reset_;
  m.memory.sharded_grads = 0;
  for (const auto& h : handles_) m.memory.sharded_grads += h->sharded_grad_bytes();
  return m;
}

void Runtime::reset_step() {
  comm_ = CommBytes{};
  memory_.unsharded_peak = memory_.unsharded_current;
  memory_.unsharded_grads_peak = memory_.unsharded_grads_current;
  overlap_ = OverlapStats{};
  limiter_->reset_max();
  timeline_.clear();
  reset_device_peaks(device_);
  alloc_retries_at_reset_ = device_memory_stats(device_).num_alloc_retries;
  ++step_;
}

double Runtime::clip_grad_norm(double max_norm) {
  TORCH_CHECK(phase_ == Phase::IDLE, "fsdp: clip_grad_norm_ must be called after backward, before the optimizer step");
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& h : handles_) {
    for (const auto& p : h->params()) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
  }
  at::Tensor sumsq = at::zeros({1}, handles_.empty() ? at::TensorOptions(at::kFloat)
                                                      : handles_[0]->params()[0].options().dtype(at::kFloat));
  for (const auto& g : grads) sumsq.add_(g.to(at::kFloat).pow(2).sum());
  // Each element of a flat parameter lives on exactly one rank of its shard group (replicas hold
  // copies), so the shard group's sum is the global sum of squares.
  if (shard_size_ > 1) {
    const int64_t before = comm_.all_reduce;
    WorkPtr work = all_reduce_sum(shard_group_, sumsq, comm_);
    const size_t span = timeline_.collective(SpanKind::ALL_REDUCE, -1, false, shard_group_.get(),
                                             comm_.all_reduce - before, work, !streams_->active(), sumsq.scalar_type());
    const int64_t t0 = Timeline::now_ns();
    wait_for(work, "all-reduce of the gradient norm");
    timeline_.completed(span);
    timeline_.add(SpanKind::WAIT, -1, false, t0, Timeline::now_ns(), SpanKind::ALL_REDUCE);
  }
  const at::Tensor total = sumsq.sqrt();
  const at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);
  for (auto& g : grads) g.mul_(coef.to(g.dtype()));
  return total.item<double>();
}

std::vector<UnitInfo> Runtime::units() const {
  std::vector<UnitInfo> out;
  for (size_t u = 0; u < handles_.size(); ++u) {
    UnitInfo info;
    info.name = plans_[u].name;
    info.fqns = plans_[u].fqns;
    info.numel = handles_[u]->layout().numel();
    info.padded_numel = handles_[u]->layout().padded_numel();
    info.shard_numel = handles_[u]->layout().shard_numel();
    info.element_size = handles_[u]->params()[0].element_size();
    info.is_root = plans_[u].is_root;
    out.push_back(std::move(info));
  }
  return out;
}

void Runtime::write_trace(const std::string& path) const {
  std::vector<std::string> names;
  for (const auto& p : plans_) names.push_back(p.name);
  write_chrome_trace(path, timeline_.spans(), names, mesh_->rank());
}

namespace detail {
std::shared_ptr<Runtime> make_runtime(std::shared_ptr<torch::nn::Module> root, std::shared_ptr<Mesh> mesh,
                                      Options options) {
  auto rt = std::make_shared<Runtime>(std::move(root), std::move(mesh), std::move(options));
  rt->install_hooks();
  return rt;
}
void begin_forward(Runtime& rt) { rt.begin_forward(); }
void end_forward(Runtime& rt, const std::vector<at::Tensor>& outputs, bool ok) { rt.end_forward(outputs, ok); }
Metrics metrics(const Runtime& rt) { return rt.metrics(); }
void reset_step(Runtime& rt) { rt.reset_step(); }
void set_no_sync(Runtime& rt, bool on) { rt.set_no_sync(on); }
double clip_grad_norm(Runtime& rt, double max_norm) { return rt.clip_grad_norm(max_norm); }
std::vector<UnitInfo> units(const Runtime& rt) { return rt.units(); }
std::vector<Span> timeline(const Runtime& rt) { return rt.timeline(); }
std::optional<c10::ScalarType> input_dtype(const Runtime& rt) {
  if (!rt.options().mixed_precision) return std::nullopt;
  return rt.options().mixed_precision->param_dtype;
}
void write_trace(const Runtime& rt, const std::string& path) { rt.write_trace(path); }
int shard_size(const Runtime& rt) { return rt.shard_size(); }
}  // namespace detail

}  // namespace fsdp
