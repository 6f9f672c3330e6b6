// Parameters written in place during forward (runtime.h): Embedding's max_norm renormalizes the
// rows it looks up, in the weight itself. Under fsdp the write lands in the gathered copy (thrown
// away at reshard) or, with F = 1, in this rank's replica only; and each rank renormalizes the rows
// of its own slice of the batch, where local training renormalizes those of the whole batch (and a
// tied head then reads every row). So a unit's parameters are copied before an operator writes
// them, and once it has run, before the next operator touches a unit (or the unit is freed, or the
// forward ends), what every rank changed is merged: an element-wise max over all ranks of the
// changed values (minus infinity where a rank changed nothing), into the gathered copy and the
// shards (only the written elements: the rest of a gathered copy may be dequantized, not the
// shard's exact values). Ranks that change an element compute the same value from the same
// gathered parameters, so the merge is exact, and equal to local training's writes for the rows
// the global batch touched. A write in a low-precision compute copy (mixed precision) cannot reach
// the fp32 master exactly: refused by name.
#include <limits>

#include <c10/core/GradMode.h>

#include "engine/runtime.h"

namespace fsdp {

void Runtime::note_forward_write(size_t u) {
  operator_wrote_ = true;
  if (write_snapshots_[u].defined()) return;  // copied before an earlier write not merged yet
  FlatParamHandle& h = units_[u]->handle();
  if (h.dtypes().casts()) {
    throw Refusal("fsdp: an operator of the forward writes a parameter of unit '" + comm_.unit_name(static_cast<int>(u)) +
                  "' in place (Embedding's max_norm renormalizes its weight, for one) under mixed precision: the "
                  "write lands in the low-precision copy the unit computes with and cannot reach the fp32 master "
                  "exactly. Drop mixed precision for this model, put the module among Options::ignored_modules, or "
                  "make the write outside forward (in summon_full_params()).");
  }
  touch::Suppress own_work;
  at::NoGradGuard no_grad;
  write_snapshots_[u] = h.unsharded().clone();
}

void Runtime::merge_pending_writes() {
  merge_due_ = false;
  for (size_t u = 0; u < units_.size(); ++u) {
    if (write_snapshots_[u].defined()) merge_forward_writes(u);
  }
}

void Runtime::merge_forward_writes(size_t u) {
  const at::Tensor before = std::move(write_snapshots_[u]);
  write_snapshots_[u] = at::Tensor();
  FlatParamHandle& h = units_[u]->handle();
  touch::Suppress own_work;
  at::NoGradGuard no_grad;
  const at::Tensor now = h.unsharded();
  const double none = -std::numeric_limits<double>::infinity();
  // The world group runs on the CPU (Gloo) whatever the device.
  at::Tensor proposal = at::where(now.ne(before), now, at::full_like(now, none)).to(at::kCPU).contiguous();
  InFlight f = comm_.issue(CommKind::WRITE_MERGE, Over::WORLD, static_cast<int>(u), "parameters written in forward",
                           [&] { return Buffers{proposal, at::Tensor()}; });
  comm_.wait(f);
  const at::Tensor written = proposal.to(now.device());
  const at::Tensor merged = at::where(written.ne(none), written, before);
  const MeshInfo& mesh = comm_.mesh();
  if (h.has_unsharded_buffer()) {
    // Only the written elements reach the shard: the rest of the gathered copy may not be the
    // shard's exact values (a quantized all-gather dequantizes them), and merging it back would
    // snap the fp32 master to the quantization grid at every forward.
    const int64_t n = h.layout().shard_numel();
    const at::Tensor mine = written.narrow(0, mesh.shard_rank * n, n);
    h.shard().copy_(at::where(mine.ne(none), mine.to(h.shard().scalar_type()), h.shard()));
    if (h.state() == HandleState::UNSHARDED) now.copy_(merged);  // the rest of this pass sees them
  } else {
    now.copy_(merged);  // F = 1 without a cast: the parameters are the shard
  }
}

}  // namespace fsdp
