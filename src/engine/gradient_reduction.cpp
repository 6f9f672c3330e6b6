#include "engine/gradient_reduction.h"

#include "fsdp/tensor_parallel.h"

#include <c10/core/GradMode.h>
#include <c10/util/strides.h>

#include "engine/param_key.h"

namespace fsdp {
namespace {
// A tensor sharing `flat`'s storage at `offset` with `sizes`, made with set_ rather than a view
// op: autograd does not treat it as a view, so optimizers may detach_() it (zero_grad does).
at::Tensor alias(const at::Tensor& flat, int64_t offset, at::IntArrayRef sizes) {
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
  return t;
}

// A sparse gradient (an Embedding built with sparse(true)) is reduced as the dense gradient it
// stands for: the unit's flat gradient holds every row of the table anyway, and the reduced shard
// a rank's optimizer steps is a dense slice. Optimizers that take sparse gradients (SGD, Adagrad)
// take dense ones to the same result.
at::Tensor densified(const at::Tensor& g) { return g.defined() && g.is_sparse() ? g.to_dense() : g; }
}  // namespace

GradientReduction::GradientReduction(int index, const FlatParamHandle& handle, CommContext& comm)
    : index_(index), handle_(handle), comm_(comm) {
  grads_.resize(handle_.params().size());
  unclaimed_.resize(handle_.params().size());
}

void GradientReduction::stash() {
  take_stand_ins();  // another backward inside an unshard() scope: autograd accumulates afresh
  if (form_ == Form::UNSHARDED || stashed_) return;  // unreduced gradients stay: autograd adds to them
  const auto& params = handle_.params();
  for (size_t i = 0; i < params.size(); ++i) {
    grads_[i] = params[i].grad();
    if (grads_[i].defined()) at::Tensor(params[i]).mutable_grad().reset();
  }
  stashed_ = true;
}

std::vector<const c10::StorageImpl*> GradientReduction::guarded_grad_storages() const {
  std::vector<const c10::StorageImpl*> out;
  if (held()) return {held_storage()};
  if (form_ != Form::UNSHARDED) return out;
  for (const auto& p : handle_.params()) {
    if (p.grad().defined() && p.grad().has_storage()) out.push_back(p.grad().storage().unsafeGetStorageImpl());
  }
  return out;
}

bool GradientReduction::holds_unreduced_no_sync() const {
  if (form_ != Form::UNSHARDED) return false;
  for (const auto& p : handle_.params()) {
    if (p.grad().defined()) return true;
  }
  return false;
}

bool GradientReduction::has_unreduced() const {
  if (form_ == Form::SHARDED && !stashed_) return false;  // what they hold is reduced already
  for (const auto& p : handle_.params()) {
    if (p.grad().defined()) return true;
  }
  return false;
}

void GradientReduction::keep_unsharded() {
  at::NoGradGuard no_grad;
  const auto& params = handle_.params();
  const UnitDtypes& dt = handle_.dtypes();
  const int F = comm_.mesh().shard_size;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor g = densified(params[i].grad());
    if (g.defined() && g.scalar_type() != dt.master) g = g.to(dt.master);
    if (grads_[i].defined()) {
      // Fold a reduced gradient in so that the next reduction gives it back (see the header).
      if (!g.defined()) g = at::zeros(handle_.layout().entries()[i].shape, handle_.shard().options());
      const ShardSlice& s = handle_.slices()[i];
      const at::Tensor mine = F == 1 ? grads_[i].reshape(-1) : grads_[i].reshape(-1).narrow(0, 0, s.length);
      g.view(-1).narrow(0, s.param_begin, s.length).add_(mine.to(dt.master), F);
      grads_[i] = at::Tensor();
    }
    // Keyed (param_key.h), so that an optimizer step or a clip reading this rank's unreduced sum
    // outside backward reaches the guard, which refuses it (Runtime::on_unreduced_grad_op).
    if (g.defined()) at::Tensor(params[i]).mutable_grad() = param_key::keyed(g.contiguous());
  }
  form_ = Form::UNSHARDED;
  stashed_ = false;
}

