// One unit's gradient pipeline (paper §3.2.2, §3.3.4): from the unsharded gradients autograd
// accumulates into the unit's parameters to the sharded gradients the optimizer steps.
//
// Between iterations the parameters hold their gradients in one of two forms, and whatever the
// user does to them (zero_grad to None or to zeros, at any point of a loop) acts on what they hold:
//   SHARDED    reduced: each parameter's .grad is this rank's part of the global mean gradient (a
//              1-D slice; the whole parameter's shape with F = 1), an alias of one flat shard
//   UNSHARDED  after no_sync backwards: each .grad is this rank's own unreduced gradient sum in the
//              parameter's full shape and the master dtype (so that many low-precision micro-
//              batches do not round away), as DDP leaves it; the next synchronized backward
//              reduces it
//
//   stash    backward reaches the unit (pre-backward, never at forward: a zero_grad between
//            forward and backward must count): SHARDED gradients are taken off the parameters so
//            autograd accumulates this backward's gradients into empty .grad fields of the
//            unsharded shape; UNSHARDED ones stay, and autograd adds to them
//   begin    synchronized: flatten into one buffer of the reduce dtype, issue the reduce-scatter in
//            the shard group (with replicas the all-reduce follows: at once on CUDA,
//            stream-ordered; on CPU once the reduce-scatter is done, in the order of the replicate
//            group, which every model wrapped over the mesh shares: comm/replica_order.h).
//            no_sync: leave the gradients on the parameters in the UNSHARDED form; a stashed
//            SHARDED gradient is folded in as F × itself in this rank's slice, which the later
//            reduction (sum over W ranks of F·g placed by R = W/F replicas, divided by W) returns
//            to exactly g
//   advance  without blocking, polled as backward proceeds: once the reduce-scatter is done, free
//            its input (the unit's unsharded gradients, the largest buffer of the pipeline, so
//            that only reductions in flight hold unsharded gradients, the paper's memory model)
//            and, with replicas, issue the all-reduce of its output
//   finish   wait, divide by W (sum of per-rank means -> global mean), cast back to the master
//            dtype, add the stashed gradient, and hold the result for restore
//   restore  end of an iteration: give the parameters their SHARDED gradients (set_ aliases of one
//            flat shard, so optimizers may detach_() them as zero_grad does)
//   hold     instead of restore, for a unit an unshard() scope keeps gathered: its parameters hold
//            whole values, not the shards the reduced gradients belong to, so the gradients stay
//            here until the scope ends and each parameter shows a stand-in .grad (keyed, of its
//            shape, no memory): an optimizer step or a clip inside the scope reads it and is
//            refused (without it the step would skip parameters whose .grad is None, silently); a
//            zero_grad to None inside the scope drops the stand-in and, with it, the gradient
//
// A reduction holds the buffers its collectives read and write until it has waited for them.
#pragma once

#include <optional>
#include <vector>

#include <ATen/ATen.h>

#include "comm/comm_context.h"
#include "engine/flat_param_handle.h"

namespace fsdp {

class TensorParallel;

// The most reduce-scatters whose inputs (a unit's unsharded gradients) may be alive at once:
// backward waits for the oldest beyond it (Runtime::reduce), and the memory plan counts on it.
inline constexpr int kMaxReductionsInFlight = 2;

class GradientReduction {
 public:
  enum class Form { SHARDED, UNSHARDED };

  GradientReduction(int index, const FlatParamHandle& handle, CommContext& comm);
  ~GradientReduction();
  GradientReduction(const GradientReduction&) = delete;
  GradientReduction& operator=(const GradientReduction&) = delete;

