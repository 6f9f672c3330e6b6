// fsdp-train's training run (one rank): joins the job (job_setup.h), builds the workload's model
// (model_setup.h: the GPT, T5 or the DHEN-like model, wrapped by fsdp or not, with --local),
// resumes (checkpoints.h), and runs the loop: zero_grad, forward, backward (scaled with fp16), clip,
// step, log; then ends the run (run_end.h).
#include <chrono>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include <torch/torch.h>

#include "batches.h"
#include "checkpoints.h"
#include "config.h"
#include "fsdp/process_memory.h"
#include "job_setup.h"
#include "link_counters.h"
#include "live_training.h"
#include "lr_schedule.h"
#include "memory_log.h"
#include "metrics_log.h"
#include "model_setup.h"
#include "run_end.h"
#include "run_summary.h"
#include "trainee.h"
#include "workload.h"

namespace train {
namespace {

double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int train(const Config& c) {
  fsdp::install_host_allocator();  // before anything is allocated: every CPU tensor counts
  // The learning rate of every step; a resumed run continues the checkpoint's (below).
  LrSchedule schedule = lr_schedule_of(c);  // validated before any rank connects
  const Job job = join_job(c);
  Model built = build_model(c, job);
  const Checkpoints ck = open_checkpoints(c, job, built, schedule);
  if (job.prints) {
    std::cout << "fsdp-train: " << built.workload->name() << " " << built.workload->num_parameters() << " parameters, "
              << built.trainee->describe() << (built.deferred ? ", built deferred" : "") << ", W=" << job.world->world_size()
              << (job.tp ? " (TP " + std::to_string(job.tp->size()) + " x DP " + std::to_string(job.W) + ")" : "") << ", global batch "
              << built.workload->batch_text(c.global_batch) << ", " << built.workload->data_origin()
              << std::endl;
    if (job.W > 1 && !job.simulated) std::cout << "fsdp-train: Gloo communicates over " << job.mesh->network() << std::endl;
  }
  JsonlWriter metrics_out(c.metrics_jsonl);
  if (ck.restarted) {
    metrics_out.write({{"event", "restarted"}, {"rank", job.world_rank}, {"restart", restart_count()},
                       {"resumed_step", ck.start_step}, {"replacement", ck.replacement}});
  }
  const int64_t per_rank = c.global_batch / job.data_W;
  const double tokens_per_step = static_cast<double>(c.global_batch * built.workload->tokens_per_sample());
  auto loss_of = [&](const Batch& b) {
    return built.workload->loss(
        *built.model, built.trainee->forward([&] { return built.workload->forward(*built.model, b, built.trainee->input_dtype()); }),
        b);
  };
  RunSummary summary(built.workload->name() + ", " + built.trainee->describe() + ", W=" +
                         std::to_string(job.live ? job.data_W : job.world->world_size()) +
                         (job.tp ? " (TP " + std::to_string(job.tp->size()) + " x DP " + std::to_string(job.W) + ")" : std::string()),
                     built.workload->throughput_unit());
  LoopResults done;
  std::optional<MemoryTimeline> timeline;
  if (!c.memory_timeline.empty()) timeline.emplace(built.device);
  summary.begin();
  for (int step = ck.start_step; step < c.steps;) {  // ++step at the end: a discarded step is redone
    if (job.live) {
      step = job.live->begin_step(step, metrics_out);
      maybe_slow_for_test(job.world_rank);
      if (step >= c.steps) break;
    }
    built.trainee->begin_step();
    MemoryTimeline* sampling = timeline && step == c.trace_step ? &*timeline : nullptr;
    if (sampling) sampling->start();
    auto mark = [&](const char* phase) {
      if (sampling) sampling->mark(phase);
    };
    nlohmann::json memory = {{"after_construction", to_json(built.constructed)},
                             {"live_before_model", built.live_before_model},
                             {"plan_bytes", built.plan.total()}};
    const fsdp::HostMemoryPeak peak;  // live tensor bytes through the step
    const LinkCounters links_before = LinkCounters::read();
    const auto t0 = std::chrono::steady_clock::now();
    const Batch batch =
        on_device(built.workload->batch(step, c.global_batch, c.seed, job.data_rank * per_rank, (job.data_rank + 1) * per_rank), built.device);
    built.optim.adamw->zero_grad();
    // Micro-batches of this rank's slice: all but the last accumulate without communicating.
    torch::Tensor loss;
    // The step's phases (Metrics::phases, the JSONL's "phases", the trace's "step phases" track):
    // forward with the loss, backward with the DDP baseline's final wait, clip, optimizer step.
    auto forward_phase = [&] { return built.trainee->phase(fsdp::StepPhase::FORWARD); };
    auto backward = [&](const torch::Tensor& l) {
      auto timed = built.trainee->phase(fsdp::StepPhase::BACKWARD);
      if (built.scaler) built.scaler->scale(l).backward(); else l.backward();
      built.trainee->finish_backward();
    };
    if (c.grad_accum == 1) {
      mark("forward");
      {
        auto timed = forward_phase();
        loss = loss_of(batch);
      }
      memory["after_forward"] = to_json(fsdp::process_memory(built.device));
      maybe_kill_for_test(step, job.world_rank, !ck.restarted && !ck.replacement, "forward");
      mark("backward");
      backward(loss);
    } else {
      const int64_t micro = per_rank / c.grad_accum;
      loss = torch::zeros({}, torch::TensorOptions().device(built.device));
      for (int m = 0; m < c.grad_accum; ++m) {
        std::shared_ptr<void> quiet;
        if (m + 1 < c.grad_accum) quiet = built.trainee->no_sync();
        mark("forward");
        torch::Tensor part;
        {
          auto timed = forward_phase();
          part = loss_of(slice(batch, m * micro, micro)) / c.grad_accum;
        }
        if (m + 1 == c.grad_accum) memory["after_forward"] = to_json(fsdp::process_memory(built.device));
        mark("backward");
        backward(part);
        loss = loss + part.detach();
      }
    }
    memory["after_backward"] = to_json(fsdp::process_memory(built.device));
    maybe_kill_for_test(step, job.world_rank, !ck.restarted && !ck.replacement, "backward");
    // The global batch's mean loss: the mean of the ranks' means (equal slices).
    double mean_loss = global_mean(*job.mesh, loss);
    if (job.live && !job.live->end_step(&mean_loss, ms_since(t0), metrics_out)) {
      built.optim.adamw->zero_grad();  // discarded: the next round redoes this step
      continue;
    }
    mark("step");
    double grad_norm = -1.0, r_lr = 0.0;
    if (built.scaler || c.clip > 0) {  // --clip 0 without a scaler: no clip phase at all
      auto timed = built.trainee->phase(fsdp::StepPhase::CLIP);
      if (built.scaler) built.scaler->unscale_(*built.optim.adamw);
      if (c.clip > 0) grad_norm = built.trainee->clip_grad_norm(c.clip, built.workload->model_parallel_parameters(*built.model));
    }
    {
      auto timed = built.trainee->phase(fsdp::StepPhase::OPTIMIZER);
      r_lr = schedule.at(step);
      set_learning_rate(*built.optim.adamw, r_lr);
      if (built.scaler) {
        if (!built.scaler->step(*built.optim.adamw) && job.prints) {
          std::cout << "step " << step << ": gradients overflowed, step skipped" << std::endl;
        }
        built.scaler->update();
      } else {
        built.optim.adamw->step();
      }
    }
    memory["after_step"] = to_json(fsdp::process_memory(built.device));
    memory["peak_live_tensor_bytes"] = peak.start_bytes() + peak.peak_bytes();
    if (sampling) {
      sampling->stop();
      const std::string path = c.memory_timeline + "/memory-rank" + std::to_string(job.world_rank) + ".csv";
      sampling->write_csv(path);
      if (job.prints) {
        std::cout << "fsdp-train: wrote the memory of step " << step << " to " << c.memory_timeline
                  << "/memory-rank*.csv" << std::endl;
      }
    }
    StepRecord r;
    r.rank = job.world_rank;
    r.local_rank = job.env.local_rank;
    r.node_rank = job.world_rank / job.env.local_world_size;
    r.step = step;
    r.loss = mean_loss;
    r.grad_norm = grad_norm;
    r.lr = r_lr;
    r.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    r.time = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    r.tokens_per_s = tokens_per_step / (r.step_ms / 1000.0);
    r.metrics = built.trainee->metrics();
    r.memory = std::move(memory);
    r.links = LinkCounters::read().since(links_before);
    if (!c.trace_dir.empty() && step == c.trace_step) {
      const std::string path = c.trace_dir + "/trace-rank" + std::to_string(job.world_rank) + ".json";
      if (built.trainee->write_trace(path) && job.prints) {
        std::cout << "fsdp-train: wrote the Chrome trace of step " << step << " to " << c.trace_dir
                  << "/trace-rank*.json (open in https://ui.perfetto.dev or chrome://tracing)" << std::endl;
      }
    }
    summary.add_step(step, r.loss, r.step_ms, tokens_per_step);
    nlohmann::json eval;  // the held-out figures, on the steps that evaluate
    if (c.eval_every > 0 && (step + 1) % c.eval_every == 0) {
      done.last_eval = evaluate_held_out(c, *built.workload, *built.model, *built.trainee, *job.mesh, built.device, step);
      done.last_eval_step = step;
      eval = done.last_eval;
      if (job.prints) {
        std::cout << "step " << step;
        for (const auto& [name, value] : eval.items()) std::cout << " | eval " << name << " " << value.get<double>();
        std::cout << std::endl;
      }
    }
    nlohmann::json record = to_json(r);
    if (!eval.is_null()) record["eval"] = eval;
    if (job.simulated) record["simulated"] = true;  // not a trained result
    if (c.simulate_layers > 0) {
      record["simulated_layers"] = {{"built", c.simulate_layers}, {"of", built.workload->blocks()},
                                    {"flops_scale", built.workload->flops_scale(c.simulate_layers)}};
      if (step > ck.start_step) done.sampled_step_ms.push_back(r.step_ms);
    }
    const bool saves = ck.checkpointer && (!job.live || job.live->is_writer());  // live: one group writes
    if (saves && ((c.save_every > 0 && (step + 1) % c.save_every == 0) || step + 1 == c.steps)) {
      done.last_checkpoint = save_checkpoint(c, ck, schedule, built.optim, step, job.prints, record);
    }
    metrics_out.write(record);
    if (job.prints && (!job.live || job.live->is_writer()) && (step % c.log_every == 0 || step == c.steps - 1)) {
      std::cout << (job.simulated ? "[SIMULATED] " : "")
                << progress_line(r, built.trainee->is_sharded(), built.device.is_cuda(), built.workload->throughput_unit())
                << std::endl;
    }
    ++step;
  }
  finish_run(c, job, built, ck, metrics_out, summary, done);
  return 0;
}

}  // namespace train
