#include "flat_param_handle.h"

#include <c10/core/GradMode.h>

#include <c10/util/strides.h>

#include "device.h"
#include "fsdp/deferred_init.h"

namespace fsdp {
namespace {
// A tensor sharing `flat`'s storage at `offset` with `sizes`, made with set_ rather than a view
// op: autograd does not treat it as a view, so optimizers may detach_() it (zero_grad does).
at::Tensor alias(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

std::vector<std::vector<int64_t>> shapes_of(const std::vector<at::Tensor>& params) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : params) shapes.emplace_back(p.sizes().vec());
  return shapes;
}
}  // namespace

FlatParamHandle::FlatParamHandle(std::string name, std::vector<std::string> fqns,
                                 std::vector<at::Tensor> params, HandleConfig config, CommBytes* comm, int index)
    : name_(std::move(name)),
      layout_(fqns, shapes_of(params), config.shard_size),
      params_(std::move(params)),
      config_(std::move(config)),
      comm_(comm),
      index_(index) {
  TORCH_CHECK(!params_.empty(), "fsdp: unit '", name_, "' has no parameters");
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].dtype() == params_[0].dtype() && params_[i].device() == params_[0].device(),
                "fsdp: unit '", name_, "' mixes dtypes or devices (", fqns[0], " is ", params_[0].dtype(),
                " on ", params_[0].device(), ", ", fqns[i], " is ", params_[i].dtype(), " on ",
                params_[i].device(), "). Put parameters of different dtypes in different units.");
  }
  element_size_ = static_cast<int64_t>(params_[0].element_size());
  at::NoGradGuard no_grad;

  // Where the shard lives: the parameters' device, unless they are deferred (meta) or the caller
  // streams them to another device. Then the unit is assembled on the CPU (staged), one unit at a
  // time, and only its shard moves to the target.
  const bool deferred = params_[0].is_meta();
  const c10::Device target = config_.device.value_or(deferred ? c10::Device(c10::kCPU) : params_[0].device());
  const bool staged = deferred || params_[0].device() != target;
  const auto options = params_[0].options().requires_grad(false).device(staged ? c10::Device(c10::kCPU) : target);

  // Flatten, concatenate, right-pad (the padding is zero and stays zero: it never gets a gradient).
  full_ = at::zeros({layout_.padded_numel()}, options);
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries()[i];
    at::Tensor view = full_.narrow(0, e.offset, e.numel).view(e.shape);
    if (deferred) {
      // Replay the parameter's recorded initialization straight into the flat buffer, and make
      // the parameter an ordinary tensor again (same TensorImpl) before it is pointed anywhere.
      materialize_into(params_[i], view);
      adopt(params_[i], view);
    } else {
      view.copy_(params_[i].detach());
    }
    full_views_.push_back(view);
  }
  slices_ = layout_.slices(config_.shard_rank);
  if (config_.shard_size == 1) {
    // Replication: the shard is the whole flat parameter and parameters keep their shapes.
    shard_ = staged ? full_.to(target) : full_;
    for (const auto& e : layout_.entries()) sharded_views_.push_back(shard_.narrow(0, e.offset, e.numel).view(e.shape));
  } else {
    shard_ = full_.narrow(0, config_.shard_rank * layout_.shard_numel(), layout_.shard_numel()).to(target, /*non_blocking=*/false, /*copy=*/true);
    for (const auto& s : slices_) sharded_views_.push_back(shard_.narrow(0, s.shard_offset, s.length));
  }
  // Mixed precision applies to floating-point units; the unsharded buffer is then in param_dtype.
  const auto& mp = config_.mixed_precision;
  const bool cast = mp && at::isFloatingType(params_[0].scalar_type()) && mp->param_dtype != params_[0].scalar_type();
  compute_dtype_ = cast ? mp->param_dtype : params_[0].scalar_type();
  reduce_dtype_ = mp && at::isFloatingType(params_[0].scalar_type()) ? mp->reduce_dtype : params_[0].scalar_type();
  compute_element_size_ = static_cast<int64_t>(c10::elementSize(compute_dtype_));
  separate_buffer_ = config_.shard_size > 1 || cast;
  // Parameters point at their shards first, so that the flattening buffer (which adopted deferred
  // parameters still hold) is released before the next allocation: the peak stays at one unit
  // plus the shards.
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(sharded_views_[i]);
  if (config_.shard_size == 1 && !cast) {
    full_ = shard_;  // no separate buffer: the "unsharded" views are the shard's
    full_views_ = sharded_views_;
  } else if (cast || staged) {
    // The unsharded buffer on the target device, in the compute dtype. Its views must be made
    // while it has storage; it is emptied right after.
    full_views_.clear();
    full_ = at::Tensor();
    full_ = at::empty({layout_.padded_numel()}, options.device(target).dtype(compute_dtype_));
    for (const auto& e : layout_.entries()) full_views_.push_back(full_.narrow(0, e.offset, e.numel).view(e.shape));
  }
  if (separate_buffer_) resize_unsharded(false);
  grads_.resize(params_.size());
  no_sync_got_.assign(params_.size(), false);
}

