// What the training loop trains: the model under fsdp, or the same model in plain libtorch
// (--local, the baseline). One interface, so the loop has one body.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "fsdp/fsdp.h"
#include "models/gpt.h"

namespace train {

class Trainee {
 public:
  virtual ~Trainee() = default;
  virtual void begin_step() = 0;  // a new step for the metrics
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
  // Scope for micro-batches whose gradients accumulate without communication (no-op locally).
  virtual std::shared_ptr<void> no_sync() = 0;
  virtual void clip_grad_norm(double max_norm) = 0;
  virtual fsdp::Metrics metrics() const = 0;  // what this rank holds and moved this step
  virtual std::string describe() const = 0;
  // This step's Chrome trace; false when there is none (local training records no timeline).
  virtual bool write_trace(const std::string& path) const = 0;
  virtual bool is_sharded() const = 0;
  // The wrapped model, for checkpoints (null for local training).
  virtual fsdp::FullyShardedDataParallelBase* wrapped() = 0;
};

// `unique_params`: the model's parameters, a tied weight once.
std::unique_ptr<Trainee> local_trainee(models::GPT model, std::vector<torch::Tensor> unique_params);
std::unique_ptr<Trainee> sharded_trainee(models::GPT model, std::shared_ptr<fsdp::Mesh> mesh, fsdp::Options options,
                                         const std::string& strategy);

}  // namespace train
