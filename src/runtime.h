// The root's runtime: the per-iteration state machine that decides when each unit is gathered,
// freed and reduced (paper §3.2.3, §4.3).
//
//   IDLE ──forward──▶ FORWARD ──returns──▶ FORWARD_DONE ──first gradient──▶ BACKWARD ──end──▶ IDLE
//                        ▲                      │ (another forward: two forwards, one backward)
//                        └──────────────────────┘
//
// FORWARD: the first operator touching a unit gathers it; with reshard-after-forward the unit
//   that ran before it is freed (the root unit stays gathered until after backward).
// BACKWARD: a touched unit is gathered again; once every parameter of a unit that forward used
//   has its gradient accumulated (post-accumulate-grad hooks), its gradients are reduced and the
//   unit is freed. The end-of-backward callback (Engine::queue_callback) reduces what is left,
//   frees everything and hands the sharded gradients back to the parameters.
#pragma once

#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include <torch/nn/module.h>

#include "flat_param_handle.h"
#include "fsdp/fsdp.h"
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

 private:
  void start_backward_locked();
  void finish_backward();
  void end_iteration();
  void reshard_unit(size_t unit);
  void unshard_unit(size_t unit);
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
  std::vector<std::vector<bool>> expected_;  // per unit, per parameter: forward used it with grad
  std::vector<int> expected_count_, ready_count_;

  CommBytes comm_;
  MemoryBytes memory_;
  int64_t step_ = 0;
};

}  // namespace fsdp
