// The job this rank trains in (job_setup.cpp): its ranks (fsdp's, the data's, the whole job's),
// live replica groups and tensor parallelism, who prints, and the flags refused before any model
// is built.
#pragma once

#include <memory>
#include <string>

#include "config.h"
#include "fsdp/mesh.h"
#include "fsdp/tensor_parallel.h"
#include "live_training.h"

namespace train {

struct Job {
  std::unique_ptr<LiveTraining> live;  // --live-replicas (live_training.h), or null
  std::shared_ptr<fsdp::Mesh> world;
  fsdp::LaunchEnv env;
  std::shared_ptr<fsdp::TensorParallel> tp;  // --tp N, or null
  std::string checkpoint_kind;               // --checkpoint-kind, auto resolved
  // What fsdp, the batch slices and checkpoints see: the DP ranks (all of them without --tp).
  std::shared_ptr<fsdp::Mesh> mesh;
  bool simulated = false;  // --simulate-rank
  int world_rank = 0;             // this rank in the whole job
  int W = 1, rank = 0;            // fsdp's ranks
  int data_W = 1, data_rank = 0;  // who reads which slice of the global batch
  bool prints = false;            // what this process prints
  // Without fsdp: one process (--local), or every rank a whole replica (--ddp-baseline).
  bool plain = false;
  const char* plain_flag = "";
};

// Connects this rank to its job (a collective) and refuses the flags that cannot run together.
Job join_job(const Config& c);

}  // namespace train
