#include "lr_schedule.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "config.h"

namespace train {

double LrSchedule::at(int step) const {
  if (step < warmup_steps) return peak * static_cast<double>(step + 1) / warmup_steps;  // reaches peak at the last warmup step
  if (kind == "constant") return peak;
  // From peak right after warmup to min_lr at the horizon's last step; past the horizon (a resumed
  // run with more --steps), the floor.
  const int span = std::max(1, horizon - warmup_steps - 1);
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / span);
  if (progress >= 1.0) return min_lr;  // exactly the floor, not a rounding of it
  if (kind == "linear") return peak + (min_lr - peak) * progress;
  return min_lr + 0.5 * (peak - min_lr) * (1.0 + std::cos(M_PI * progress));
}

void LrSchedule::validate() const {
  if (kind != "constant" && kind != "linear" && kind != "cosine") {
    throw std::invalid_argument("--lr-schedule " + kind + ": choose constant, linear or cosine");
  }
  if (!(peak > 0) || !std::isfinite(peak)) {
    throw std::invalid_argument("--lr " + std::to_string(peak) + ": the learning rate must be a positive number");
  }
  if (warmup_steps < 0) throw std::invalid_argument("--warmup-steps must be 0 or more");
  if (!(min_lr >= 0) || min_lr > peak) {
    throw std::invalid_argument("--min-lr " + exact_text(min_lr) + ": the floor must be between 0 and --lr (" +
                                exact_text(peak) + ")");
  }
  if (kind == "constant" && min_lr != 0) {
    throw std::invalid_argument("--min-lr is the floor a decay reaches: give --lr-schedule cosine or linear, or drop --min-lr");
  }
  if (horizon > 0 && warmup_steps > horizon) {
    throw std::invalid_argument("--warmup-steps " + std::to_string(warmup_steps) + " is more than --steps " +
                                std::to_string(horizon) + ": the rate would never reach --lr; warm up over fewer steps");
  }
  // The decay runs from --lr at the first step after warmup to --min-lr at the last: two steps at least.
  if (kind != "constant" && horizon > 0 && horizon - warmup_steps < 2) {
    throw std::invalid_argument("--lr-schedule " + kind + " decays from --lr at step " + std::to_string(warmup_steps) +
                                " (after warmup) to --min-lr at the last step, " + std::to_string(horizon - 1) +
                                ": give --steps " + std::to_string(warmup_steps + 2) + " or more, or fewer --warmup-steps");
  }
}

std::string exact_text(double v) {
  for (int digits = 1;; ++digits) {
    std::ostringstream s;
    s.precision(digits);
    s << v;
    if (digits >= 17 || std::stod(s.str()) == v) return s.str();
  }
}

std::string LrSchedule::describe() const {
  std::ostringstream s;
  if (kind == "constant") {
    s << exact_text(peak);  // as --lr alone said it before schedules (the live job's identity reads the same)
  } else {
    s << kind << " from " << exact_text(peak) << " to " << exact_text(min_lr) << " over " << horizon << " steps";
  }
  if (warmup_steps > 0) s << ", " << warmup_steps << " of warmup";
  return s.str();
}

nlohmann::json LrSchedule::to_json() const {
  return {{"kind", kind}, {"peak", peak}, {"warmup_steps", warmup_steps}, {"min_lr", min_lr}, {"horizon", horizon}};
}

LrSchedule LrSchedule::from_json(const nlohmann::json& j) {
  LrSchedule s;
  s.kind = j.at("kind").get<std::string>();
  s.peak = j.at("peak").get<double>();
  s.warmup_steps = j.at("warmup_steps").get<int>();
  s.min_lr = j.at("min_lr").get<double>();
  s.horizon = j.at("horizon").get<int>();
  return s;
}

LrSchedule lr_schedule_of(const Config& c) {
  LrSchedule s{c.lr_schedule, c.lr, c.warmup_steps, c.min_lr, c.steps};
  s.validate();
  return s;
}

void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

}  // namespace train
