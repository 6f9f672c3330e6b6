// The end of a run (run_end.cpp): the last save waited for, the state hash, the simulated rank's
// estimate, the whole model written, the summary and what the run kept, and the text sample.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "checkpoints.h"
#include "config.h"
#include "job_setup.h"
#include "metrics_log.h"
#include "model_setup.h"
#include "run_summary.h"

namespace train {

// What the step loop leaves for the end of the run.
struct LoopResults {
  std::map<std::string, double> last_eval;  // the newest held-out figures, and after which step
  int last_eval_step = -1;
  std::string last_checkpoint;
  std::vector<double> sampled_step_ms;  // --simulate-layers: the steps after the first
};

// Ends the run after its last step (collectives: every rank calls it).
void finish_run(const Config& c, const Job& job, const Model& built, const Checkpoints& ck, JsonlWriter& metrics_out,
                RunSummary& summary, LoopResults& done);

}  // namespace train
