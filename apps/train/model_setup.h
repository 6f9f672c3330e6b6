// The model this rank trains (model_setup.cpp): the workload's model built (deferred or whole),
// split under --tp, checked against the memory budget, wrapped by fsdp (or not, --local and
// --ddp-baseline), with its optimizer and fp16's loss scaler.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <torch/torch.h>

#include "config.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/plan.h"
#include "fsdp/process_memory.h"
#include "job_setup.h"
#include "trainee.h"
#include "workload.h"

namespace train {

// AdamW with no weight decay on biases and norms (parameters keep their names under fsdp), each
// parameter once (libtorch lists a tied weight under both names): fsdp::FusedAdamW, or libtorch's
// (--optimizer adamw-libtorch).
struct Optimizer {
  std::vector<torch::Tensor> unique_params;
  std::unique_ptr<torch::optim::Optimizer> adamw;
};

struct Model {
  std::unique_ptr<Workload> workload;
  torch::Device device{torch::kCPU};
  bool deferred = false;  // built by fsdp::deferred_init
  fsdp::MemoryPlan plan;
  int64_t live_before_model = 0;  // live tensor bytes before the model was built
  std::shared_ptr<torch::nn::Module> model;
  std::optional<fsdp::ShardedGradScaler> scaler;  // --mixed-precision fp16
  std::unique_ptr<Trainee> trainee;
  Optimizer optim;
  fsdp::ProcessMemory constructed;  // the process's memory once everything above was built
};

// Builds `job`'s model from the seed and makes it trainable (collectives under fsdp).
Model build_model(const Config& c, const Job& job);

}  // namespace train
