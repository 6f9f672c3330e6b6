// What a run did, for its last lines and the run folder's summary.json: steps, wall time,
// throughput, the first and last loss and the held-out figures at the end.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace train {

class RunSummary {
 public:
  // `what`: "GPT 'default', 5 units, strategy full_shard F=4, W=4"; `unit`: "tok" or "samples".
  RunSummary(std::string what, std::string unit) : what_(std::move(what)), unit_(std::move(unit)) {}

  // Wall time counts from the first step's start to the end of the run's work (the last step's
  // save and evaluation included): what a user waits for.
  void begin();
  void end();
  void add_step(int step, double loss, double step_ms, double units);
  void set_held_out(std::map<std::string, double> figures) { held_out_ = std::move(figures); }

  int steps() const { return static_cast<int>(losses_.size()); }
  nlohmann::json to_json() const;
  // The lines rank 0 prints.
  std::vector<std::string> lines() const;

 private:
  std::string what_, unit_;
  int first_step_ = 0;
  std::vector<double> losses_, step_ms_;
  double units_ = 0;  // tokens or samples trained on
  double begin_s_ = 0, wall_s_ = 0;
  std::map<std::string, double> held_out_;
};

}  // namespace train