FlatParamHandle::~FlatParamHandle() = default;

void FlatParamHandle::resize_unsharded(bool allocate) {
  resize_storage(full_, allocate ? static_cast<size_t>(layout_.padded_numel() * compute_element_size_) : 0);
}

int64_t FlatParamHandle::wait(const WorkPtr& work, SpanKind kind, size_t span, const char* what, bool backward_pass) {
  if (!work) return 0;
  // On CUDA wait() only orders the current stream after the collective: nothing blocks.
  const bool blocks = !config_.streams->active() && !work->isCompleted();
  const int64_t t0 = Timeline::now_ns();
  wait_for(work, what);
  config_.timeline->completed(span);
  if (!blocks) return 0;
  const int64_t t1 = Timeline::now_ns();
  config_.timeline->add(SpanKind::WAIT, index_, backward_pass, t0, t1, kind);
  return t1 - t0;
}

WorkPtr FlatParamHandle::begin_unshard(bool backward_pass) {
  if (state_ != HandleState::SHARDED) return nullptr;
  if (!separate_buffer_) {
    state_ = HandleState::UNSHARDED;
    return nullptr;
  }
  at::NoGradGuard no_grad;
  if (config_.shard_size == 1) {
    // Replication with mixed precision: the "gather" is the cast, on the compute stream.
    resize_unsharded(true);
    full_.copy_(shard_);
    for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(full_views_[i]);
    state_ = HandleState::UNSHARDED;
    return nullptr;
  }
  CommStreams::Issue on_stream(*config_.streams, CommKind::ALL_GATHER);
  // Allocated on the all-gather stream (on CUDA): the block is reused in that stream's order.
  resize_unsharded(true);
  // Mixed precision: cast once per unit, before the all-gather, which then moves param_dtype bytes.
  shard_cast_ = compute_dtype_ == shard_.scalar_type() ? shard_ : shard_.to(compute_dtype_);
  const int64_t before = comm_->all_gather;
  gather_work_ = all_gather_into(config_.shard_group, full_, shard_cast_, *comm_);
  gather_span_ = config_.timeline->collective(SpanKind::ALL_GATHER, index_, backward_pass, config_.shard_group.get(),
                                              comm_->all_gather - before, gather_work_, !config_.streams->active(),
                                              compute_dtype_);
  gather_backward_ = backward_pass;
  state_ = HandleState::GATHERING;
  return gather_work_;
}

int64_t FlatParamHandle::finish_unshard() {
  if (state_ != HandleState::GATHERING) return 0;
  const int64_t blocked = wait(gather_work_, SpanKind::ALL_GATHER, gather_span_, "all-gather of parameters", gather_backward_);
  gather_work_.reset();
  shard_cast_ = at::Tensor();
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(full_views_[i]);
  state_ = HandleState::UNSHARDED;
  return blocked;
}

