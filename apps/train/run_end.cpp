// The end of a run: the last asynchronous save waited for, each rank's state hash, the simulated
// rank's estimate of the whole model's step, the whole model written, the summary lines and what
// the run kept (with the commands that resume it and load the model), and the trained model's text.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>

#include "batches.h"
#include "fsdp/checkpoint.h"
#include "fsdp/live_manager.h"
#include "live_training.h"
#include "run_end.h"
#include "run_folder.h"
#include "text_sample.h"

namespace train {
namespace {

// Bytes under `path` (a file or a folder), for the saved files' lines.
int64_t bytes_under(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return static_cast<int64_t>(fs::file_size(path, ec));
  int64_t total = 0;
  for (const auto& e : fs::recursive_directory_iterator(path, ec)) {
    if (e.is_regular_file(ec)) total += static_cast<int64_t>(e.file_size(ec));
  }
  return total;
}

std::string megabytes(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MB", static_cast<double>(bytes) / 1e6);
  return text;
}

}  // namespace

void finish_run(const Config& c, const Job& job, const Model& built, const Checkpoints& ck, JsonlWriter& metrics_out,
                RunSummary& summary, LoopResults& done) {
  if (ck.checkpointer) ck.checkpointer->wait();
  if (job.live) job.live->finish();  // the coordinator ends the job once every member has
  // This rank's shards and optimizer state as one hash: replicas (and a run against its restarted
  // twin) compare bit for bit.
  if (!job.plain && !job.simulated && (c.state_hash || job.live)) {
    nlohmann::json e = {{"event", "state_hash"}, {"rank", job.world_rank}, {"shard_rank", job.rank},
                        {"hash", fsdp::state_digest(built.optim.unique_params, *built.optim.adamw)}};
    if (job.live) e["replica"] = job.live->replica();
    metrics_out.write(e);
  }
  if (c.simulate_layers > 0) {
    if (done.sampled_step_ms.empty()) {
      std::cout << "fsdp-train: SIMULATED: run at least 2 steps to time the sample of blocks (the first warms up)" << std::endl;
    } else {
      std::sort(done.sampled_step_ms.begin(), done.sampled_step_ms.end());
      const double median = done.sampled_step_ms[done.sampled_step_ms.size() / 2];
      const double scale = built.workload->flops_scale(c.simulate_layers);
      std::cout << "fsdp-train: SIMULATED: timed " << c.simulate_layers << " of " << built.workload->blocks()
                << " blocks: median step " << static_cast<int64_t>(median) << " ms; the whole model's step "
                << "would compute for about " << static_cast<int64_t>(median * scale) << " ms on this device (x"
                << scale << " by FLOPs; no communication). The memory plan (plan_bytes) is the whole model's; the "
                << "measured peaks are the sample's." << std::endl;
    }
  }
  const bool trained = summary.steps() > 0;
  // An explicit --export-full writes whatever the model holds (weights loaded, steps 0); the run
  // folder keeps a model only when this run trained it.
  if (!ck.export_full.empty() && (trained || !c.export_full.empty()) && (!job.live || job.live->is_writer())) {
    fsdp::export_full(ck.export_full, *ck.wrapped);
    if (job.prints && (!ck.run || !trained)) std::cout << "fsdp-train: wrote the whole model to " << ck.export_full << std::endl;
  }
  if (job.simulated) return;  // a simulated rank's losses are not trained results: nothing to sum up

  // The end of the run: what it did, what it kept, and what the trained model writes.
  if (trained) {
    if (done.last_eval_step != c.steps - 1) {
      done.last_eval = evaluate_held_out(c, *built.workload, *built.model, *built.trainee, *job.mesh, built.device, c.steps - 1);
    }
    summary.set_held_out(done.last_eval);
  }
  summary.end();
  if (job.prints) {
    std::cout << "\n";
    for (const std::string& line : summary.lines()) std::cout << line << "\n";
    if (ck.run && trained) {
      std::ofstream(ck.run->summary_file()) << summary.to_json().dump(2) << "\n";
      // Single-host runs get the local launcher's flag; a job over hosts is started by its launcher.
      // Under --tp the job is every rank, W of them data-parallel.
      const int job_W = job.world->world_size();
      const int nproc = job.env.local_world_size == job_W ? job_W : 0;
      std::cout << "== saved in " << ck.run->path() << "/\n";
      if (!done.last_checkpoint.empty()) {
        std::cout << "   checkpoint " << done.last_checkpoint << " (" << job.checkpoint_kind << ", "
                  << megabytes(bytes_under(done.last_checkpoint)) << ")\n";
      }
      std::cout << "   model      " << ck.export_full << " (" << megabytes(bytes_under(ck.export_full))
                << ", safetensors, the whole model)\n";
      std::cout << "   summary    " << ck.run->summary_file() << "\n";
      if (!done.last_checkpoint.empty()) {
        std::cout << "   resume:    " << resume_command(c, ck.save_dir, 2 * c.steps, nproc) << "\n";
      }
      std::cout << "   in Python: " << python_load_command(ck.export_full) << "\n";
      if (nproc == 0) std::cout << "   (start the resumed job with your launcher, " << job_W << " ranks)\n";
    } else if (ck.run) {
      std::error_code ec;
      std::filesystem::remove(ck.run->path(), ec);  // nothing trained: an empty folder is not kept
    } else if (job.plain) {
      std::cout << "== nothing saved: " << job.plain_flag << " trains without fsdp, and checkpoints need it\n";
    }
    std::cout << std::flush;
  }
  // A model resumed at its last step writes a sample too: the trained model, without training more.
  if (trained || ck.start_step > 0) {
    if (const std::optional<TextSample> sample =
            job.live ? std::nullopt : sample_text(c, *built.workload, *built.model, *built.trainee, *job.mesh, built.device, job.tp)) {
      std::cout << "== sample: " << sample->tokens << " tokens after \"" << sample->prompt << "\" (temperature "
                << c.temperature << ", seed " << c.seed << "; through " << sample->via << ", "
                << static_cast<int64_t>(sample->seconds * 1000) << " ms)\n"
                << sample->text << "\n" << std::flush;
    }
  }
}

}  // namespace train
