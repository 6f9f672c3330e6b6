// The run's checkpoints: the flags refused without fsdp or peers, where it saves (--save-dir, the
// run folder, a live group's replica-<R>/), the weights it loads, the checkpoint it resumes from
// and the save after a step.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <stdexcept>

#include "checkpoints.h"
#include "fsdp/live_manager.h"
#include "fsdp/process_memory.h"
#include "live_training.h"

namespace train {

Checkpoints open_checkpoints(const Config& c, const Job& job, Model& built, LrSchedule& schedule) {
  // Checkpoints: weights from a file, a resumed run, and the checkpointer for this one.
  if (job.plain && (!c.save_dir.empty() || !c.resume.empty() || !c.export_full.empty() || !c.load_weights.empty() ||
                    (c.run_dir != "auto" && c.run_dir != "none"))) {
    throw std::invalid_argument(std::string("--save-dir, --resume, --export-full, --load-weights and --run-dir need "
                                            "fsdp; drop ") + job.plain_flag);
  }
  if (job.simulated && c.run_dir != "auto" && c.run_dir != "none") {
    throw std::invalid_argument("--simulate-rank: a simulated rank has no peers to save with; drop --run-dir");
  }
  // Where the run keeps what it made (run_folder.h): its checkpoint and the whole model, unless
  // --save-dir / --export-full name other places. A collective: rank 0 names it.
  if (job.live && c.run_dir != "auto" && c.run_dir != "none") {
    throw std::invalid_argument("--live-replicas: name --save-dir (each group saves under replica-<R>/) and --export-full "
                                "instead of --run-dir");
  }
  const std::optional<RunFolder> run = job.plain || job.simulated || job.live ? std::nullopt : RunFolder::create(c, *job.world);
  const std::string save_dir = job.live && !c.save_dir.empty() ? fsdp::live_checkpoint_dir(c.save_dir, job.live->replica())
                               : !c.save_dir.empty()           ? c.save_dir
                               : run                           ? run->checkpoints()
                                                               : "";
  const std::string export_full = !c.export_full.empty() ? c.export_full : run ? run->model_file() : "";
  fsdp::FullyShardedDataParallelBase* wrapped = built.trainee->wrapped();
  fsdp::ShardedGradScaler* scaler_ptr = built.scaler ? &*built.scaler : nullptr;
  if (!c.load_weights.empty()) fsdp::load_model_file(c.load_weights, *wrapped);
  // The checkpointer first: it locks the folder, so a second job saving there stops here, before
  // it loads or trains anything.
  std::unique_ptr<fsdp::Checkpointer> checkpointer;
  if (!save_dir.empty()) {
    fsdp::CheckpointOptions co;
    // A TP model's checkpoints are FULL (its split parameters put together; they load at any TP).
    co.kind = fsdp::parse_state_dict_kind(job.checkpoint_kind);
    co.keep_last = c.keep_last;
    co.async = c.async_save;
    checkpointer = std::make_unique<fsdp::Checkpointer>(job.world, save_dir, co);  // every rank of the job
  }

  int start_step = 0;
  // Restarted by a launcher (--max-restarts, torchrun's): from the newest checkpoint of this run,
  // when there is one. A replacement of a live replica group gets its state from a peer instead.
  const bool restarted = restart_count() > 0;
  const bool replacement = job.live && job.live->replicas().is_replacement();
  std::string resume = replacement ? "" : c.resume;
  if (resume.empty() && restarted && !replacement && !save_dir.empty()) resume = job.live ? c.save_dir : save_dir;
  if (job.live && !resume.empty()) resume = fsdp::newest_live_checkpoint(resume);
  if (!resume.empty() && c.resume.empty() && !fsdp::find_checkpoint(*job.world, resume)) {
    if (job.prints) std::cout << "fsdp-train: restarted, but no checkpoint was saved yet: starting from step 0" << std::endl;
    resume.clear();
  }
  if (!resume.empty()) {
    // Rank 0 decides which checkpoint --resume names; every rank loads that one.
    const auto found = fsdp::find_checkpoint(*job.world, resume);
    if (!found) {
      if (!std::filesystem::exists(resume)) {
        throw std::invalid_argument("--resume " + c.resume + ": no such file or folder (give a checkpoint folder, "
                                    "step-N/, or the folder --save-dir wrote them to)");
      }
      throw std::invalid_argument("--resume " + c.resume + ": neither a checkpoint (no manifest.json) nor a folder of "
                                  "checkpoints (no complete, undamaged step-N/ inside)");
    }
    const std::string path = *found;
    const auto l0 = std::chrono::steady_clock::now();
    const fsdp::TrainingState resumed = fsdp::load_checkpoint(path, *wrapped, built.optim.adamw.get(), scaler_ptr);
    const double load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - l0).count();
    start_step = static_cast<int>(resumed.step);
    const auto saved = nlohmann::json::parse(resumed.user_json);
    if (saved.contains("lr_schedule")) {  // checkpoints from before the schedule ran at a constant --lr
      LrSchedule from_checkpoint;
      try {  // what a hand-edited manifest says is checked as the flags are
        from_checkpoint = LrSchedule::from_json(saved["lr_schedule"]);
        from_checkpoint.validate();
      } catch (const std::exception& e) {
        throw std::invalid_argument("--resume " + path + ": its learning-rate schedule (training.lr_schedule in "
                                    "manifest.json) cannot run: " + e.what());
      }
      // The same schedule however long the runs (a constant rate has no horizon): no note.
      if (from_checkpoint.describe() != schedule.describe() && job.prints) {
        std::cout << "fsdp-train: note: the checkpoint's learning-rate schedule continues (" << from_checkpoint.describe()
                  << "), not the flags' (" << schedule.describe() << "); to train on with another, start a new run "
                  << "from its weights (--load-weights)" << std::endl;
      }
      schedule = from_checkpoint;
      if (schedule.kind != "constant" && c.steps > schedule.horizon && job.prints) {
        std::cout << "fsdp-train: note: steps " << schedule.horizon << " to " << c.steps - 1 << " run at the schedule's "
                  << "floor, " << exact_text(schedule.min_lr) << " (its decay ended at step " << schedule.horizon - 1
                  << "); to decay over a longer run, start a new run from these weights (--load-weights)" << std::endl;
      }
    }
    if (saved.value("seed", c.seed) != c.seed && job.prints) {
      std::cout << "fsdp-train: note: the checkpoint was trained with --seed " << saved["seed"]
                << "; batches from step " << start_step << " on follow --seed " << c.seed << std::endl;
    }
    if (job.prints) {
      std::cout << "fsdp-train: resumed from " << path << " at step " << start_step << " (loaded in "
                << static_cast<int64_t>(load_ms) << " ms)" << std::endl;
      if (start_step >= c.steps) {
        std::cout << "fsdp-train: note: the checkpoint is at step " << start_step << ", not below --steps " << c.steps
                  << ": nothing to train; raise --steps to continue" << std::endl;
      }
    }
  }

