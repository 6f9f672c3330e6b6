#include "checkpoint/checkpoint_folder.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "checkpoint/file_system.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"

namespace fsdp {
namespace {

std::string now_utc(const char* format) {
  char buf[64];
  const std::time_t t = std::time(nullptr);
  std::tm tm {};
  gmtime_r(&t, &tm);
  std::strftime(buf, sizeof(buf), format, &tm);
  return buf;
}

std::string command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::replace(all.begin(), all.end(), '\0', ' ');
  while (!all.empty() && all.back() == ' ') all.pop_back();
  return all.size() > 300 ? all.substr(0, 300) + " ..." : all;
}

std::string host_name() {
  char buf[256] = {0};
  ::gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// Test hooks for the commit's crash safety (tests/test_checkpoint_hostile.cpp): with
// FSDP_TEST_KILL_IN_COMMIT=<point>:<n>, the process kills itself (SIGKILL) the n-th time it passes
// `point`; FSDP_TEST_NO_RENAME_EXCHANGE=1 takes the path of a file system that cannot exchange.
void maybe_killed_in_commit(const std::string& point) {
  static const char* env = std::getenv("FSDP_TEST_KILL_IN_COMMIT");
  static int passed = 0;
  if (!env) return;
  const std::string spec = env;
  const size_t colon = spec.find(':');
  if (spec.substr(0, colon) != point) return;
  const int nth = colon == std::string::npos ? 1 : std::atoi(spec.c_str() + colon + 1);
  if (++passed != nth) return;
  std::fprintf(stderr, "fsdp: FSDP_TEST_KILL_IN_COMMIT=%s: killed in the commit at \"%s\"\n", env, point.c_str());
  std::raise(SIGKILL);
}

}  // namespace

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::vector<StepFolder> complete_checkpoints(const std::string& dir) {
  std::vector<StepFolder> out;
  const std::vector<std::string> names = list_directory(dir);
  for (std::string name : names) {
    std::string path = dir + "/" + name;
    // A re-save interrupted between its two renames (no exchange): the old copy counts until a
    // checkpointer's sweep() puts it back.
    if (name.rfind(".old-step-", 0) == 0 && std::find(names.begin(), names.end(), name.substr(5)) == names.end()) {
      name = name.substr(5);
    }
    if (name.rfind("step-", 0) != 0 || name.size() < 6) continue;
    if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; }) || name.size() > 23) continue;
    if (!is_directory(path) || !path_exists(path + "/manifest.json")) continue;
    out.push_back({std::stoll(name.substr(5)), path});
  }
  std::sort(out.begin(), out.end(), [](const StepFolder& a, const StepFolder& b) { return a.step < b.step; });
  return out;
}

std::string checkpoint_damage(const std::string& path) {
  try {
    const nlohmann::json m = read_manifest(path);
    for (auto it = m["files"].begin(); it != m["files"].end(); ++it) {
      const std::string file = path + "/" + it.key();
      struct stat st {};
      if (::stat(file.c_str(), &st) != 0) return "its file " + it.key() + " is missing";
      const int64_t want = (*it)["bytes"].get<int64_t>();
      if (st.st_size != want) {
        return "its file " + it.key() + " has " + std::to_string(st.st_size) + " bytes, the manifest says " + std::to_string(want);
      }
    }
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

std::optional<std::string> newest_good_checkpoint(const std::string& dir, std::vector<std::string>* skipped) {
  const auto all = complete_checkpoints(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    const std::string why = checkpoint_damage(it->path);
    if (why.empty()) return it->path;
    if (skipped) skipped->push_back(it->path + ": " + why);
  }
  return std::nullopt;
}

std::string set_aside(const std::string& dir, const std::vector<StepFolder>& abandoned) {
  std::string aside = dir + "/abandoned-" + now_utc("%Y%m%d-%H%M%S");
  for (int n = 2; path_exists(aside); ++n) aside = dir + "/abandoned-" + now_utc("%Y%m%d-%H%M%S") + "-" + std::to_string(n);
  make_directories(aside);
  for (const StepFolder& s : abandoned) rename_path(s.path, aside + "/" + step_name(s.step));
  fsync_path(aside);
  fsync_path(dir);
  return aside;
}

void commit_folder(const std::string& tmp, const std::string& final_path) {
  if (!path_exists(final_path)) {
    rename_path(tmp, final_path);
    return;
  }
  static const bool no_exchange = std::getenv("FSDP_TEST_NO_RENAME_EXCHANGE") != nullptr;
  if (no_exchange) {
    errno = EINVAL;
  } else if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) == 0) {
    maybe_killed_in_commit("exchanged");
    remove_tree(tmp);  // the old copy
    return;
  }
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
    throw std::runtime_error("fsdp: cannot exchange " + tmp + " and " + final_path + ": " + std::strerror(errno));
  }
  // No exchange here (a network file system): the old copy steps aside first; sweep() puts it back
  // if the new one never arrives.
  const size_t slash = final_path.find_last_of('/');
  const std::string old = final_path.substr(0, slash + 1) + ".old-" + final_path.substr(slash + 1);
  remove_tree(old);
  rename_path(final_path, old);
  maybe_killed_in_commit("old-aside");
  rename_path(tmp, final_path);
  remove_tree(old);
}

void sweep(const std::string& dir) {
  for (const std::string& name : list_directory(dir)) {
    if (name.rfind(".tmp-", 0) == 0) {
      remove_tree(dir + "/" + name);
    } else if (name.rfind(".old-", 0) == 0) {
      const std::string step = dir + "/" + name.substr(5);
      if (path_exists(step)) {
        remove_tree(dir + "/" + name);
      } else {
        rename_path(dir + "/" + name, step);
        std::fprintf(stderr, "fsdp: restored %s: a save that was replacing it did not finish\n", step.c_str());
      }
    }
  }
}

FolderLock::FolderLock(const std::string& dir) {
  make_directories(dir);
  const std::string path = dir + "/.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error("fsdp: cannot open the lock file " + path + ": " + std::strerror(errno));
  // flock(2): released by the kernel when the process ends, however it ends; on NFS it is a POSIX
  // record lock the server holds for the client.
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder;
    {
      std::ifstream in(path);
      std::getline(in, holder);
    }
    ::close(fd_);
    fd_ = -1;
    if (err != EWOULDBLOCK) throw std::runtime_error("fsdp: cannot lock " + path + ": " + std::strerror(err));
    if (holder.rfind("pid " + std::to_string(::getpid()) + " on " + host_name() + " ", 0) == 0) {
      throw std::runtime_error("fsdp: checkpoint folder " + dir + " is already open in another fsdp::Checkpointer of this "
                               "process: use that one, or destroy it before making another for the same folder");
    }
    throw std::runtime_error(
        "fsdp: checkpoint folder " + dir + " is in use by another job (" + (holder.empty() ? "holder unknown" : holder) +
        "). Two jobs saving into one folder would overwrite each other's checkpoints: give this job its own folder, or "
        "stop the other one (a job that crashed holds nothing: the lock goes with its process).");
  }
  const std::string text = "pid " + std::to_string(::getpid()) + " on " + host_name() + " since " +
                           now_utc("%Y-%m-%d %H:%M:%S UTC") + ": " + command_line() + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    // The lock holds without its description; the message a second job gets is poorer, nothing else.
  }
}

FolderLock::~FolderLock() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace fsdp
