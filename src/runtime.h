// The iteration (paper §3.2.3, §3.3, §4.3): the state machine that decides, for the whole model,
// when each unit is gathered, freed and reduced. Per-unit state lives in Unit (unit.h); this file
// holds only what is about the iteration: the phase, the execution order, prefetch decisions,
// the rate limiter, the order of reductions and the end-of-backward callback.
//
//   IDLE ──forward──▶ FORWARD ──returns──▶ FORWARD_DONE ──first gradient──▶ BACKWARD ──end──▶ IDLE
//                        ▲                      │ (another forward: two forwards, one backward)
//                        └──────────────────────┘
//
// FORWARD: the first operator touching a unit gathers it (waiting for its all-gather only then,
//   so a prefetched one has had time to arrive); with forward prefetch the units the previous
//   iteration ran next are issued right away. With reshard-after-forward the unit that ran
//   before is freed (the root unit stays gathered until after backward).
// BACKWARD: a unit needed again is gathered; with BACKWARD_PRE the next unit in reverse
//   post-forward order is issued as this one starts, with BACKWARD_POST as it ends. Once every
//   parameter of a unit that forward used has its gradient accumulated (post-accumulate-grad
//   hooks), its reduce-scatter is issued and the unit is freed, while backward goes on. The
//   end-of-backward callback (Engine::queue_callback) waits for the reductions, reduces what is
//   left, frees everything and hands the sharded gradients back to the parameters.
//
// Collectives are issued in an order that depends only on the model's execution (never on
// timing), so every rank issues the same sequence on each process group.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "comm_context.h"
#include "execution_order.h"
#include "fsdp/metrics.h"
#include "fsdp/options.h"
#include "rate_limiter.h"
#include "touch_detection.h"
#include "unit.h"

namespace fsdp {

enum class Phase { IDLE, FORWARD, FORWARD_DONE, BACKWARD };

class Runtime : public TouchSink, public std::enable_shared_from_this<Runtime> {
 public:
  // `units` outlive the runtime.
  Runtime(std::vector<Unit*> units, CommContext& comm, const Options& options, bool reshard_after_forward);
  ~Runtime() override;
  void install_hooks();  // needs shared_from_this, so called right after construction

  void begin_forward();
  void end_forward(bool ok);
  void on_touch(size_t unit, const c10::TensorImpl* tensor, bool builds_graph) override;
  void set_no_sync(bool on) { no_sync_ = on; }
  Phase phase() const { return phase_; }

  const MemoryBytes& memory() const { return memory_; }
  const OverlapStats& overlap() const { return overlap_; }
  void reset_step();  // peaks and overlap counters start again

 private:
  void on_grad_arriving(size_t unit);
  void on_grad_accumulated(size_t unit, size_t param);
  void on_backward_started();
  void finish_backward();
  void end_iteration();
  // Issue unit's all-gather if it is sharded (through the rate limiter).
  void gather(size_t unit);
  // Make unit's parameters usable now: gather if needed and wait.
  void use(size_t unit);
  void reshard(size_t unit);
  void forward_begins(size_t unit);
  void forward_ends(size_t unit);
  void backward_needs(size_t unit);
  void prefetch_backward(size_t unit);
  void reduce(size_t unit);
  void advance_reductions();
  void finish_reductions();
  void note_memory();

  std::vector<Unit*> units_;
  std::optional<size_t> root_unit_;
  CommContext& comm_;
  Options options_;
  bool reshard_after_forward_;

  Phase phase_ = Phase::IDLE;
  bool no_sync_ = false;
  bool backward_pending_ = false;       // a forward of this iteration built a graph through a unit
  bool pending_before_forward_ = false;
  std::optional<size_t> current_unit_;  // the non-root unit that forward is in now
  std::vector<size_t> reduce_fifo_;     // units with a reduction in flight, in issue order
  ExecutionOrder order_;
  RateLimiter limiter_;

  MemoryBytes memory_;
  OverlapStats overlap_;
};

}  // namespace fsdp