void GradientReduction::set_tensor_parallel_sum(const TensorParallel* tp, std::vector<size_t> params) {
  tp_sum_group_ = tp;
  tp_sum_params_ = std::move(params);
}

void GradientReduction::sum_over_tensor_parallel(at::Tensor& flat) {
  // Every TP rank of this unit reaches here in the same backward at the same point (they run the
  // same graph), with the same parameters' gradients: one all-reduce of their segments, in the
  // reduce dtype, before the data-parallel mean.
  if (!tp_sum_group_ || tp_sum_group_->size() == 1) return;
  const auto& entries = handle_.layout().entries();
  std::vector<at::Tensor> segments;
  for (size_t i : tp_sum_params_) segments.push_back(flat.narrow(0, entries[i].offset, entries[i].numel));
  at::Tensor packed = at::cat(segments);
  std::vector<at::Tensor> v{packed};
  try {
    auto work = tp_sum_group_->group(packed.device().type())->allreduce(v);
    if (!work->wait()) throw std::runtime_error("the work did not complete");
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error("fsdp: summing partial gradients (partial_gradient_rule) over the tensor-parallel group "
                             "failed: " + what.substr(0, what.find('\n')));
  }
  int64_t at = 0;
  for (auto& seg : segments) {
    seg.copy_(packed.narrow(0, at, seg.numel()));
    at += seg.numel();
  }
}

void GradientReduction::begin(bool no_sync) {
  if (pending_) finish();  // one reduction per unit at a time, in issue order
  if (no_sync) {
    // Gradient accumulation without communication (§3.3.4): the gradients stay on the parameters.
    keep_unsharded();
    return;
  }
  at::NoGradGuard no_grad;
  const auto& params = handle_.params();
  const auto& layout = handle_.layout();
  const UnitDtypes& dt = handle_.dtypes();
  std::vector<bool> got(params.size(), false);
  bool any = false;
  at::Tensor flat;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor g = densified(params[i].grad());
    if (!g.defined()) continue;
    if (!flat.defined()) flat = at::zeros({layout.padded_numel()}, handle_.shard().options().dtype(dt.reduce));
    const auto& e = layout.entries()[i];
    flat.narrow(0, e.offset, e.numel).copy_(g.reshape(-1));
    at::Tensor(params[i]).mutable_grad().reset();
    got[i] = any = true;
  }
  form_ = Form::SHARDED;
  stashed_ = true;  // what grads_ holds (possibly nothing) is this iteration's to restore
  if (!any) return;
  if (!tp_sum_params_.empty()) sum_over_tensor_parallel(flat);

  // Each rank's loss is the mean over its part of the global batch, so the global mean gradient is
  // the mean over ranks. In low precision divide before summing, so the sum cannot overflow
  // (fp16); in full precision after, as local training would round (UnitDtypes::divide_before_sum).
  const MeshInfo& mesh = comm_.mesh();
  if (dt.divide_before_sum()) flat.div_(mesh.world_size);
  Pending r;
  r.input = flat;
  r.got = std::move(got);
  if (mesh.shard_size > 1) {
    r.reduce_scatter = comm_.issue(CommKind::REDUCE_SCATTER, Over::SHARD_GROUP, index_, "gradients", [&] {
      if (flat.is_cpu()) {
        // In place: the output is this rank's slot of the input (see reduce_scatter_sum), copied
        // out when the input is freed.
        r.output = flat.narrow(0, mesh.shard_rank * layout.shard_numel(), layout.shard_numel());
      } else {
        r.output = at::empty({layout.shard_numel()}, flat.options());  // on the reduce-scatter stream
      }
      return Buffers{r.output, r.input};
    });
  } else {
    r.output = r.input;
  }
  pending_ = std::move(r);
  if (mesh.replicas <= 1) return;
  if (comm_.streams().active()) {
    // On CUDA the all-reduce is ordered after the reduce-scatter on the device: issued now.
    issue_all_reduce_now(*pending_);
    return;
  }
  // On CPU it can go out only once the reduce-scatter is done, in the replicate group's order
  // (replica_order.h: shared with every other model wrapped over the mesh).
  pending_->ticket = mesh.replica_order->enqueue(
      [this] { return comm_.done(pending_->reduce_scatter); },
      [this] {
        Pending& p = *pending_;
        p.blocked_ns += comm_.wait(p.reduce_scatter);
        release_input(p);
        p.ticket.reset();
        issue_all_reduce_now(p);
      });
  mesh.replica_order->advance();
}

