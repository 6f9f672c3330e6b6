#include "run_summary.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace train {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string format(const char* fmt, double value) {
  char text[64];
  std::snprintf(text, sizeof text, fmt, value);
  return text;
}

}  // namespace

void RunSummary::begin() { begin_s_ = now_s(); }
void RunSummary::end() { wall_s_ = now_s() - begin_s_; }

void RunSummary::add_step(int step, double loss, double step_ms, double units) {
  if (losses_.empty()) first_step_ = step;
  losses_.push_back(loss);
  step_ms_.push_back(step_ms);
  units_ += units;
}

nlohmann::json RunSummary::to_json() const {
  nlohmann::json j = {{"run", what_}, {"steps", steps()}, {"wall_s", wall_s_}};
  if (!losses_.empty()) {
    std::vector<double> sorted = step_ms_;
    std::sort(sorted.begin(), sorted.end());
    j["first_step"] = first_step_;
    j["last_step"] = first_step_ + steps() - 1;
    j["first_loss"] = losses_.front();
    j["last_loss"] = losses_.back();
    j["median_step_ms"] = sorted[sorted.size() / 2];
    j[unit_ + "_per_s"] = wall_s_ > 0 ? units_ / wall_s_ : 0.0;
  }
  if (!held_out_.empty()) j["held_out"] = held_out_;
  return j;
}

std::vector<std::string> RunSummary::lines() const {
  std::vector<std::string> out;
  out.push_back("== summary: " + what_);
  if (losses_.empty()) {
    out.push_back("   steps      none ran (the run started at or past --steps)");
    return out;
  }
  const nlohmann::json j = to_json();
  const int last = first_step_ + steps() - 1;
  out.push_back("   steps      " + std::to_string(steps()) + " (step " + std::to_string(first_step_) + " to " +
                std::to_string(last) + ")");
  out.push_back("   wall time  " + format("%.1f s", wall_s_) + format(" (median step %.1f ms)", j["median_step_ms"].get<double>()));
  out.push_back("   throughput " + format("%.0f ", j[unit_ + "_per_s"].get<double>()) + unit_ + "/s over the run");
  out.push_back("   loss       " + format("%.4f", losses_.front()) + " at step " + std::to_string(first_step_) + " -> " +
                format("%.4f", losses_.back()) + " at step " + std::to_string(last));
  if (!held_out_.empty()) {
    std::string line = "   held-out  ";
    for (const auto& [name, value] : held_out_) line += " " + name + format(" %.4f", value);
    out.push_back(line + " (the evaluation batch of --eval-every)");
  }
  return out;
}

}  // namespace train