void FlatParamHandle::reshard() {
  if (state_ == HandleState::GATHERING) finish_unshard();
  if (state_ == HandleState::SHARDED) return;
  if (separate_buffer_) {
    for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(sharded_views_[i]);
    resize_unsharded(false);
  }
  state_ = HandleState::SHARDED;
}

void FlatParamHandle::stash_grads() {
  for (size_t i = 0; i < params_.size(); ++i) {
    grads_[i] = params_[i].grad();
    if (grads_[i].defined()) params_[i].mutable_grad().reset();
  }
}

bool FlatParamHandle::has_unreduced_grads() const {
  for (const auto& p : params_) {
    if (p.grad().defined()) return true;
  }
  return false;
}

void FlatParamHandle::begin_reduce(bool no_sync, bool backward_pass) {
  if (pending_) finish_reduce();  // one reduction per unit at a time, in issue order
  at::NoGradGuard no_grad;
  std::vector<bool> got(params_.size(), false);
  bool any = false;
  at::Tensor flat;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    if (!flat.defined()) flat = at::zeros({layout_.padded_numel()}, shard_.options().dtype(reduce_dtype_));
    const auto& e = layout_.entries()[i];
    flat.narrow(0, e.offset, e.numel).copy_(g.reshape(-1));
    params_[i].mutable_grad().reset();
    got[i] = any = true;
  }
  if (no_sync) {
    // Gradient accumulation without communication (§3.3.4): keep the unsharded sum locally, in
    // the sharded parameters' dtype, so that many low-precision micro-batches do not round away.
    if (!any) return;
    if (no_sync_accum_.defined()) no_sync_accum_.add_(flat); else no_sync_accum_ = flat.to(shard_.scalar_type());
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i]) no_sync_got_[i] = true;
    }
    return;
  }
  if (no_sync_accum_.defined()) {
    if (flat.defined()) flat.add_(no_sync_accum_); else flat = no_sync_accum_.to(reduce_dtype_);
    no_sync_accum_ = at::Tensor();
    for (size_t i = 0; i < got.size(); ++i) got[i] = got[i] || no_sync_got_[i];
    std::fill(no_sync_got_.begin(), no_sync_got_.end(), false);
    any = true;
  }
  if (!any) return;

  // Each rank's loss is the mean over its part of the global batch, so the global mean gradient is
  // the mean over ranks. In low precision divide before summing, so the sum cannot overflow
  // (fp16); in full precision after, as local training would round.
  if (low_precision_reduce()) flat.div_(config_.world_size);
  PendingReduction r;
  r.input = flat;
  r.got = std::move(got);
  r.backward_pass = backward_pass;
  if (config_.shard_size > 1) {
    CommStreams::Issue on_stream(*config_.streams, CommKind::REDUCE_SCATTER);
    r.output = at::empty({layout_.shard_numel()}, flat.options());
    const int64_t before = comm_->reduce_scatter;
    r.reduce_scatter = reduce_scatter_sum(config_.shard_group, r.output, r.input, *comm_);
    r.rs_span = config_.timeline->collective(SpanKind::REDUCE_SCATTER, index_, backward_pass,
                                             config_.shard_group.get(), comm_->reduce_scatter - before,
                                             r.reduce_scatter, !config_.streams->active(), reduce_dtype_);
  } else {
    r.output = r.input;
  }
  pending_ = std::move(r);
  // On CUDA the all-reduce is ordered after the reduce-scatter on the device, so it can be issued
  // now; on CPU it is issued once the reduce-scatter is done (advance_reduce or finish_reduce).
  if (config_.streams->active() || !pending_->reduce_scatter) issue_all_reduce(*pending_);
}

