#include "run_folder.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>
#include <system_error>

#include <sys/stat.h>

#include <torch/torch.h>

namespace train {
namespace {

namespace fs = std::filesystem;

}  // namespace

// "runs/default-20261202-081500": the model and the local time the run started.
std::string default_run_dir(const Config& c) {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm local{};
  localtime_r(&now, &local);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &local);
  return "runs/" + c.model + "-" + stamp;
}

namespace {

// Rank 0 makes the folder; mkdir is atomic, so a name another run took first is skipped.
std::string make_unique_folder(const std::string& wanted, bool may_exist) {
  const fs::path path(wanted);
  if (path.has_parent_path()) fs::create_directories(path.parent_path());
  if (may_exist && fs::is_directory(path)) return wanted;  // an explicit --run-dir may be reused
  for (int n = 1; n < 1000; ++n) {
    const std::string candidate = n == 1 ? wanted : wanted + "-" + std::to_string(n);
    if (::mkdir(candidate.c_str(), 0777) == 0) return candidate;
    if (errno != EEXIST) {
      throw std::runtime_error("--run-dir " + candidate + ": cannot create it: " + std::strerror(errno) +
                               "; pick another folder, or --run-dir none to keep nothing");
    }
  }
  throw std::runtime_error("--run-dir " + wanted + ": 999 folders of that name exist already; pick another");
}

// Rank 0's string on every rank.
std::string broadcast_string(fsdp::Mesh& mesh, const std::string& text) {
  if (mesh.world_size() == 1) return text;
  constexpr int64_t kMax = 4096;
  if (static_cast<int64_t>(text.size()) >= kMax) throw std::invalid_argument("--run-dir: the path is too long");
  at::Tensor bytes = torch::zeros({kMax}, torch::kUInt8);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  std::vector<at::Tensor> tensors{bytes};
  mesh.world()->broadcast(tensors)->wait();
  return std::string(static_cast<const char*>(bytes.data_ptr()));
}

// The folder fsdp-train runs from, for the printed commands.
std::string program_path() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "fsdp-train";
  const fs::path relative = exe.lexically_relative(fs::current_path());
  return !relative.empty() && relative.native().rfind("..", 0) != 0 ? relative.string() : exe.string();
}

// A word for a shell: quoted unless it is plainly safe.
std::string shell_word(const std::string& word) {
  const bool safe = !word.empty() && word.find_first_not_of(
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") == std::string::npos;
  if (safe) return word;
  std::string quoted = "'";
  for (char ch : word) quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return quoted + "'";
}

}  // namespace

std::optional<RunFolder> RunFolder::create(const Config& c, fsdp::Mesh& mesh) {
  if (c.run_dir == "none") return std::nullopt;
  std::string path;
  std::string error;
  if (mesh.rank() == 0) {
    try {
      path = make_unique_folder(c.run_dir == "auto" ? default_run_dir(c) : c.run_dir, c.run_dir != "auto");
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // An error travels as the name, so the other ranks fail with rank 0's reason instead of waiting.
  const std::string shared = broadcast_string(mesh, error.empty() ? path : "\x01" + error);
  if (!shared.empty() && shared[0] == '\x01') throw std::runtime_error(shared.substr(1));
  return RunFolder(shared);
}

std::string resume_command(const Config& c, const std::string& checkpoints, int steps, int nproc) {
  // Flags that say where the run came from and went to; the new run gets its own run folder.
  static const std::set<std::string> dropped = {"--resume", "--run-dir", "--steps", "--save-dir", "--export-full",
                                                "--load-weights", "--nproc-per-node", "--nproc_per_node"};
  std::string command = shell_word(program_path());
  if (nproc > 0) command += " --nproc-per-node " + std::to_string(nproc);
  for (size_t i = 0; i < c.args.size(); ++i) {
    const std::string& a = c.args[i];
    const std::string name = a.substr(0, a.find('='));
    if (dropped.count(name)) {
      if (a.find('=') == std::string::npos && i + 1 < c.args.size()) ++i;  // its value too
      continue;
    }
    command += " " + shell_word(a);
  }
  return command + " --resume " + shell_word(checkpoints) + " --steps " + std::to_string(steps);
}

std::string python_load_command(const std::string& safetensors_file) {
  // The project's Python (scripts/setup writes its path next to the programs' folder).
  std::string python = "python3";
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    std::ifstream venv(exe.parent_path().parent_path() / "venv-path");
    std::string dir;
    if (venv >> dir && fs::exists(fs::path(dir) / "bin" / "python")) python = dir + "/bin/python";
  }
  std::string literal;  // the path as a Python string literal
  for (char ch : safetensors_file) literal += (ch == '\\' || ch == '"') ? std::string("\\") + ch : std::string(1, ch);
  const std::string code = "from safetensors.torch import load_file; sd = load_file(\"" + literal +
                           "\"); print(len(sd), \"tensors,\", sum(t.numel() for t in sd.values()), \"parameters\")";
  return shell_word(python) + " -c " + shell_word(code);
}

}  // namespace train
