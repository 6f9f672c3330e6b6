#include "flat_param_handle.h"

#include <ATen/native/Resize.h>
#include <c10/core/GradMode.h>

#include <c10/util/strides.h>

#include "device.h"

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
                                 std::vector<at::Tensor> params, HandleConfig config, CommBytes* comm)
    : name_(std::move(name)),
      layout_(fqns, shapes_of(params), config.shard_size),
      params_(std::move(params)),
      config_(std::move(config)),
      comm_(comm) {
  TORCH_CHECK(!params_.empty(), "fsdp: unit '", name_, "' has no parameters");
  const auto options = params_[0].options().requires_grad(false);
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].dtype() == params_[0].dtype() && params_[i].device() == params_[0].device(),
                "fsdp: unit '", name_, "' mixes dtypes or devices (", fqns[0], " is ", params_[0].dtype(),
                " on ", params_[0].device(), ", ", fqns[i], " is ", params_[i].dtype(), " on ",
                params_[i].device(), "). Put parameters of different dtypes in different units.");
  }
  element_size_ = static_cast<int64_t>(params_[0].element_size());
  at::NoGradGuard no_grad;

  // Flatten, concatenate, right-pad (the padding is zero and stays zero: it never gets a gradient).
  full_ = at::zeros({layout_.padded_numel()}, options);
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries()[i];
    full_.narrow(0, e.offset, e.numel).copy_(params_[i].detach().reshape(-1));
    full_views_.push_back(full_.narrow(0, e.offset, e.numel).view(e.shape));
  }
  slices_ = layout_.slices(config_.shard_rank);
  if (config_.shard_size == 1) {
    // Replication: the shard is the whole flat parameter and parameters keep their shapes.
    shard_ = full_;
    sharded_views_ = full_views_;
  } else {
    shard_ = full_.narrow(0, config_.shard_rank * layout_.shard_numel(), layout_.shard_numel()).clone();
    for (const auto& s : slices_) sharded_views_.push_back(shard_.narrow(0, s.shard_offset, s.length));
    resize_unsharded(false);
  }
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(sharded_views_[i]);
  grads_.resize(params_.size());
  no_sync_got_.assign(params_.size(), false);
}

FlatParamHandle::~FlatParamHandle() = default;

void FlatParamHandle::resize_unsharded(bool allocate) {
  resize_storage(full_, allocate ? static_cast<size_t>(layout_.padded_numel() * element_size_) : 0);
}

void FlatParamHandle::unshard() {
  if (state_ == HandleState::UNSHARDED) return;
  if (config_.shard_size > 1) {
    resize_unsharded(true);
    wait_for(all_gather_into(config_.shard_group, full_, shard_, *comm_), "all-gather of parameters");
    for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(full_views_[i]);
  }
  state_ = HandleState::UNSHARDED;
}

void FlatParamHandle::reshard() {
  if (state_ == HandleState::SHARDED) return;
  if (config_.shard_size > 1) {
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

void FlatParamHandle::reduce_grads(bool no_sync) {
  at::NoGradGuard no_grad;
  std::vector<bool> got(params_.size(), false);
  bool any = false;
  at::Tensor flat;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    if (!flat.defined()) flat = at::zeros({layout_.padded_numel()}, full_.options());
    const auto& e = layout_.entries()[i];
    flat.narrow(0, e.offset, e.numel).copy_(g.reshape(-1));
    params_[i].mutable_grad().reset();
    got[i] = any = true;
  }
  if (no_sync) {
    // Gradient accumulation without communication (§3.3.4): keep the unsharded sum locally.
    if (!any) return;
    if (no_sync_accum_.defined()) no_sync_accum_.add_(flat); else no_sync_accum_ = flat;
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i]) no_sync_got_[i] = true;
    }
    return;
  }
  if (no_sync_accum_.defined()) {
    if (flat.defined()) flat.add_(no_sync_accum_); else flat = no_sync_accum_;
    no_sync_accum_ = at::Tensor();
    for (size_t i = 0; i < got.size(); ++i) got[i] = got[i] || no_sync_got_[i];
    std::fill(no_sync_got_.begin(), no_sync_got_.end(), false);
    any = true;
  }
  if (!any) return;

  at::Tensor reduced;
  if (config_.shard_size > 1) {
    reduced = at::empty({layout_.shard_numel()}, full_.options());
    wait_for(reduce_scatter_sum(config_.shard_group, reduced, flat, *comm_), "reduce-scatter of gradients");
  } else {
    reduced = flat;
  }
  if (config_.world_size / config_.shard_size > 1) {
    wait_for(all_reduce_sum(config_.replicate_group, reduced, *comm_), "all-reduce of gradient shards");
  }
  // Each rank's loss is the mean over its part of the global batch, so the global mean gradient is
  // the mean over ranks.
  reduced.div_(config_.world_size);
  for (size_t i = 0; i < params_.size(); ++i) {
    const ShardSlice& s = slices_[i];
    if (grads_[i].defined()) reduced.narrow(0, s.shard_offset, s.length).add_(grads_[i].reshape(-1));
  }
  grad_shard_ = reduced;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!got[i] && !grads_[i].defined()) continue;  // unused everywhere so far: stays None, as locally
    grads_[i] = config_.shard_size == 1
                    ? alias(reduced, layout_.entries()[i].offset, layout_.entries()[i].shape)
                    : alias(reduced, slices_[i].shard_offset, {slices_[i].length});
  }
}

void FlatParamHandle::restore_grads() {
  TORCH_CHECK(state_ == HandleState::SHARDED, "fsdp: restore_grads needs the SHARDED state");
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
      return layout_.shard_numel() * element_size_;
  }
  return 0;
}

int64_t FlatParamHandle::unsharded_bytes() const {
  return config_.shard_size > 1 ? static_cast<int64_t>(full_.storage().nbytes()) : 0;
}

int64_t FlatParamHandle::unsharded_grad_bytes() const {
  return no_sync_accum_.defined() ? no_sync_accum_.numel() * element_size_ : 0;
}

}  // namespace fsdp
