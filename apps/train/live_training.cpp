#include "live_training.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "lr_schedule.h"

namespace train {
namespace {

using Clock = std::chrono::steady_clock;

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

std::string LiveTraining::strategy_within(const std::string& strategy) {
  return strategy == "hybrid_shard_zero2" ? "shard_grad_op" : "full_shard";
}

int LiveTraining::ranks_per_replica(const Config& c, int local_world_size) {
  return c.shard_size > 0 ? c.shard_size : local_world_size;
}

void LiveTraining::check(const Config& c, int world_size, int local_world_size) {
  if (c.strategy != "hybrid_shard" && c.strategy != "hybrid_shard_zero2") {
    throw std::invalid_argument("--live-replicas keeps the replica groups of a hybrid strategy training when one fails; "
                                "--strategy " + c.strategy + " has no replicas to keep. Use --strategy hybrid_shard "
                                "(or hybrid_shard_zero2), or the launcher's --max-restarts for a restart from the "
                                "newest checkpoint");
  }
  for (const auto& [set, flag] : std::vector<std::pair<bool, std::string>>{
           {c.tp > 1, "--tp"}, {c.dropout > 0, "--dropout"}, {c.mixed_precision == "fp16", "--mixed-precision fp16"},
           {c.grad_accum > 1, "--grad-accum"}, {c.local || c.ddp_baseline, "--local/--ddp-baseline"},
           {c.reshard_after_forward_to != 0, "--hpz/--reshard-after-forward-to"}}) {
    if (set) {
      throw std::invalid_argument("--live-replicas with " + flag + ": not supported (a joining group could not take that "
                                  "state from a peer, or the groups would part); drop one of them");
    }
  }
  fsdp::check_live_layout(world_size, local_world_size, ranks_per_replica(c, local_world_size));
}

std::unique_ptr<LiveTraining> LiveTraining::connect(const Config& c, const fsdp::LaunchEnv& env) {
  check(c, env.world_size, env.local_world_size);
  fsdp::LiveOptions o = fsdp::LiveOptions::from_environment();
  o.ranks_per_replica = ranks_per_replica(c, env.local_world_size);
  o.total_steps = c.steps;
  o.schedule = c.live_schedule;
  return std::unique_ptr<LiveTraining>(new LiveTraining(c, fsdp::LiveManager::connect(env, o)));
}

void LiveTraining::declare_identity(const torch::nn::Module& model, const std::string& workload) {
  live_->declare_identity({
      {"model", workload + ", " + fsdp::parameters_identity(model)},
      {"optimizer", c_.optimizer + " lr " + lr_schedule_of(c_).describe() +
                        " weight decay " + exact_text(c_.weight_decay) + " clip " + exact_text(c_.clip)},
      {"strategy", c_.strategy + " mixed precision " + c_.mixed_precision},
      {"data", c_.data + ", global batch " + std::to_string(c_.global_batch) + ", block size " +
                   std::to_string(c_.block_size)},
      {"seed", std::to_string(c_.seed)},
  });
}

bool LiveTraining::prints() const { return live_->replica_mesh()->rank() == 0; }

nlohmann::json LiveTraining::event(const std::string& name) const {
  return {{"event", name},
          {"rank", fsdp::LaunchEnv::from_environment().rank},
          {"replica", live_->replica()},
          {"generation", live_->replicas().generation()},
          {"time", std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()}};
}

void LiveTraining::track(fsdp::FullyShardedDataParallelBase& model, torch::optim::Optimizer& optimizer) {
  live_->track(model, optimizer);
}

int LiveTraining::begin_step(int held_step, JsonlWriter& out) {
  const auto t0 = Clock::now();
  live_->set_step(held_step);
  (void)live_->start_step();
  const fsdp::LiveRound& round = live_->round();
  const auto t1 = Clock::now();
  if (round.step >= c_.steps) return static_cast<int>(round.step);
  step_ = static_cast<int>(round.step);
  const bool first = members_.empty();
  members_ = round.members;
  if (!round.left.empty()) {
    nlohmann::json e = event("replica_left");
    e["replicas"] = round.left;
    e["step"] = round.step;
    e["members"] = round.members;
    // From the end of the discarded step (or of the last step) to the start of this one.
    e["pause_ms"] = discarded_at_ ? ms_between(*discarded_at_, t1) : ms_between(t0, t1);
    e["wait_ms"] = round.wait_ms;
    out.write(e);
    if (prints()) {
      std::cout << "fsdp-train: [replica " << replica() << "] replica group(s) " << e["replicas"].dump()
                << " left at step " << round.step << "; training on with " << e["members"].dump() << " after "
                << static_cast<int64_t>(e["pause_ms"].get<double>()) << " ms" << std::endl;
    }
  }
  if (!round.joined.empty() && !first) {
    nlohmann::json e = event("replica_joined");
    e["replicas"] = round.joined;
    e["step"] = round.step;
    e["source"] = round.source;
    e["members"] = round.members;
    e["i_joined"] = round.i_joined;
    e["transfer_ms"] = round.transfer_ms;
    e["transfer_bytes"] = round.transfer_bytes;
    out.write(e);
    if (prints()) {
      std::cout << "fsdp-train: [replica " << replica() << "] replica group(s) " << e["replicas"].dump()
                << " joined at step " << round.step << " with the state of group " << round.source << " ("
                << round.transfer_bytes << " bytes per rank in " << static_cast<int64_t>(round.transfer_ms)
                << " ms); members " << e["members"].dump() << std::endl;
    }
  } else if (first && prints()) {
    std::cout << "fsdp-train: [replica " << replica() << "] in the job from step " << round.step << " with groups "
              << nlohmann::json(round.members).dump()
              << (round.i_joined ? " (state received from group " + std::to_string(round.source) + ")" : "") << std::endl;
  }
  discarded_at_.reset();
  return static_cast<int>(round.step);
}

bool LiveTraining::end_step(double* loss, double step_ms, JsonlWriter& out) {
  // One average: the gradient shards (each the group's mean already) and the group's mean loss.
  at::Tensor l = torch::full({1}, *loss, torch::kFloat);
  std::string why = "this rank's replica average failed (FSDP_FAULT_AVERAGE_FAILS_FROM)";
  bool ok = true, committed = false;
  if (replica_average_fails_for_test(step_, fsdp::LaunchEnv::from_environment().rank)) {
    ok = false;
    committed = live_->replicas().commit(false, why);
  } else {
    committed = live_->should_commit({l});
    why = live_->last_failure();
  }
  if (committed) {
    *loss = l.item<double>();  // the mean over every member rank's equal slice
    return true;
  }
  discarded_at_ = Clock::now();
  nlohmann::json e = event("step_discarded");
  e["why"] = why;
  e["lost_ms"] = step_ms;
  out.write(e);
  if (prints()) {
    std::cout << "fsdp-train: [replica " << replica() << "] step discarded (" << e["why"].get<std::string>()
              << "); redoing it with the groups still here" << std::endl;
  }
  return false;
}

int restart_count() {
  const char* raw = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return raw == nullptr ? 0 : std::atoi(raw);
}

namespace {

// Whether `global_rank` is in the comma-separated list of `variable` (every rank when it is unset).
bool listed(const char* variable, int global_rank) {
  const char* ranks = std::getenv(variable);
  if (ranks == nullptr) return true;
  std::stringstream list(ranks);
  std::string item;
  bool mine = false;
  while (std::getline(list, item, ',')) mine = mine || (!item.empty() && std::atoi(item.c_str()) == global_rank);
  return mine;
}

}  // namespace

void maybe_kill_for_test(int step, int global_rank, bool first_start, const std::string& point) {
  static const char* at = std::getenv("FSDP_FAULT_KILL_AT_STEP");
  if (at == nullptr || !first_start || std::atoi(at) != step) return;
  const char* after = std::getenv("FSDP_FAULT_KILL_AFTER");
  if (point != (after != nullptr && *after != '\0' ? after : "backward")) return;
  if (!listed("FSDP_FAULT_KILL_RANKS", global_rank)) return;
  std::cerr << ("fsdp-train: rank " + std::to_string(global_rank) + " kills itself at step " + std::to_string(step) +
                " after its " + point + " (FSDP_FAULT_KILL_AT_STEP)\n") << std::flush;
  ::kill(::getpid(), SIGKILL);
}

void maybe_slow_for_test(int global_rank) {
  static const char* ms = std::getenv("FSDP_FAULT_SLOW_MS");
  if (ms == nullptr || !listed("FSDP_FAULT_SLOW_RANKS", global_rank)) return;
  std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(ms)));
}

bool replica_average_fails_for_test(int step, int global_rank) {
  static const char* from = std::getenv("FSDP_FAULT_AVERAGE_FAILS_FROM");
  return from != nullptr && step >= std::atoi(from) && listed("FSDP_FAULT_AVERAGE_FAIL_RANKS", global_rank);
}

}  // namespace train
