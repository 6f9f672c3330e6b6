// What the training loop trains: the model under fsdp, or the same model in plain libtorch
// (--local, the baseline). One interface, so the loop has one body.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "fsdp/fsdp.h"

namespace train {

class Trainee {
 public:
  virtual ~Trainee() = default;
  virtual void begin_step() = 0;  // a new step for the metrics
  // Runs `forward` (the workload's forward of the model) as the model's forward: under fsdp, as
  // the root's.
  virtual torch::Tensor forward(const std::function<torch::Tensor()>& forward) = 0;
  // Mixed precision's compute dtype, which floating-point inputs are cast to (unset: none).
  virtual std::optional<c10::ScalarType> input_dtype() const = 0;
  // Scope for micro-batches whose gradients accumulate without communication (no-op locally).
  virtual std::shared_ptr<void> no_sync() = 0;
  // Called after each backward: where the DDP-style baseline waits for its gradient all-reduces.
  virtual void finish_backward() {}
  // Clips by the global norm of every gradient; `model_parallel`: parameters each rank holds its
  // own part of (the DHEN's rows), whose squares the norm sums over the ranks.
  // Returns the gradients' global norm before clipping.
  virtual double clip_grad_norm(double max_norm, const std::vector<torch::Tensor>& model_parallel) = 0;
  virtual fsdp::Metrics metrics() const = 0;  // what this rank holds and moved this step
  virtual std::string describe() const = 0;
  // This step's Chrome trace; false when there is none (local training records no timeline).
  virtual bool write_trace(const std::string& path) const = 0;
  virtual bool is_sharded() const = 0;
  // The wrapped model, for checkpoints (null for local training).
  virtual fsdp::FullyShardedDataParallelBase* wrapped() = 0;
  // Counts what runs while the returned object lives as `phase` of the step, in metrics().phases:
  // under fsdp its record_phase (also in the trace, with the exposed communication inside); here,
  // for the others, the wall time only.
  virtual std::shared_ptr<void> phase(fsdp::StepPhase phase);

 protected:
  fsdp::StepPhases timed_phases_;  // the base's phase(): the trainee's begin_step() clears it
};

// `unique_params`: the model's parameters, a tied weight once.
std::unique_ptr<Trainee> local_trainee(std::shared_ptr<torch::nn::Module> model, std::vector<torch::Tensor> unique_params);
// The DDP-style baseline (ddp_baseline.cpp): the whole model on every rank of `mesh`, gradients
// averaged with bucketed all-reduces overlapping backward.
std::unique_ptr<Trainee> ddp_trainee(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<fsdp::Mesh> mesh,
                                     std::vector<torch::Tensor> unique_params);
std::unique_ptr<Trainee> sharded_trainee(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<fsdp::Mesh> mesh,
                                         fsdp::Options options, const std::string& strategy);

}  // namespace train