GradientReduction::~GradientReduction() {
  if (pending_ && pending_->ticket) comm_.mesh().replica_order->drop(*pending_->ticket);
}

void GradientReduction::issue_all_reduce(Pending& r) {
  if (r.all_reduce || comm_.mesh().replicas <= 1) return;
  if (r.ticket) {
    comm_.mesh().replica_order->issue_through(*r.ticket);  // ours, after every one issued before it
    return;
  }
  issue_all_reduce_now(r);
}

void GradientReduction::issue_all_reduce_now(Pending& r) {
  r.all_reduce = comm_.issue(CommKind::ALL_REDUCE, Over::REPLICAS, index_, "gradient shards",
                             [&] { return Buffers{r.output, at::Tensor()}; }, &r.reduce_scatter);
}

void GradientReduction::advance() {
  if (!pending_) return;
  Pending& r = *pending_;
  if (r.ticket) {
    // With replicas on CPU the group's order decides when all-reduces go out, whoever polls.
    comm_.mesh().replica_order->advance();
    return;
  }
  if (r.reduce_scatter) {
    // On CUDA `done` queries the event recorded on the communication stream after the
    // collective: once it has passed, the compute stream may reuse the input's memory.
    if (!comm_.done(r.reduce_scatter)) return;
    comm_.wait(r.reduce_scatter);
    release_input(r);
  }
  issue_all_reduce(r);
}

int64_t GradientReduction::complete_reduce_scatter() {
  if (!pending_) return 0;
  int64_t blocked = comm_.wait(pending_->reduce_scatter);
  release_input(*pending_);
  issue_all_reduce(*pending_);
  blocked += pending_->blocked_ns;
  pending_->blocked_ns = 0;
  return blocked;
}

void GradientReduction::release_input(Pending& r) {
  if (!r.output.defined() || !r.input.defined() || r.input.is_same(r.output)) return;
  // An in-place reduce-scatter's output is a slot of its input: keep only the slot.
  if (r.output.storage().is_alias_of(r.input.storage())) r.output = r.output.clone();
  r.input = at::Tensor();
}

int64_t GradientReduction::finish() {
  if (!pending_) return 0;
  at::NoGradGuard no_grad;
  Pending& r = *pending_;
  const UnitDtypes& dt = handle_.dtypes();
  int64_t blocked = comm_.wait(r.reduce_scatter);
  release_input(r);
  issue_all_reduce(r);
  blocked += comm_.wait(r.all_reduce) + r.blocked_ns;
  at::Tensor reduced = r.output;
  if (dt.low_precision_reduce()) reduced = reduced.to(dt.master);  // back into the sharded gradient's dtype
  if (!dt.divide_before_sum()) reduced.div_(comm_.mesh().world_size);
  const auto& slices = handle_.slices();
  for (size_t i = 0; i < grads_.size(); ++i) {
    const ShardSlice& s = slices[i];
    // What an earlier reduction of this backward left (a unit reduced twice) is added too.
    const at::Tensor& earlier = grads_[i].defined() ? grads_[i] : unclaimed_[i];
    if (earlier.defined()) reduced.narrow(0, s.shard_offset, s.length).add_(earlier.reshape(-1));
  }
  if (dt.grad != dt.master) reduced = reduced.to(dt.grad);
  grad_storage_ = reduced.storage().getWeakStorageImpl();
  grad_storage_bytes_ = handle_.layout().shard_numel() * static_cast<int64_t>(reduced.element_size());
  const auto& entries = handle_.layout().entries();
  for (size_t i = 0; i < grads_.size(); ++i) {
    at::Tensor view = comm_.mesh().shard_size == 1 ? alias(reduced, entries[i].offset, entries[i].shape)
                                                   : alias(reduced, slices[i].shard_offset, {slices[i].length});
    if (r.got[i] || grads_[i].defined()) {
      grads_[i] = std::move(view);
      unclaimed_[i] = at::Tensor();
    } else {
      // No gradient from this rank: another rank's may be in it (settle decides).
      unclaimed_[i] = std::move(view);
    }
  }
  pending_.reset();
  return blocked;
}

