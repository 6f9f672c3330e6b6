// unshard() scopes (include/fsdp/fsdp.h, FullyShardedDataParallelBase::unshard): units kept
// gathered, as PyTorch FSDP2's unshard(), for code that reads parameter storage itself (a
// hand-written kernel's data_ptr()), which neither way of knowing when a unit runs can see. A
// pinned unit is gathered once and never freed by the runtime (reshard() returns at once) until
// its last pin goes; its sharded gradients are handed back then, with the shards.
#include "engine/runtime.h"

namespace fsdp {

void Runtime::pin(const std::vector<size_t>& units) {
  check_not_failed();
  TORCH_CHECK(phase_ != Phase::BACKWARD,
              "fsdp: unshard() inside backward: call it before the forward whose backward needs the units gathered "
              "(they stay gathered through that backward)");
  TORCH_CHECK(!summoned_, "fsdp: unshard() inside summon_full_params: end the summon_full_params scope first");
  if (pins_.empty()) pins_.assign(units_.size(), 0);
  touch::Suppress own_work;
  // One unit at a time, in the order given (every rank the same): the rate limiter may hold back
  // a second all-gather until the first is used.
  for (size_t u : units) {
    gather(u);
    use(u);
    units_[u]->handle().unguard_gathered();  // its whole parameters are the point of the scope
    ++pins_[u];
  }
}

void Runtime::unpin(const std::vector<size_t>& units) {
  for (size_t u : units) {
    if (pins_.empty() || pins_[u] == 0) continue;
    --pins_[u];
  }
  // Inside forward or before a backward that may still need them, the iteration's end frees them.
  if (phase_ != Phase::IDLE || !failure_.empty()) return;
  touch::Suppress own_work;
  for (size_t u : units) {
    if (pinned(u)) continue;
    reshard(u);
    units_[u]->reduction().restore();
    register_unreduced_gradients(u);  // the stand-ins it showed in the scope are gone
  }
}

}  // namespace fsdp
