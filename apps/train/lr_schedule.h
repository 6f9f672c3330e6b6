// The learning rate of every step (--lr-schedule, --warmup-steps, --min-lr): a linear warmup from
// lr/warmup to lr over the first steps, then constant, or a linear or cosine decay to min_lr at the
// run's last step, as nanoGPT, torchtitan and Megatron train. A function of the step alone, so a
// resumed run sets the same rate as an uninterrupted one; checkpoints save the schedule itself
// (its kind, peak, warmup, floor and horizon) and a resumed run continues the saved one.
#pragma once

#include <string>

#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>

namespace train {

struct LrSchedule {
  std::string kind = "constant";  // constant, linear or cosine
  double peak = 2e-3;             // --lr: the rate after warmup
  int warmup_steps = 0;
  double min_lr = 0.0;            // the floor the decay reaches at the horizon
  int horizon = 0;                // the step count the decay spans to (--steps of the run that began it)

  double at(int step) const;
  // Throws std::invalid_argument naming the flag (an unknown kind, a floor above the peak, ...).
  void validate() const;
  std::string describe() const;  // "0.002", "cosine from 0.002 to 0.0002 over 300 steps, 30 of warmup"
  nlohmann::json to_json() const;
  static LrSchedule from_json(const nlohmann::json& j);
};

// The shortest text that reads back as exactly `v` ("0.004", not 0.0040000000000000001): how the
// user typed a flag, and exact enough to compare two runs' settings by their text.
std::string exact_text(double v);

struct Config;
// The flags' schedule (--lr-schedule, --lr, --warmup-steps, --min-lr over --steps), validated.
LrSchedule lr_schedule_of(const Config& c);

// Every parameter group of `optimizer` steps at `lr` (fsdp-train's groups differ in weight decay only).
void set_learning_rate(torch::optim::Optimizer& optimizer, double lr);

}  // namespace train
