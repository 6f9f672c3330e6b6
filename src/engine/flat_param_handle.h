// One FSDP unit's parameter storage and its state machine (paper §3.2.1, §4.2: the FlatParamHandle).
//
// The unit's original parameters keep their identity (same TensorImpl, same name, so modules'
// typed members and optimizers keep working); what changes is the data they point at:
//
// Every view a parameter is pointed at carries fsdp's dispatch key (param_key.h).
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
// Two ways of gathering move fewer bytes (issue 26), both invisible to the states above:
//   quantized   (CommContext::param_quantization) the all-gather moves each rank's shard quantized
//               (quantized_all_gather.h) and finish_unshard dequantizes into the unsharded buffer
//   secondary   (hpZ, set_secondary_size N) reshard(keep_secondary) after forward keeps 1/N
//               of the gathered unit, in the compute dtype, and the next begin_unshard (backward's)
//               gathers from those over the N-rank group instead of from the shards over F;
//               any other reshard (after backward, at the end of an iteration) lets it go. Backward
//               therefore computes with exactly the values forward did, quantized or not.
//
// Why storage is resized in place rather than reallocated: autograd saves views of parameters
// for backward; those views share the buffer's StorageImpl, so regrowing that same storage makes
// them valid again without re-running forward.
//
// Gradients are gradient_reduction.h's business; the handle only owns parameter storage.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "comm/comm_context.h"
#include "comm/quantized_all_gather.h"
#include "engine/flat_param.h"
#include "fsdp/options.h"
#include "engine/param_key.h"
#include "precision/precision.h"

namespace fsdp {

enum class HandleState { SHARDED, GATHERING, UNSHARDED };

// How a quantized all-gather cuts every rank's shard of `layout` (quantized_all_gather.h: blocks
// of at most `block` elements inside each parameter's slice and inside the padding): the record
// every rank sends, and (when asked) each shard rank's blocks.
QuantizedRecord quantization_layout(const FlatParamLayout& layout, int block, std::vector<BlockStarts>* blocks = nullptr);

class FlatParamHandle {
 public:
  // Flattens `params` (the model's own tensors; deferred ones are materialized here, straight into
  // the flat buffer) and keeps this rank's shard on `device` (unset: the parameters' device, or the
  // CPU for deferred parameters; another device: assembled on the CPU one unit at a time and only
  // the shard moved).
  FlatParamHandle(int index, std::vector<std::string> fqns, std::vector<at::Tensor> params, CommContext& comm,
                  const std::optional<MixedPrecision>& mixed_precision, std::optional<c10::Device> device);
  FlatParamHandle(const FlatParamHandle&) = delete;
  FlatParamHandle& operator=(const FlatParamHandle&) = delete;