  Checkpoints ck;
  ck.run = run;
  ck.save_dir = save_dir;
  ck.export_full = export_full;
  ck.wrapped = wrapped;
  ck.scaler_ptr = scaler_ptr;
  ck.checkpointer = std::move(checkpointer);
  ck.start_step = start_step;
  ck.restarted = restarted;
  ck.replacement = replacement;
  return ck;
}

std::string save_checkpoint(const Config& c, const Checkpoints& ck, const LrSchedule& schedule, const Optimizer& optim,
                            int step, bool prints, nlohmann::json& record) {
  // The batches are a function of the step, so the step is the data position.
  const auto s0 = std::chrono::steady_clock::now();
  const fsdp::HostMemoryPeak save_peak;  // what the save allocates (FULL: one unit at a time)
  const nlohmann::json training = {{"data_position", step + 1}, {"seed", c.seed}, {"lr_schedule", schedule.to_json()}};
  const std::string where = ck.checkpointer->save(*ck.wrapped, optim.adamw.get(), {step + 1, training.dump()}, ck.scaler_ptr);
  const double stall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count();
  int64_t largest_unit = 0;
  for (const auto& u : ck.wrapped->units()) largest_unit = std::max(largest_unit, u.padded_numel * u.element_size);
  record["checkpoint_stall_ms"] = stall;
  record["checkpoint_memory"] = {{"peak_increase_bytes", save_peak.peak_bytes()},
                                 {"largest_unit_bytes", largest_unit},
                                 {"live_before_bytes", save_peak.start_bytes()}};
  if (prints) {
    std::cout << "fsdp-train: " << (c.async_save ? "saving " : "saved ") << where << " (training stalled "
              << static_cast<int64_t>(stall) << " ms)" << std::endl;
  }
  return where;
}

}  // namespace train
