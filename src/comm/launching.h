// What the two ways of launching local ranks share (fsdp/launch.h): launcher.cpp starts ranks
// anew (fork and exec) and supervises them; forked_ranks.cpp forks the first start's ranks from the
// launcher itself, before it has threads, so that they skip loading libtorch again.
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/launch.h"

namespace fsdp::launching {

// The launcher's own flags (--nproc-per-node, --max-restarts) and the command line without them.
struct LaunchFlags {
  int nproc = -1;  // -1: not asked to launch
  int max_restarts = 0;
  std::vector<std::string> rest{"/proc/self/exe"};
};
LaunchFlags launch_flags(int argc, char** argv);

// What the launcher sets in a rank's environment, as torchrun names it.
std::vector<std::pair<std::string, std::string>> rank_environment(int r, int nproc, int master_port, bool hosted,
                                                                  int restarts, int max_restarts);

// The first start's ranks when forked before the store exists (maybe_launch_local(int*, char***)):
// each waits on its pipe for the store's port.
struct Forked {
  std::vector<pid_t> pids;
  std::vector<int> port_pipes;  // the write ends, one per rank
};

// In a rank just forked from the launcher `launcher`: the kernel ends the rank (SIGTERM) when the
// launcher dies, however it dies (a SIGKILL, an OOM kill), instead of leaving it to wait in a
// collective for peers that are gone. If the launcher died before this call, ends now.
void end_with_the_launcher(pid_t launcher);

// Refuses what cannot launch (no ranks, no program, restarts without a store).
void check_launch(int nproc, const std::vector<std::string>& argv, int master_port, int max_restarts,
                  RestartScope scope);
// launch_local after check_launch; `forked`: the first start's ranks, already forked (or null).
int launch_checked(int nproc, const std::vector<std::string>& argv, int master_port, int max_restarts,
                   RestartScope scope, const std::function<bool()>& job_running, Forked* forked);

}  // namespace fsdp::launching