void FlatParamHandle::issue_all_reduce(PendingReduction& r) {
  if (r.all_reduce || config_.world_size / config_.shard_size <= 1) return;
  CommStreams::Issue on_stream(*config_.streams, CommKind::ALL_REDUCE);
  if (r.reduce_scatter && config_.streams->active()) r.reduce_scatter->wait();  // stream-ordered, not blocking
  const int64_t before = comm_->all_reduce;
  r.all_reduce = all_reduce_sum(config_.replicate_group, r.output, *comm_);
  r.ar_span = config_.timeline->collective(SpanKind::ALL_REDUCE, index_, r.backward_pass,
                                           config_.replicate_group.get(), comm_->all_reduce - before, r.all_reduce,
                                           !config_.streams->active(), reduce_dtype_);
}

bool FlatParamHandle::advance_reduce() {
  if (!pending_) return false;
  if (pending_->all_reduce || config_.world_size / config_.shard_size <= 1) return false;
  if (pending_->reduce_scatter && !pending_->reduce_scatter->isCompleted()) return true;
  if (pending_->reduce_scatter) wait(pending_->reduce_scatter, SpanKind::REDUCE_SCATTER, pending_->rs_span, "reduce-scatter of gradients", pending_->backward_pass);
  issue_all_reduce(*pending_);
  return false;
}

int64_t FlatParamHandle::finish_reduce() {
  if (!pending_) return 0;
  at::NoGradGuard no_grad;
  PendingReduction& r = *pending_;
  int64_t blocked = wait(r.reduce_scatter, SpanKind::REDUCE_SCATTER, r.rs_span, "reduce-scatter of gradients", r.backward_pass);
  issue_all_reduce(r);
  blocked += wait(r.all_reduce, SpanKind::ALL_REDUCE, r.ar_span, "all-reduce of gradient shards", r.backward_pass);
  at::Tensor reduced = r.output;
  if (low_precision_reduce()) {
    reduced = reduced.to(shard_.scalar_type());  // back into the sharded gradient's dtype
  } else {
    reduced.div_(config_.world_size);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const ShardSlice& s = slices_[i];
    if (grads_[i].defined()) reduced.narrow(0, s.shard_offset, s.length).add_(grads_[i].reshape(-1));
  }
  if (config_.mixed_precision && config_.mixed_precision->keep_low_precision_grads) reduced = reduced.to(compute_dtype_);
  grad_shard_ = reduced;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!r.got[i] && !grads_[i].defined()) continue;  // unused everywhere so far: stays None, as locally
    grads_[i] = config_.shard_size == 1
                    ? alias(reduced, layout_.entries()[i].offset, layout_.entries()[i].shape)
                    : alias(reduced, slices_[i].shard_offset, {slices_[i].length});
  }
  pending_.reset();
  return blocked;
}

void FlatParamHandle::restore_grads() {
  TORCH_CHECK(state_ == HandleState::SHARDED && !pending_, "fsdp: restore_grads needs the SHARDED state and no reduction in flight");
  for (size_t i = 0; i < params_.size(); ++i) {
    if (grads_[i].defined()) params_[i].mutable_grad() = grads_[i];
    grads_[i] = at::Tensor();
  }
}

int64_t FlatParamHandle::sharded_param_bytes() const { return layout_.shard_numel() * element_size_; }

int64_t FlatParamHandle::sharded_grad_bytes() const {
  for (const auto& p : params_) {
    const auto& g = p.grad();
    if (g.defined() && g.storage().unsafeGetStorageImpl() == grad_shard_.storage().unsafeGetStorageImpl())
      return layout_.shard_numel() * static_cast<int64_t>(grad_shard_.element_size());
  }
  return 0;
}

int64_t FlatParamHandle::unsharded_bytes() const {
  return separate_buffer_ ? static_cast<int64_t>(full_.storage().nbytes()) : 0;
}

int64_t FlatParamHandle::unsharded_grad_bytes() const {
  return no_sync_accum_.defined() ? no_sync_accum_.numel() * static_cast<int64_t>(no_sync_accum_.element_size()) : 0;
}

}  // namespace fsdp
