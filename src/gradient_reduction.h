// One unit's gradient pipeline (paper §3.2.2, §3.3.4): from the unsharded gradients autograd
// accumulates into the unit's parameters to the sharded gradients the optimizer steps.
//
//   stash    start of an iteration: take the sharded gradients the user holds (possibly none
//            after zero_grad) off the parameters, so autograd accumulates this iteration's
//            gradients into empty .grad fields of the unsharded shape
//   begin    after backward computed the unit's gradients: flatten them into one buffer of the
//            reduce dtype and issue the reduce-scatter in the shard group (with replicas, the
//            all-reduce across them follows: at once on CUDA, stream-ordered; on CPU once the
//            reduce-scatter is done, see advance). With no_sync, add them to a local unsharded
//            accumulator instead; the next synchronized reduction sends accumulator + new.
//   advance  without blocking: issue the replica all-reduce once the reduce-scatter is done
//   finish   wait, divide by W (sum of per-rank means -> global mean), cast back to the sharded
//            gradient's dtype, add the stashed gradient, and hold the result for restore
//   restore  end of an iteration: give the parameters their sharded gradients (set_ aliases of
//            one flat shard, so optimizers may detach_() them as zero_grad does)
//
// A reduction holds the buffers its collectives read and write until it has waited for them.
#pragma once

#include <optional>
#include <vector>

#include <ATen/ATen.h>

#include "comm_context.h"
#include "flat_param_handle.h"

namespace fsdp {

class GradientReduction {
 public:
  GradientReduction(int index, const FlatParamHandle& handle, CommContext& comm);

  void stash();
  // Whether a parameter holds a gradient this iteration's reduction has not taken yet.
  bool has_unreduced() const;
  void begin(bool no_sync);
  bool advance();  // true while a reduce-scatter still has to finish before its all-reduce
  int64_t finish();  // returns the nanoseconds the calling thread was blocked
  bool pending() const { return pending_.has_value(); }
  void restore();  // requires no reduction in flight

  int64_t sharded_grad_bytes() const;    // the sharded gradients the parameters hold now
  int64_t unsharded_grad_bytes() const;  // the no_sync accumulator allocated now

 private:
  struct Pending {
    at::Tensor input;          // [padded_numel] unsharded gradients (reduce-scatter input)
    at::Tensor output;         // [shard_numel] (or the input itself with F = 1)
    InFlight reduce_scatter, all_reduce;
    std::vector<bool> got;     // which parameters contributed gradients
  };
  void issue_all_reduce(Pending& r);

  int index_;
  const FlatParamHandle& handle_;
  CommContext& comm_;
  std::vector<at::Tensor> grads_;   // stashed, then the reduced sharded gradients, per parameter
  at::Tensor grad_shard_;           // [shard_numel] storage behind the reduced grads_
  at::Tensor no_sync_accum_;        // [padded_numel] unsharded gradients under no_sync
  std::vector<bool> no_sync_got_;   // which parameters the accumulator holds gradients of
  std::optional<Pending> pending_;
};

}  // namespace fsdp
