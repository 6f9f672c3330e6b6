// Where a run keeps what it made, so that the main job ends with something to keep (--run-dir;
// default runs/<model>-<yyyymmdd-hhmmss>, "none" for nothing):
//   checkpoints/step-N/   the checkpoint to resume from (the --save-dir, unless one is given)
//   model.safetensors     the whole trained model for Python (the --export-full, unless given)
//   summary.json          the run's summary (steps, wall time, throughput, losses)
// and the one-line commands that resume the run and load the model in Python.
#pragma once

#include <optional>
#include <string>

#include "config.h"
#include "fsdp/mesh.h"

namespace train {

class RunFolder {
 public:
  // A collective: rank 0 creates the folder (an existing name gets a suffix: -2, -3, ..., so two
  // runs started in the same second do not share one) and every rank learns its name. Nothing
  // for --run-dir none.
  static std::optional<RunFolder> create(const Config& c, fsdp::Mesh& mesh);

  const std::string& path() const { return path_; }
  std::string checkpoints() const { return path_ + "/checkpoints"; }
  std::string model_file() const { return path_ + "/model.safetensors"; }
  std::string summary_file() const { return path_ + "/summary.json"; }

 private:
  explicit RunFolder(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// "runs/<model>-<yyyymmdd-hhmmss>": --run-dir auto's name for a run starting now.
std::string default_run_dir(const Config& c);

// The command line that continues this run from `checkpoints` up to `steps` steps: this program
// with the flags it was given, less those that name where the run came from and went to.
// `nproc`: the local ranks to ask for (0: the job spans hosts; the user's launcher starts it).
std::string resume_command(const Config& c, const std::string& checkpoints, int steps, int nproc);
// A Python one-liner that loads `safetensors_file` with the project's Python and prints what it holds.
std::string python_load_command(const std::string& safetensors_file);

}  // namespace train
