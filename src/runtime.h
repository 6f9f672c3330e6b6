// The root's runtime: the per-iteration state machine that decides when each unit is gathered,
// freed and reduced (paper §3.2.3, §4.3).
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
#include <unordered_map>
#include <vector>

#include <torch/nn/module.h>

#include "comm_streams.h"
#include "execution_order.h"
#include "flat_param_handle.h"
#include "fsdp/fsdp.h"
#include "rate_limiter.h"
#include "timeline.h"
#include "touch_detection.h"
#include "unit_decomposition.h"

namespace fsdp {

enum class Phase { IDLE, FORWARD, FORWARD_DONE, BACKWARD };

class Runtime : public TouchSink, public std::enable_shared_from_this<Runtime> {
 public:
  Runtime(std::shared_ptr<torch::nn::Module> root, std::shared_ptr<Mesh> mesh, Options options);
  ~Runtime() override;
  void install_hooks();  // needs shared_from_this, so called right after construction

  void begin_forward();
  void end_forward(const std::vector<at::Tensor>& outputs, bool ok);
  void on_touch(size_t unit, const c10::TensorImpl* tensor) override;
  void on_grad_arriving(size_t unit);
  void on_grad_accumulated(size_t unit, size_t param);
  void on_backward_started();

  Metrics metrics() const;
  void reset_step();
  void set_no_sync(bool on) { no_sync_ = on; }
  double clip_grad_norm(double max_norm);
  std::vector<UnitInfo> units() const;
  int shard_size() const { return shard_size_; }
  Phase phase() const { return phase_; }
  std::vector<Span> timeline() const { return timeline_.spans(); }
  const Options& options() const { return options_; }
  void write_trace(const std::string& path) const;

 private:
  void broadcast_module_states();
  void materialize_buffers();
  void finish_backward();
  void end_iteration();
  // Issue unit's all-gather if it is sharded (through the rate limiter).
  void gather(size_t unit, bool backward_pass);
  // Make unit's parameters usable now: gather if needed and wait.
  void use(size_t unit, bool backward_pass);
  void reshard_unit(size_t unit);
  void forward_begins(size_t unit);
  void forward_ends(size_t unit);
  void backward_needs(size_t unit);
  void prefetch_backward(size_t unit);
  void reduce_unit(size_t unit);
  void advance_reductions();
  void finish_reductions();
  void note_memory();
  bool contains(size_t outer, size_t inner) const;

  std::shared_ptr<torch::nn::Module> root_;
  std::shared_ptr<Mesh> mesh_;
  Options options_;
  int shard_size_ = 1;
  GroupPtr shard_group_;
  bool reshard_after_forward_ = true;
  std::vector<UnitPlan> plans_;
  std::vector<std::unique_ptr<FlatParamHandle>> handles_;
  std::optional<size_t> root_unit_;
  std::unordered_map<const c10::TensorImpl*, std::pair<size_t, size_t>> param_index_;  // -> (unit, param)

  Phase phase_ = Phase::IDLE;
  bool no_sync_ = false;
  bool backward_pending_ = false;         // a forward of this iteration built a graph
  std::optional<size_t> current_unit_;    // the non-root unit that forward is in now
  std::vector<std::optional<size_t>> forward_span_, backward_span_;  // open compute spans per unit
  std::vector<bool> backward_started_, backward_done_;
  std::vector<size_t> reduce_fifo_;       // units with a reduction in flight, in issue order
  ExecutionOrder order_;
  std::vector<std::vector<bool>> expected_;  // per unit, per parameter: forward used it with grad
  std::vector<int> expected_count_, ready_count_;

  std::unique_ptr<CommStreams> streams_;
  std::unique_ptr<RateLimiter> limiter_;
  Timeline timeline_;
  c10::Device device_{c10::kCPU};

  CommBytes comm_;
  MemoryBytes memory_;
  OverlapStats overlap_;
  int64_t alloc_retries_at_reset_ = 0;
  int64_t step_ = 0;
};

}  // namespace fsdp
