// The sharded gradient scaler for fp16 mixed precision (paper §4.4). fp16's range is narrow: the
// loss is scaled up so small gradients survive, the sharded gradients are scaled back down before
// the optimizer sees them, and a step whose gradients overflowed anywhere is skipped everywhere.
// Each rank holds only its shards, so "anywhere" needs an all-reduce of the overflow flag: without
// it, a rank whose shard happened to stay finite would step while the others skip, and the
// replicas would drift apart.
//
//   fsdp::ShardedGradScaler scaler(mesh);
//   scaler.scale(loss).backward();
//   scaler.unscale_(optim);                 // optional: before clipping
//   fsdp_model.clip_grad_norm_(1.0);
//   scaler.step(optim);                     // skipped on every rank if any rank saw inf/NaN
//   scaler.update();                        // back off after an overflow, grow after a quiet run
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include "fsdp/mesh.h"

namespace fsdp {

struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;  // steps without overflow before the scale grows
};

// What resuming needs of a scaler: its scale and how many good steps it has counted toward growth.
struct GradScalerState {
  double scale = 65536.0;
  int64_t growth_tracker = 0;
};

class ShardedGradScaler {
 public:
  explicit ShardedGradScaler(std::shared_ptr<Mesh> mesh, GradScalerOptions options = {});

  at::Tensor scale(const at::Tensor& loss) const;
  // Divides this rank's gradients (the optimizer's parameters') by the scale and finds out, across
  // all ranks, whether any was inf or NaN. Once per step; step() calls it if you did not.
  void unscale_(torch::optim::Optimizer& optimizer);
  // Steps the optimizer unless some rank's gradients overflowed. Returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  // Backs off after a skipped step, grows after growth_interval good ones; ends the step.
  void update();

  double get_scale() const { return scale_; }
  GradScalerState state() const { return {scale_, good_steps_}; }
  void load_state(const GradScalerState& s) {
    scale_ = s.scale;
    good_steps_ = s.growth_tracker;
  }
  bool found_inf() const { return found_inf_; }

 private:
  void check_tensor_parallel_mesh(torch::optim::Optimizer& optimizer) const;
  std::shared_ptr<Mesh> mesh_;
  GradScalerOptions options_;
  double scale_;
  int64_t good_steps_ = 0;
  bool unscaled_ = false;
  bool found_inf_ = false;
  // The optimizers whose parameters were checked against mesh_ (none split for TP over a larger
  // job) at their first unscale_: each parameter is looked up once, not at every step.
  std::unordered_set<const torch::optim::Optimizer*> mesh_checked_;
};

}  // namespace fsdp
