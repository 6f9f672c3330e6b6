// Deferred initialization (paper §3.1): build a model that fits nowhere without allocating it,
// then let FullyShardedDataParallel materialize it unit by unit, directly as shards.
//
//   auto model = fsdp::deferred_init([&] { return MyModel(cfg); });   // the model's code unchanged
//   fsdp::Options opts;                                               // opts.init_device: where shards go
//   fsdp::FullyShardedDataParallel fsdp_model(model, mesh, opts);     // replays each unit's init
//
// While `build` runs, every tensor factory (empty, zeros, randn, ...) makes a meta tensor (shape
// and dtype, no memory) and every in-place initialization of such a tensor (uniform_, normal_,
// fill_, zero_, copy_ from a real tensor, also on views of it) is recorded for that tensor. A
// random op also records the generator's state before it and runs once on a throw-away tensor
// of the same layout, so the generator advances exactly as in a normal construction: replaying
// a tensor's ops later, from those states, gives bit for bit the values the normal construction
// would have given, in any order and one unit at a time. Peak memory while building is one
// tensor (the throw-away); while sharding, the unit being materialized plus the shards.
//
// Constructors may create tensors, take views of them and initialize them in place; a
// constructor that computes with a deferred tensor's values (t.sum(), t * 2, t.clone()) gets a
// clear error naming the operator: build such a model normally, or with meta_init for planning.
//
// meta_init is the same without the replay record (no throw-away runs, no generator states): it
// builds even a 175-billion-parameter model in seconds, for planning (fsdp::plan_memory), but
// cannot be materialized.
#pragma once

#include <ATen/ATen.h>

namespace fsdp {

// While alive, tensor factories on this thread make deferred tensors (meta, with the replay
// record when `record`): what deferred_init and meta_init put around `build`. Nests.
class DeferredInitGuard {
 public:
  explicit DeferredInitGuard(bool record);
  ~DeferredInitGuard();
  DeferredInitGuard(const DeferredInitGuard&) = delete;
  DeferredInitGuard& operator=(const DeferredInitGuard&) = delete;

 private:
  bool previous_record_;
  bool previous_active_;
};

template <typename Build>
auto deferred_init(Build&& build) -> decltype(build()) {
  DeferredInitGuard guard(/*record=*/true);
  return build();
}

template <typename Build>
auto meta_init(Build&& build) -> decltype(build()) {
  DeferredInitGuard guard(/*record=*/false);
  return build();
}

// Whether `t` was made by deferred_init or meta_init and not materialized yet.
bool is_deferred(const at::Tensor& t);

// For state that is already this rank's own and no bigger than what it keeps, like a
// model-parallel module's own rows of a table (models/row_sharded_embedding.h): inside
// deferred_init, tensors this thread makes while the scope is alive are real (allocated and
// initialized now, drawing from the generators as a normal construction does), so nothing has to
// replay them later; inside meta_init they stay meta (nothing is allocated while planning).
// Elsewhere it does nothing. Nests.
class NotDeferred {
 public:
  NotDeferred();
  ~NotDeferred();
  NotDeferred(const NotDeferred&) = delete;
  NotDeferred& operator=(const NotDeferred&) = delete;

 private:
  bool previous_included_;
};

}  // namespace fsdp