void GradientReduction::presence(std::vector<int64_t>& out) const {
  for (size_t i = 0; i < grads_.size(); ++i) out.push_back(grads_[i].defined() && stashed_ ? 1 : 0);
}

void GradientReduction::settle(const int64_t* any) {
  for (size_t i = 0; i < unclaimed_.size(); ++i) {
    if (any != nullptr && any[i] != 0 && unclaimed_[i].defined() && !grads_[i].defined()) grads_[i] = unclaimed_[i];
    unclaimed_[i] = at::Tensor();
  }
}

void GradientReduction::restore() {
  TORCH_CHECK(handle_.state() == HandleState::SHARDED && !pending_,
              "fsdp: restoring sharded gradients needs the SHARDED state and no reduction in flight");
  take_stand_ins();
  if (!stashed_) return;
  const auto& params = handle_.params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (grads_[i].defined()) at::Tensor(params[i]).mutable_grad() = grads_[i];
    grads_[i] = at::Tensor();
  }
  stashed_ = false;
}

void GradientReduction::hold() {
  // A backward that did not reach this unit leaves the stand-ins of the one before: what the user
  // did to them since (zero_grad) counts first.
  take_stand_ins();
  if (!stashed_ || pending_ || form_ != Form::SHARDED) return;
  const auto& params = handle_.params();
  stand_ins_.assign(params.size(), at::Tensor());
  // One element of storage, expanded to each parameter's shape: whatever reads a stand-in is
  // refused before it computes (the guard), so its value never matters.
  at::Tensor one;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!grads_[i].defined()) continue;
    const at::Tensor& p = params[i];
    if (!one.defined()) one = at::zeros({}, p.options());
    stand_ins_[i] = param_key::keyed(one.expand(p.sizes()));
    at::Tensor(p).mutable_grad() = stand_ins_[i];
  }
  if (!one.defined()) stand_ins_.clear();
}

const c10::StorageImpl* GradientReduction::held_storage() const {
  for (const auto& s : stand_ins_) {
    if (s.defined()) return s.storage().unsafeGetStorageImpl();
  }
  return nullptr;
}

void GradientReduction::take_stand_ins() {
  if (stand_ins_.empty()) return;
  const auto& params = handle_.params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (!stand_ins_[i].defined()) continue;
    const at::Tensor& g = params[i].grad();
    if (g.defined() && g.unsafeGetTensorImpl() == stand_ins_[i].unsafeGetTensorImpl()) {
      at::Tensor(params[i]).mutable_grad().reset();
    } else {
      grads_[i] = at::Tensor();  // the user dropped it (zero_grad to None)
    }
  }
  stand_ins_.clear();
}

int64_t GradientReduction::sharded_grad_bytes() const {
  for (const auto& p : handle_.params()) {
    const auto& g = p.grad();
    // A storage alive at the address the weak reference holds is that storage (it keeps it).
    if (g.defined() && !grad_storage_.expired() && g.storage().unsafeGetStorageImpl() == grad_storage_._unsafe_get_target()) {
      return grad_storage_bytes_;
    }
  }
  return 0;
}

int64_t GradientReduction::reducing_bytes() const {
  if (!pending_ || !pending_->input.defined() || pending_->input.is_same(pending_->output)) return 0;
  return pending_->input.numel() * static_cast<int64_t>(pending_->input.element_size());
}

int64_t GradientReduction::unsharded_grad_bytes() const {
  if (form_ != Form::UNSHARDED) return 0;
  int64_t bytes = 0;
  for (const auto& p : handle_.params()) {
    if (p.grad().defined()) bytes += p.grad().numel() * static_cast<int64_t>(p.grad().element_size());
  }
  return bytes;
}

}  // namespace fsdp