  const FlatParamLayout& layout() const { return layout_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  const std::vector<ShardSlice>& slices() const { return slices_; }  // this rank's slice of each
  const at::Tensor& shard() const { return shard_; }                // [shard_numel], master dtype
  // [padded_numel] in the compute dtype: the gathered parameters (0 bytes while SHARDED); with
  // F = 1 and no cast, the shard itself.
  const at::Tensor& unsharded() const { return full_; }
  const UnitDtypes& dtypes() const { return dtypes_; }
  HandleState state() const { return state_; }

  // Storage identity, for recognising this unit's tensors among an operator's inputs.
  const c10::StorageImpl* shard_storage() const { return shard_.storage().unsafeGetStorageImpl(); }
  const c10::StorageImpl* unsharded_storage() const { return full_.storage().unsafeGetStorageImpl(); }
  // Whether unsharding uses a separate buffer: sharding (F > 1) or a cast (mixed precision).
  bool has_unsharded_buffer() const { return separate_buffer_; }

  // SHARDED -> GATHERING: regrow the buffer and issue the all-gather into it. Returns the work
  // (null with F = 1, where the handle goes straight to UNSHARDED: nothing to gather).
  WorkPtr begin_unshard();
  // GATHERING -> UNSHARDED: wait for the all-gather where its result is consumed and point the
  // parameters at the unsharded buffer. Returns the nanoseconds the calling thread was blocked.
  int64_t finish_unshard();
  // -> SHARDED: point parameters back at the shard and free the buffer. `keep_secondary` (after
  // forward, with hpZ): keep this rank's 1/N of the gathered unit for backward's gather; otherwise
  // a secondary shard kept earlier goes too.
  void reshard(bool keep_secondary = false);
  bool has_secondary() const { return secondary_.defined(); }
  // hpZ: this unit's secondary group size N (0: none; the wrapper sets it from the options).
  void set_secondary_size(int n) { secondary_size_ = n; }
  int secondary_size() const { return secondary_size_; }
  // summon_full_params: the whole parameters in the master dtype, in a buffer of their own (not
  // the compute one: values must round-trip exactly; with F = 1 a copy of the shard). `keep`
  // false: gather, then let go at once (the ranks other than 0 under rank0_only). end_summon
  // copies this rank's part back into the shard when `writeback`.
  void summon(bool keep);
  void end_summon(bool writeback);
  // Inside summon_full_params (kept): one checksum of each parameter's bits in the whole copy.
  // Every rank's copy came from one all-gather, so ranks that changed nothing, or made the same
  // change, agree bit for bit; a change made on some ranks only shows.
  std::vector<int64_t> summoned_checksums() const;
  // Between a forward and its backward, a unit left gathered (the root, the ZeRO-2 strategies) is
  // guarded (param_guard.h): anything but the root's own passes must ask the runtime first.
  void guard_gathered();
  void unguard_gathered();
  bool gathered_guarded() const { return gathered_guarded_; }
  // Whether an operator outside the root's passes must ask the runtime (param_guard.h): a 1-D
  // shard (F > 1) at rest, or a gathered copy left for backward. With F = 1 at rest the
  // parameters are whole and operators pass.
  bool guarded() const;
  // Which parameter a view of the shard or of the unsharded buffer belongs to (by its offset).
  size_t param_at(const at::Tensor& view) const;
  // After a collective failed: -> UNSHARDED without communicating, the buffer filled with NaN
  // (zeros for integer units), so that the operator that needed the unit computes harmlessly
  // until the runtime reports the failure where exceptions reach the caller.
  void poison();

  int64_t sharded_param_bytes() const;
  int64_t unsharded_bytes() const;  // unsharded parameter buffer allocated now, with the hpZ secondary shard

 private:
  void resize_unsharded(bool allocate);

  int index_;
  CommContext& comm_;
  FlatParamLayout layout_;
  std::vector<at::Tensor> params_;
  UnitDtypes dtypes_;
  bool separate_buffer_ = false;
  HandleState state_ = HandleState::SHARDED;

  at::Tensor shard_;                      // [shard_numel], this rank's part of the flat parameter
  at::Tensor shard_cast_;                 // the shard cast to the compute dtype while its all-gather runs
  at::Tensor full_;                       // [padded_numel] in the compute dtype, 0 bytes while SHARDED
  std::vector<at::Tensor> sharded_views_; // per parameter, into shard_
  std::vector<at::Tensor> full_views_;    // per parameter, into full_, original shapes
  bool gathered_guarded_ = false;
  std::vector<ShardSlice> slices_;        // this rank's slice of each parameter
  InFlight gather_;                       // the all-gather in flight while GATHERING
  QuantizedRecord quant_record_;          // quantized: what each rank sends (built on first use)
  std::vector<BlockStarts> quant_blocks_; // quantized: each shard rank's blocks
  at::Tensor record_;                     // quantized: this rank's record, read by the all-gather
  at::Tensor records_;                    // quantized: every rank's records, written by it
  int secondary_size_ = 0;                // hpZ: N, 0 when off for this unit
  at::Tensor secondary_;                  // hpZ: [padded_numel / N] of full_, kept from forward for backward
  at::Tensor summoned_;                   // [padded_numel] master dtype, inside summon_full_params
};

}  // namespace fsdp
