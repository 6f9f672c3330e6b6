// fsdp-test-worker phases --out PREFIX
//   The step phases as a user's own loop marks them (FullyShardedDataParallelBase::record_phase),
//   and the misuses the outside review of issue 38 found: a StepPhase out of range (accepted, it
//   swallowed every other phase and corrupted memory), reset_step() inside an open phase (the time
//   before the reset leaked into the new step), and a scope kept past its model (it wrote into the
//   freed model: valgrind and scripts/sanitize see it).
#include <chrono>
#include <thread>

#include "worker.h"

namespace worker {
namespace {

double ms(int64_t ns) { return static_cast<double>(ns) / 1e6; }

json phases_json(const fsdp::Metrics& m) {
  json out;
  for (int p = 0; p < fsdp::kNumStepPhases; ++p) {
    const auto& t = m.phases.phase[p];
    out[fsdp::to_string(static_cast<fsdp::StepPhase>(p))] = {{"ms", ms(t.wall_ns)}, {"count", t.count}};
  }
  return out;
}

}  // namespace

json run_phases(const std::shared_ptr<fsdp::Mesh>& mesh, const Args&) {
  const int rank = mesh->rank();
  const int64_t per = kGlobalBatch / mesh->world_size();
  torch::manual_seed(0);
  auto cfg = models::GPTConfig::preset("tiny");
  models::GPT gpt(cfg);
  fsdp::Options opts;
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  fsdp::FullyShardedDataParallel sharded(gpt, mesh, opts);
  torch::optim::SGD opt(gpt->parameters(), torch::optim::SGDOptions(0.1));
  json out;
  // One step as a loop marks it; the step's wall time by our own clock around it.
  sharded.reset_step();
  const auto t0 = std::chrono::steady_clock::now();
  opt.zero_grad();
  auto loss = gpt_loss([&](const torch::Tensor& x) { return sharded.forward(x); }, 0, rank * per, rank * per + per);
  loss.backward();
  sharded.clip_grad_norm_(1.0);
  {
    auto timed = sharded.record_phase(fsdp::StepPhase::OPTIMIZER);
    opt.step();
  }
  out["step_ms"] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  out["step"] = phases_json(sharded.metrics());
  // A value that is no StepPhase is refused by name.
  try {
    auto bad = sharded.record_phase(static_cast<fsdp::StepPhase>(7));
    out["out_of_range"] = "accepted";
  } catch (const c10::Error& e) {
    out["out_of_range"] = e.what_without_backtrace();
  }
  // reset_step() while OPTIMIZER is open: the 300 ms before the reset stay in the step that ended.
  {
    auto timed = sharded.record_phase(fsdp::StepPhase::OPTIMIZER);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    sharded.reset_step();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  out["after_reset"] = phases_json(sharded.metrics());
  // A scope moved out of a model's lifetime: closing it after the model is gone does nothing.
  {
    std::optional<fsdp::FullyShardedDataParallelBase::PhaseScope> kept;
    {
      torch::manual_seed(0);
      models::GPT other(cfg);
      fsdp::FullyShardedDataParallel second(other, mesh, opts);
      kept.emplace(second.record_phase(fsdp::StepPhase::OPTIMIZER));
    }
    kept.reset();
  }
  out["outlived"] = true;
  return out;
}

}  // namespace worker