  Form form() const { return form_; }
  // Parameters (by index) whose gradient each TP rank computes a part of (partial_gradient_rule in
  // fsdp/tensor_parallel.h): begin sums them over `tp`'s group before the data-parallel reduction.
  void set_tensor_parallel_sum(const TensorParallel* tp, std::vector<size_t> params);
  void stash();
  // Whether the parameters hold gradients that a synchronized reduction has still to reduce.
  bool has_unreduced() const;
  // Whether they hold no_sync gradients (UNSHARDED, some defined): this rank's own sums, which an
  // optimizer step or a clip must not use.
  bool holds_unreduced_no_sync() const;
  // The storages of what the parameters hold as .grad that no optimizer or clip may read (keyed,
  // for the guard): the no_sync sums, or the stand-ins of gradients held for an unshard() scope.
  std::vector<const c10::StorageImpl*> guarded_grad_storages() const;
  void begin(bool no_sync);
  // Polls without blocking: frees a finished reduce-scatter's input and lets all-reduces across
  // replicas go out (in the replicate group's order, replica_order.h).
  void advance();
  // Blocks until the reduce-scatter is done, frees its input and issues the all-reduce (with
  // replicas); returns the nanoseconds the calling thread was blocked.
  int64_t complete_reduce_scatter();
  int64_t finish();  // returns the nanoseconds the calling thread was blocked
  bool pending() const { return pending_.has_value(); }
  // Which parameters got a gradient is the ranks' to say together, not each rank's: ranks that ran
  // different parameters of one unit (each rank its own expert) each got only theirs, yet every
  // rank's reduced shard holds the others' contributions. finish() keeps the reduced values of
  // parameters this rank gave no gradient as "unclaimed"; at the end of backward presence()
  // appends, per parameter, whether it holds a gradient after this backward's reductions (1) or
  // not (0), and settle() gives the unclaimed ones whose flag any rank set (`any`, the flags'
  // maximum over the ranks; null: none) their gradient and drops the rest, which stay None, as
  // in local training.
  void presence(std::vector<int64_t>& out) const;
  void settle(const int64_t* any);
  void restore();  // requires no reduction in flight
  // An unshard() scope's end of iteration (see hold above); held() until restore, and
  // held_storage() is the stand-ins' storage, for the guard.
  void hold();
  bool held() const { return !stand_ins_.empty(); }
  const c10::StorageImpl* held_storage() const;

  int64_t sharded_grad_bytes() const;    // the SHARDED gradients the parameters hold now
  int64_t unsharded_grad_bytes() const;  // the UNSHARDED (no_sync) gradients they hold now
  int64_t reducing_bytes() const;        // unsharded gradients an unfinished reduce-scatter still reads

 private:
  const TensorParallel* tp_sum_group_ = nullptr;
  std::vector<size_t> tp_sum_params_;
  // The partial gradients in `flat` summed over the TP group (begin, synchronized).
  void sum_over_tensor_parallel(at::Tensor& flat);
  struct Pending {
    at::Tensor input;          // [padded_numel] unsharded gradients (reduce-scatter input), freed
                               // as soon as the reduce-scatter is done
    at::Tensor output;         // [shard_numel] (or the input itself with F = 1)
    InFlight reduce_scatter, all_reduce;
    std::vector<bool> got;     // which parameters contributed gradients
    // CPU with replicas: its place in the replicate group's all-reduce order, until issued.
    std::optional<ReplicaAllReduceOrder::Ticket> ticket;
    int64_t blocked_ns = 0;    // waited for its reduce-scatter when the order issued its all-reduce
  };
  // Issues the all-reduce across replicas (with a ticket: through the group's order).
  void issue_all_reduce(Pending& r);
  void issue_all_reduce_now(Pending& r);
  // After the reduce-scatter is done: free its input (F > 1; with F = 1 it is the output).
  void release_input(Pending& r);
  void keep_unsharded();  // the no_sync half of begin
  // Takes the stand-ins off the parameters; a parameter whose .grad is no longer its stand-in had
  // its gradient dropped by the user (zero_grad to None), so the held one is dropped too.
  void take_stand_ins();

  int index_;
  const FlatParamHandle& handle_;
  CommContext& comm_;
  Form form_ = Form::SHARDED;
  bool stashed_ = false;            // grads_ holds this iteration's stashed SHARDED gradients
  std::vector<at::Tensor> grads_;   // stashed, then the reduced sharded gradients, per parameter
  std::vector<at::Tensor> unclaimed_;  // reduced, where this rank gave no gradient (see settle)
  // The storage behind the reduced gradients the parameters hold, by a weak reference: the
  // parameters' .grad own it, so that zero_grad (to None) frees it, as in local training.
  c10::weak_intrusive_ptr<c10::StorageImpl> grad_storage_{c10::intrusive_ptr<c10::StorageImpl>()};
  int64_t grad_storage_bytes_ = 0;
  std::optional<Pending> pending_;
  std::vector<at::Tensor> stand_ins_;  // per parameter while held (undefined: no gradient held)
};

}  // namespace fsdp
