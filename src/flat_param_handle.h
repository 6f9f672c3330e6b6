// One FSDP unit's storage and state machine (paper §3.2.1, §4.2: the FlatParamHandle).
//
// The unit's original parameters keep their identity (same TensorImpl, same name, so modules'
// typed members and optimizers keep working); what changes is the data they point at:
//
//   SHARDED   each parameter is a view into this rank's shard (1-D slice of what this rank owns;
//             with F = 1 the whole parameter in its own shape). The unsharded buffer has a
//             0-byte storage.
//   GATHERING the unsharded buffer is regrown and an all-gather into it is in flight; parameters
//             still point at the shard. Prefetching puts a unit here ahead of its use.
//   UNSHARDED the all-gather has been waited for, and each parameter is a view of its original
//             shape into the unsharded buffer.
//
//   SHARDED ──begin_unshard──▶ GATHERING ──finish_unshard──▶ UNSHARDED ──reshard──▶ SHARDED
//   (reshard from GATHERING waits for the all-gather first: its buffer cannot be freed under it)
//
// Gradient reduction is asynchronous the same way: begin_reduce issues the reduce-scatter (and,
// with replicas, the all-reduce once that is done) and finish_reduce waits and hands the result
// to the sharded gradients. The handle holds the buffers a collective reads or writes until it
// has waited for it.
//
// Why storage is resized in place rather than reallocated: autograd saves views of parameters
// for backward; those views share the buffer's StorageImpl, so regrowing that same storage makes
// them valid again without re-running forward.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "collectives.h"
#include "comm_streams.h"
#include "flat_param.h"
#include "fsdp/options.h"
#include "timeline.h"

namespace fsdp {

enum class HandleState { SHARDED, GATHERING, UNSHARDED };

struct HandleConfig {
  int shard_size = 1;       // F
  int shard_rank = 0;       // this rank's index in its shard group
  int world_size = 1;       // data-parallel ranks W (gradients are averaged over them)
  GroupPtr shard_group;     // F ranks
  GroupPtr replicate_group; // W / F ranks
  const CommStreams* streams = nullptr;  // where collectives are issued (inactive on CPU)
  std::optional<MixedPrecision> mixed_precision;
  // Where shards live; unset: the parameters' device (CPU for deferred parameters). Parameters on
  // another device are assembled there one unit at a time and only the shard is moved.
  std::optional<c10::Device> device;
  Timeline* timeline = nullptr;          // records each collective and each blocking wait
};

class FlatParamHandle {
 public:
  FlatParamHandle(std::string name, std::vector<std::string> fqns, std::vector<at::Tensor> params,
                  HandleConfig config, CommBytes* comm, int index);
  ~FlatParamHandle();
  FlatParamHandle(const FlatParamHandle&) = delete;
  FlatParamHandle& operator=(const FlatParamHandle&) = delete;

