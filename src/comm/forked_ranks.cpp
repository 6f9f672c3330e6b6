// maybe_launch_local(int*, char***) (fsdp/launch.h): the first start's ranks forked from the
// launcher, which has loaded libtorch already, instead of started anew. A process start here costs
// about 0.7 CPU-seconds (libtorch's and CUDA's libraries mapped, libtorch's operators registered),
// most of what a short job or a test costs; a fork costs a few milliseconds and the pages the rank
// then writes. Restarts, and launchers that already have threads, start ranks anew (launcher.cpp).
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/launching.h"
#include "fsdp/launch.h"

namespace fsdp {
namespace {

// A forked child of a process with threads may only exec (a lock another thread held at the fork
// stays held in the child forever): fork only a process that has one thread.
bool single_threaded() {
  DIR* tasks = ::opendir("/proc/self/task");
  if (tasks == nullptr) return false;
  int n = 0;
  while (const dirent* d = ::readdir(tasks)) {
    if (d->d_name[0] != '.') ++n;
  }
  ::closedir(tasks);
  return n == 1;
}

}  // namespace

std::optional<int> maybe_launch_local(int* argc, char*** argv, int master_port, RestartScope scope,
                                      const std::function<bool()>& job_running) {
  const launching::LaunchFlags f = launching::launch_flags(*argc, *argv);
  if (f.nproc < 0) return std::nullopt;
  launching::check_launch(f.nproc, f.rest, master_port, f.max_restarts, scope);
  const char* exec = std::getenv("FSDP_LAUNCH_EXEC");
  if ((exec != nullptr && std::string(exec) == "1") || !single_threaded()) {
    return launching::launch_checked(f.nproc, f.rest, master_port, f.max_restarts, scope, job_running, nullptr);
  }
  // Forked before the store (and its thread) exists: this process has one thread, so a child
  // may go on running the program. Output buffered now would be written by every child too.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  launching::Forked forked;
  for (int r = 0; r < f.nproc; ++r) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error(std::string("fsdp: pipe() failed: ") + std::strerror(errno));
    const pid_t launcher = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fsdp: fork() failed while launching rank " + std::to_string(r));
    if (pid == 0) {
      launching::end_with_the_launcher(launcher);
      ::close(fds[1]);
      for (int w : forked.port_pipes) ::close(w);  // the earlier ranks' (their EOF is the launcher's end)
      int32_t port = 0;
      ssize_t got = 0;
      do {
        got = ::read(fds[0], &port, sizeof(port));
      } while (got < 0 && errno == EINTR);
      ::close(fds[0]);
      if (got != static_cast<ssize_t>(sizeof(port))) ::_exit(1);  // the launcher failed first (it says why)
      for (const auto& [key, value] : launching::rank_environment(r, f.nproc, port, master_port == 0, 0, f.max_restarts)) {
        ::setenv(key.c_str(), value.c_str(), 1);
      }
      if (master_port != 0) ::unsetenv(kStoreHostedEnv);
      // As an exec'd rank has them: the launcher catches SIGINT and SIGTERM before it execs a
      // rank, and exec sets caught signals back to their defaults (an ignored one would stay so,
      // and pass on to whatever the rank runs).
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      // The rank's command line, as an exec'd rank gets it (its program name kept).
      static std::vector<std::string> words;
      static std::vector<char*> pointers;
      words = f.rest;
      words[0] = (*argv)[0];
      for (auto& w : words) pointers.push_back(w.data());
      pointers.push_back(nullptr);
      *argc = static_cast<int>(words.size());
      *argv = pointers.data();
      return std::nullopt;
    }
    ::close(fds[0]);
    forked.pids.push_back(pid);
    forked.port_pipes.push_back(fds[1]);
  }
  return launching::launch_checked(f.nproc, f.rest, master_port, f.max_restarts, scope, job_running, &forked);
}

}  // namespace fsdp
