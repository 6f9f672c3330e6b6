// The runtime's construction (runtime.h) and the three steps every phase takes on a unit: gather
// (issue its all-gather, through the rate limiter), use (wait for it) and reshard (free it). The
// phases that decide when to take them are in runtime_forward.cpp, runtime_touches.cpp and
// runtime_backward.cpp.
#include "engine/runtime.h"

#include "fsdp/tensor_parallel.h"

#include <algorithm>

#include <c10/core/GradMode.h>

namespace fsdp {

Runtime::Runtime(std::vector<Unit*> units, CommContext& comm, const Options& options, std::vector<bool> reshard_after_forward)
    : units_(std::move(units)),
      comm_(comm),
      options_(options),
      reshard_after_forward_(std::move(reshard_after_forward)),
      // On CUDA an all-gather stays in flight until the device has freed its buffer.
      limiter_(options.limit_all_gathers, /*device_frees=*/comm.streams().active()) {
  TORCH_CHECK(options_.prefetch_count >= 1, "fsdp: prefetch_count must be >= 1, got ", options_.prefetch_count);
  hooked_.resize(units_.size());
  write_snapshots_.resize(units_.size());
  guarded_grads_.resize(units_.size());
  {
    at::AutoGradMode on(true);
    drain_leaf_ = at::ones({1}).requires_grad_();
    drain_out_ = drain_leaf_ * 2;  // its node is numbered before any forward's
  }
  tp_split_.resize(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    // Which parameters are split for TP (checked at each forward touch) and which have partial
    // gradients (summed over TP before the data-parallel reduction).
    const auto& params = units_[u]->handle().params();
    std::vector<size_t> partial;
    for (size_t i = 0; i < params.size(); ++i) {
      if (tensor_parallel_partial_gradient(params[i])) partial.push_back(i);
      const auto placement = tensor_parallel_placement(params[i]);
      if (!placement || placement->tp->size() == 1) continue;
      tp_split_[u].resize(params.size(), false);
      tp_split_[u][i] = true;
    }
    if (!partial.empty() && options_.tensor_parallel) {
      units_[u]->reduction().set_tensor_parallel_sum(options_.tensor_parallel.get(), std::move(partial));
    }
    touch::register_storage(this, u, units_[u]->handle().shard_storage());
    if (units_[u]->handle().has_unsharded_buffer()) touch::register_storage(this, u, units_[u]->handle().unsharded_storage());
    if (units_[u]->is_root()) root_unit_ = u;
    memory_.sharded_params += units_[u]->handle().sharded_param_bytes();
    guard::register_storage(this, u, units_[u]->handle().shard_storage());
    if (units_[u]->handle().has_unsharded_buffer()) guard::register_storage(this, u, units_[u]->handle().unsharded_storage());
  }
}

Runtime::~Runtime() {
  touch::unregister_sink(this);
  guard::unregister_sink(this);
}

void Runtime::gather(size_t u) {
  FlatParamHandle& handle = units_[u]->handle();
  if (handle.state() != HandleState::SHARDED) return;
  touch::Suppress own_work;
  if (comm_.mesh().shard_size > 1) {
    const int64_t t0 = Timeline::now_ns();
    if (const int64_t blocked = limiter_.before_issue()) {
      comm_.timeline().add(SpanKind::RATE_LIMIT, static_cast<int>(u), comm_.backward_pass(), t0, t0 + blocked);
      overlap_.rate_limiter_wait_ns += blocked;
    }
  }
  if (WorkPtr work = handle.begin_unshard()) {
    // The shard group's log: where forward's all-gathers go (backward's go there too, or over an
    // hpZ subgroup whose ranks' shard-group logs differ as well when their paths did).
    limiter_.issued(u, std::move(work), comm_.mesh().log_of(comm_.mesh().shard_group));
    overlap_.max_all_gathers_in_flight = std::max(overlap_.max_all_gathers_in_flight, limiter_.in_flight());
  }
  note_memory();
}

void Runtime::use(size_t u) {
  FlatParamHandle& handle = units_[u]->handle();
  if (handle.state() == HandleState::UNSHARDED) {  // the common case: one check per operator
    handle.unguard_gathered();
    return;
  }
  gather(u);
  if (handle.state() != HandleState::GATHERING) return;
  touch::Suppress own_work;
  overlap_.exposed_all_gather_ns += handle.finish_unshard();
  limiter_.consumed(u);
}

void Runtime::reshard(size_t u, bool after_forward) {
  FlatParamHandle& handle = units_[u]->handle();
  if (pinned(u)) return;  // an unshard() scope holds it gathered
  // A forward that wrote into the gathered copy (merged into the shards here) leaves no secondary
  // shard: this rank's copy is not the merged one; backward gathers the merged shards instead.
  const bool wrote = write_snapshots_[u].defined();
  if (wrote) merge_forward_writes(u);  // before its gathered copy goes
  if (handle.state() == HandleState::SHARDED) {
    if (handle.has_secondary() && !after_forward) {  // backward is past it, or will not come
      handle.reshard();
      note_memory();
    }
    return;
  }
  touch::Suppress own_work;
  if (handle.state() == HandleState::GATHERING) {
    // A prefetch nobody used: its buffer can only be freed once the collective is done with it.
    overlap_.exposed_all_gather_ns += handle.finish_unshard();
  }
  handle.reshard(after_forward && backward_pending_ && !wrote);
  if (comm_.mesh().shard_size > 1) limiter_.freed(u, comm_.streams().record_current());
  note_memory();
}

void Runtime::reset_step() {
  memory_.unsharded_peak = memory_.unsharded_current;
  memory_.unsharded_grads_peak = memory_.unsharded_grads_current;
  memory_.reducing_grads_peak = memory_.reducing_grads_current;
  overlap_ = OverlapStats{};
  detection_ = DetectionStats{};
  phases_.reset();
}

}  // namespace fsdp
