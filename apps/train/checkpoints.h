// The run's checkpoints (checkpoints.cpp): where it saves (--save-dir, or the run folder), the
// weights it loads (--load-weights), the checkpoint it resumes from (--resume, or the newest of this
// run after a restart) and each save during the loop.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "config.h"
#include "fsdp/checkpoint.h"
#include "job_setup.h"
#include "lr_schedule.h"
#include "model_setup.h"
#include "run_folder.h"

namespace train {

struct Checkpoints {
  std::optional<RunFolder> run;  // --run-dir's folder, or none
  std::string save_dir;          // where checkpoints go ("": nowhere)
  std::string export_full;       // where the whole model goes after training ("": nowhere)
  fsdp::FullyShardedDataParallelBase* wrapped = nullptr;  // the model under fsdp (null without)
  fsdp::ShardedGradScaler* scaler_ptr = nullptr;
  std::unique_ptr<fsdp::Checkpointer> checkpointer;  // null when nothing is saved
  int start_step = 0;         // the first step to run: the resumed checkpoint's, or 0
  bool restarted = false;     // restarted by a launcher
  bool replacement = false;   // a replacement of a live replica group
};

// Refuses checkpoint flags the run cannot honour, names its run folder, loads --load-weights,
// locks the save folder and resumes (collectives). A resumed run continues the checkpoint's
// learning-rate `schedule`.
Checkpoints open_checkpoints(const Config& c, const Job& job, Model& built, LrSchedule& schedule);

// Saves the checkpoint after `step` and adds what the save cost (the training stall, the memory it
// allocated) to the step's `record`. Returns the checkpoint's folder.
std::string save_checkpoint(const Config& c, const Checkpoints& ck, const LrSchedule& schedule, const Optimizer& optim,
                            int step, bool prints, nlohmann::json& record);

}  // namespace train