  const std::string& name() const { return name_; }
  const FlatParamLayout& layout() const { return layout_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  HandleState state() const { return state_; }
  int shard_size() const { return config_.shard_size; }

  // Storage identity, for recognising this unit's tensors among an operator's inputs.
  const c10::StorageImpl* shard_storage() const { return shard_.storage().unsafeGetStorageImpl(); }
  const c10::StorageImpl* unsharded_storage() const { return full_.storage().unsafeGetStorageImpl(); }
  // Whether unsharding uses a separate buffer: sharding (F > 1) or a cast (mixed precision).
  bool has_unsharded_buffer() const { return separate_buffer_; }
  c10::ScalarType compute_dtype() const { return compute_dtype_; }

  // SHARDED -> GATHERING: regrow the buffer and issue the all-gather into it. Returns the work
  // (null with F = 1, where the handle goes straight to UNSHARDED: nothing to gather).
  WorkPtr begin_unshard(bool backward_pass);
  // GATHERING -> UNSHARDED: wait for the all-gather where its result is consumed (on CUDA the
  // current stream waits, the CPU does not) and point the parameters at the unsharded buffer.
  // Returns the nanoseconds the calling thread was blocked.
  int64_t finish_unshard();
  // -> SHARDED: point parameters back at the shard and free the buffer.
  void reshard();

  // Start of an iteration: take the sharded gradients the user holds (possibly none after
  // zero_grad) off the parameters, so autograd accumulates this iteration's unsharded gradients
  // into empty .grad fields of the unsharded shape.
  void stash_grads();
  // After backward computed this unit's unsharded gradients: reduce them (reduce-scatter in the
  // shard group, then all-reduce across replicas, divided by W) and add them to the stashed
  // sharded gradients. With no_sync, add them to a local unsharded accumulator instead and reduce
  // that with the next synchronized backward.
  // begin_reduce issues the collectives and returns at once; finish_reduce waits for them and
  // returns the nanoseconds it blocked. advance_reduce issues the replica all-reduce once the
  // reduce-scatter is done, without blocking (on CPU; on CUDA it is stream-ordered at issue).
  void begin_reduce(bool no_sync, bool backward_pass);
  bool advance_reduce();  // true while a reduce-scatter still has to finish before its all-reduce
  int64_t finish_reduce();
  bool reduce_pending() const { return pending_.has_value(); }
  // End of an iteration (requires SHARDED): give the parameters their sharded gradients back.
  void restore_grads();
  bool has_unreduced_grads() const;

  int64_t sharded_param_bytes() const;
  int64_t sharded_grad_bytes() const;
  int64_t unsharded_bytes() const;        // unsharded parameter buffer allocated now (F > 1)
  int64_t unsharded_grad_bytes() const;   // no_sync accumulator allocated now
  int64_t unsharded_capacity_bytes() const { return layout_.padded_numel() * compute_element_size_; }

 private:
  void resize_unsharded(bool allocate);
  bool low_precision_reduce() const { return reduce_dtype_ != shard_.scalar_type(); }
  int64_t wait(const WorkPtr& work, SpanKind kind, size_t span, const char* what, bool backward_pass);

  // A reduction in flight: the buffers it reads and writes live here until it is waited for.
  struct PendingReduction {
    at::Tensor input;             // [padded_numel] unsharded gradients (reduce-scatter input)
    at::Tensor output;            // [shard_numel] (or the input itself with F = 1)
    WorkPtr reduce_scatter, all_reduce;
    size_t rs_span = 0, ar_span = 0;
    std::vector<bool> got;        // which parameters contributed gradients
    bool backward_pass = true;
  };
  void issue_all_reduce(PendingReduction& r);

  std::string name_;
  FlatParamLayout layout_;
  std::vector<at::Tensor> params_;
  HandleConfig config_;
  CommBytes* comm_;
  int index_;  // this unit's index, for the timeline
  HandleState state_ = HandleState::SHARDED;
  int64_t element_size_ = 4;          // the sharded parameters' (the optimizer's) dtype
  c10::ScalarType compute_dtype_;      // what forward and backward run in (param_dtype)
  int64_t compute_element_size_ = 4;
  c10::ScalarType reduce_dtype_;       // what gradients are reduced in
  bool separate_buffer_ = false;
  at::Tensor shard_cast_;              // the shard cast to compute_dtype while its all-gather runs

  at::Tensor shard_;                      // [shard_numel], this rank's part of the flat parameter
  at::Tensor full_;                       // [padded_numel] in compute_dtype_, 0-byte storage while SHARDED
  std::vector<at::Tensor> sharded_views_; // per parameter, into shard_
  std::vector<at::Tensor> full_views_;    // per parameter, into full_, original shapes
  std::vector<ShardSlice> slices_;        // this rank's slice of each parameter

  std::vector<at::Tensor> grads_;         // sharded gradients handed to parameters at the end
  at::Tensor grad_shard_;                 // [shard_numel] storage behind grads_
  at::Tensor no_sync_accum_;              // [padded_numel] unsharded gradients under no_sync
  std::vector<bool> no_sync_got_;         // which parameters the accumulator holds gradients of

  WorkPtr gather_work_;                   // the all-gather in flight while GATHERING
  size_t gather_span_ = 0;
  bool gather_backward_ = false;
  std::optional<PendingReduction> pending_;
};

}  // namespace fsdp
