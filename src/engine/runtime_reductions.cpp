// The runtime's reduction queue (runtime.h): gradient reductions issued as units finish their
// backward, advanced without blocking as backward proceeds (a reduce-scatter's input, the unit's
// unsharded gradients, is freed the moment it is done), at most kMaxReductionsInFlight of them
// holding their input (backward waits for the oldest beyond), all-reduces across replicas issued in
// the same order on every rank, and what they hold counted in the metrics.
#include "engine/runtime.h"

namespace fsdp {

void Runtime::note_memory() {
  int64_t cur = 0, grads = 0, reducing = 0;
  for (const Unit* unit : units_) {
    cur += unit->handle().unsharded_bytes();
    grads += unit->reduction().unsharded_grad_bytes();
    reducing += unit->reduction().reducing_bytes();
  }
  memory_.reducing_grads_current = reducing;
  memory_.reducing_grads_peak = std::max(memory_.reducing_grads_peak, reducing);
  memory_.unsharded_current = cur;
  memory_.unsharded_peak = std::max(memory_.unsharded_peak, cur);
  memory_.unsharded_grads_current = grads;
  memory_.unsharded_grads_peak = std::max(memory_.unsharded_grads_peak, grads);
}

void Runtime::reduce(size_t u) {
  touch::Suppress own_work;
  GradientReduction& reduction = units_[u]->reduction();
  // A unit reduced twice in one backward: finish everything issued so far first, in issue order,
  // so its all-reduce cannot overtake another unit's on some ranks only.
  if (reduction.pending()) finish_reductions();
  reduction.begin(no_sync_);
  register_unreduced_gradients(u);  // no_sync: the sums it left on the parameters; else none
  if (reduction.pending()) reduce_fifo_.push_back(u);
  advance_reductions();
  // Bound the unsharded gradients that reductions in flight hold (the plan counts on it): when
  // communication falls behind computation, wait for the oldest, in issue order.
  int held = 0;
  for (size_t v : reduce_fifo_) held += units_[v]->reduction().reducing_bytes() > 0;
  for (size_t v : reduce_fifo_) {
    if (held <= kMaxReductionsInFlight) break;
    GradientReduction& r = units_[v]->reduction();
    if (r.reducing_bytes() == 0) continue;
    overlap_.exposed_reduce_ns += r.complete_reduce_scatter();
    --held;
  }
  note_memory();
}

void Runtime::register_unreduced_gradients(size_t u) {
  for (const c10::StorageImpl* s : guarded_grads_[u]) guard::unregister_grad_storage(s);
  guarded_grads_[u] = units_[u]->reduction().guarded_grad_storages();
  for (const c10::StorageImpl* s : guarded_grads_[u]) guard::register_grad_storage(this, u, s);
}

void Runtime::advance_reductions() {
  // The all-reduces across replicas go out in the replicate group's order (comm/replica_order.h),
  // the same on every rank whatever the timing.
  for (size_t u : reduce_fifo_) units_[u]->reduction().advance();
  note_memory();
}

void Runtime::finish_reductions() {
  touch::Suppress own_work;
  for (size_t u : reduce_fifo_) overlap_.exposed_reduce_ns += units_[u]->reduction().finish();
  reduce_fifo_.clear();
  note_memory();
}

}  // namespace fsdp
