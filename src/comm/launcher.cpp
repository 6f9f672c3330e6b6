#include "fsdp/launch.h"

#include "comm/launching.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

extern char** environ;

namespace fsdp {
namespace {

volatile sig_atomic_t g_stop_signal = 0;
void on_signal(int sig) { g_stop_signal = sig; }

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string describe_exit(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "was killed by signal " + std::to_string(sig) + (name ? std::string(" (SIG") + name + ")" : std::string());
  }
  return "exited with code " + std::to_string(exit_code_of(status));
}

// FSDP_LAUNCHER_GRACE_S (default 20): how long survivors of a failed rank get to end on their own.
double launcher_grace_seconds() {
  const char* raw = std::getenv("FSDP_LAUNCHER_GRACE_S");
  if (raw == nullptr || *raw == '\0') return 20.0;
  char* end = nullptr;
  const double s = std::strtod(raw, &end);
  if (end == raw || *end != '\0' || s < 0) {
    throw std::invalid_argument(std::string("fsdp: FSDP_LAUNCHER_GRACE_S='") + raw + "' is not a number of seconds");
  }
  return s;
}


}  // namespace

namespace {

// One start of the job: its store, its ranks, and the supervision until every rank ended.
// Returns 0 or the first failure's exit code. With RestartScope::rank a failed rank is started
// again alone while `*restarts` < max_restarts (counted across the job), and nobody is stopped.
// `forked`: the first start's ranks, already forked and waiting for the store's port.
using launching::Forked;

int run_ranks(int nproc, const std::vector<std::string>& argv, int master_port, int* restarts, int max_restarts,
              RestartScope scope, const std::function<bool()>& job_running, Forked* forked) {
  // The job's store, hosted here on a port the kernel picks and this process holds for the job's
  // whole life; the ranks connect to it as clients (kStoreHostedEnv). Picking a free port and
  // letting rank 0 bind it later raced with the sockets of jobs running beside this one (a test
  // failed once with "rank 0 could not host the store"). A restart gets a fresh store: the keys
  // of the failed start (its process groups' rendezvous) must not be found by the new ranks.
  c10::intrusive_ptr<c10d::TCPStore> store;
  const bool hosted = master_port == 0;
  if (hosted) {
    c10d::TCPStoreOptions so;
    so.port = 0;
    so.isServer = true;
    so.waitWorkers = false;
    try {
      store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
    } catch (...) {
      // Forked ranks waiting for a port see their pipe close and end; they are reaped here.
      if (forked != nullptr) {
        for (int w : forked->port_pipes) ::close(w);
        for (pid_t p : forked->pids) ::waitpid(p, nullptr, 0);
      }
      throw;
    }
    master_port = store->getPort();
  }

  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const std::vector<std::string> overridden{"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                            "MASTER_PORT", kStoreHostedEnv, "TORCHELASTIC_RESTART_COUNT",
                                            "TORCHELASTIC_MAX_RESTARTS"};
  std::vector<std::string> inherited;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string key = entry.substr(0, entry.find('='));
    if (std::find(overridden.begin(), overridden.end(), key) == overridden.end()) inherited.push_back(entry);
  }
  // A rank's environment is built before forking: this process has threads (the store's, a
  // coordinator's), and a forked child may only exec.
  auto spawn = [&](int r) {
    std::vector<std::string> e = inherited;
    for (const auto& [key, value] : launching::rank_environment(r, nproc, master_port, hosted, *restarts, max_restarts)) {
      e.push_back(key + "=" + value);
    }
    std::vector<char*> env;
    for (auto& v : e) env.push_back(const_cast<char*>(v.c_str()));
    env.push_back(nullptr);
    const pid_t launcher = ::getpid();
    pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fsdp: fork() failed while launching rank " + std::to_string(r));
    if (pid == 0) {
      launching::end_with_the_launcher(launcher);  // kept across execve
      ::execve(args[0], args.data(), env.data());
      static const char msg[] = "fsdp: could not exec the rank's program\n";
      (void)!::write(2, msg, sizeof(msg) - 1);
      ::_exit(127);
    }
    return pid;
  };

  std::vector<pid_t> pids;
  if (forked != nullptr && !forked->pids.empty()) {
    // They wait for the port (and with it, their environment); a restart spawns anew.
    const int32_t port = master_port;
    for (int w : forked->port_pipes) {
      if (::write(w, &port, sizeof(port)) != static_cast<ssize_t>(sizeof(port))) {
        std::cerr << "fsdp launcher: could not pass the store's port to a forked rank: " << std::strerror(errno)
                  << std::endl;
      }
      ::close(w);
    }
    pids = std::move(forked->pids);
    forked->pids.clear();
    forked->port_pipes.clear();
  } else {
    for (int r = 0; r < nproc; ++r) pids.push_back(spawn(r));
  }

  // When a rank fails, the launcher says which and how, then gives the others a grace period to
  // notice it on their own (their collectives fail as soon as the peer's sockets close) and report
  // what they were doing, before it stops them: SIGTERM, then SIGKILL.
  const auto grace = std::chrono::milliseconds(static_cast<int64_t>(1000 * launcher_grace_seconds()));
  using Clock = std::chrono::steady_clock;
  int first_failure = 0;
  // Which rank's failure is the job's. The rank that fails first is not always reaped first: a
  // rank that returns an error code closes its sockets at once but takes a moment to exit (its
  // static destructors), while its peers' Gloo threads abort (SIGABRT) on the closed connection
  // and are gone sooner. So a rank that exits with a code within a second of a first failure by
  // signal is taken for the cause instead.
  int cause = -1;
  bool cause_by_signal = false;  // the first failure: a signal that a peer's closed connection may cause
  bool reattributed = false;
  auto cause_at = Clock::time_point::min();
  size_t running = pids.size();
  auto term_at = Clock::time_point::max(), kill_at = Clock::time_point::max();
  auto stop_all = [&](int sig) {
    for (pid_t p : pids) {
      if (p > 0) ::kill(p, sig);
    }
  };
  while (running > 0) {
    int status = 0;
    pid_t done = ::waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      for (size_t r = 0; r < pids.size(); ++r) {
        if (pids[r] != done) continue;
        pids[r] = -1;
        --running;
        const int code = exit_code_of(status);
        if (code == 0) continue;
        std::cerr << "fsdp launcher: rank " << r << " (pid " << done << ") " << describe_exit(status) << std::endl;
        if (scope == RestartScope::rank) {
          // The coordinator decides what the others do; this rank comes back as a replacement.
          const bool running_on = !job_running || job_running();
          if (!running_on) {
            // After the job's end: its own failure, unless its group was only left out of a job
            // that the others finished.
            if (first_failure == 0 && code != kLeftOutExitCode) first_failure = code;
          } else if (*restarts < max_restarts && g_stop_signal == 0) {
            ++*restarts;
            std::cerr << "fsdp launcher: starting rank " << r << " again (restart " << *restarts << " of "
                      << max_restarts << "); it joins the live replica groups" << std::endl;
            pids[r] = spawn(static_cast<int>(r));
            ++running;
          } else {
            std::cerr << "fsdp launcher: rank " << r << " stays down (out of --max-restarts); the other replica "
                      << "groups train on" << std::endl;
          }
          continue;
        }
        // A peer's closed connection ends a rank by SIGABRT (Gloo's error escaping its thread) or
        // SIGPIPE; SIGKILL (the OOM killer, a user), SIGSEGV and the like are the rank's own end,
        // never a peer's doing: the job's failure stays theirs.
        const bool by_signal = WIFSIGNALED(status);
        const bool maybe_a_peers_doing = by_signal && (WTERMSIG(status) == SIGABRT || WTERMSIG(status) == SIGPIPE);
        if (first_failure != 0 && cause_by_signal && !by_signal && g_stop_signal == 0 &&
            Clock::now() - cause_at < std::chrono::seconds(1)) {
          first_failure = code;
          cause = static_cast<int>(r);
          cause_by_signal = false;
          reattributed = true;
        }
        if (first_failure == 0) {
          first_failure = code;
          cause = static_cast<int>(r);
          cause_by_signal = maybe_a_peers_doing;
          cause_at = Clock::now();
          if (running > 0) {
            std::cerr << "fsdp launcher: waiting up to " << grace.count() / 1000.0 << " s for the other " << running
                      << " rank(s) to report, then stopping them" << std::endl;
            term_at = Clock::now() + grace;
          }
        }
      }
      continue;
    }
    if (g_stop_signal != 0 && term_at > Clock::now()) {
      term_at = Clock::now();
      if (first_failure == 0) first_failure = 128 + g_stop_signal;
    }
    if (Clock::now() >= term_at) {
      stop_all(SIGTERM);
      term_at = Clock::time_point::max();
      kill_at = Clock::now() + std::chrono::seconds(10);
    }
    if (Clock::now() >= kill_at) {
      stop_all(SIGKILL);
      kill_at = Clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (reattributed) {
    std::cerr << "fsdp launcher: the job's failure is rank " << cause << "'s (exit code " << first_failure
              << "): it exited with that code as the ranks before it were killed by a signal, which a peer's "
                 "closed connection causes" << std::endl;
  }
  return first_failure;
}

}  // namespace

namespace launching {

// What the launcher sets in a rank's environment, as torchrun names it.
std::vector<std::pair<std::string, std::string>> rank_environment(int r, int nproc, int master_port, bool hosted,
                                                                  int restarts, int max_restarts) {
  std::vector<std::pair<std::string, std::string>> e{
      {"RANK", std::to_string(r)},
      {"LOCAL_RANK", std::to_string(r)},
      {"WORLD_SIZE", std::to_string(nproc)},
      {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
      {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", std::to_string(master_port)},
      // A program resumes from its newest checkpoint when restarted.
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restarts)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(max_restarts)}};
  if (hosted) e.emplace_back(kStoreHostedEnv, "1");
  return e;
}

void check_launch(int nproc, const std::vector<std::string>& argv, int master_port, int max_restarts,
                  RestartScope scope) {
  if (nproc < 1) throw std::invalid_argument("fsdp: --nproc-per-node must be at least 1");
  if (argv.empty()) throw std::invalid_argument("fsdp: launch_local needs a program to run");
  if (max_restarts < 0) throw std::invalid_argument("fsdp: --max-restarts must be 0 or more");
  if (scope == RestartScope::rank && master_port == 0) {
    throw std::invalid_argument("fsdp: restarting single ranks needs the coordinator's store (a master_port)");
  }
}

int launch_checked(int nproc, const std::vector<std::string>& argv, int master_port, int max_restarts,
                   RestartScope scope, const std::function<bool()>& job_running, Forked* forked) {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  struct sigaction old_int {}, old_term {};
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  int code = 0;
  int restarts = 0;
  while (true) {
    code = run_ranks(nproc, argv, master_port, &restarts, max_restarts, scope, job_running, forked);
    // Done, interrupted (a person's ^C is not a failure to recover from), out of restarts, or
    // restarted rank by rank already.
    if (code == 0 || g_stop_signal != 0 || restarts >= max_restarts || scope == RestartScope::rank) break;
    ++restarts;
    std::cerr << "fsdp launcher: restarting all " << nproc << " ranks (restart " << restarts << " of "
              << max_restarts << "); they resume from the newest checkpoint" << std::endl;
  }
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  return code;
}

void end_with_the_launcher(pid_t launcher) {
  // Async-signal-safe: called between fork and exec in a launcher that has threads. The signal
  // follows the thread that forked: launch_local's caller, which waits for every rank.
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != launcher) ::_exit(1);
}

LaunchFlags launch_flags(int argc, char** argv) {
  LaunchFlags f;
  auto& rest = f.rest;
  auto& nproc = f.nproc;
  auto& max_restarts = f.max_restarts;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string value;
    if (a == "--max-restarts" || a.rfind("--max-restarts=", 0) == 0) {
      // The launcher's; the ranks learn their restart from TORCHELASTIC_RESTART_COUNT.
      const std::string v = a.find('=') != std::string::npos ? a.substr(a.find('=') + 1)
                            : i + 1 < argc                   ? std::string(argv[++i])
                                                             : std::string();
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < 0 || n > 1000000) {
        throw std::invalid_argument("fsdp: --max-restarts wants a number of restarts (0 or more), got '" + v + "'");
      }
      max_restarts = static_cast<int>(n);
      continue;
    }
    if (a == "--") {
      // The program's own arguments from here on, even ones spelled like the launcher's.
      rest.insert(rest.end(), argv + i, argv + argc);
      break;
    }
    if (a == "--nproc-per-node" || a == "--nproc_per_node") {
      if (i + 1 >= argc) throw std::invalid_argument("fsdp: --nproc-per-node needs a number");
      value = argv[++i];
    } else if (a.rfind("--nproc-per-node=", 0) == 0 || a.rfind("--nproc_per_node=", 0) == 0) {
      value = a.substr(a.find('=') + 1);
    } else {
      rest.push_back(a);
      continue;
    }
    char* end = nullptr;
    long n = std::strtol(value.c_str(), &end, 10);
    if (end == value.c_str() || *end != '\0' || n < 1 || n > 1024) {
      throw std::invalid_argument("fsdp: --nproc-per-node wants a positive integer, got '" + value + "'");
    }
    nproc = static_cast<int>(n);
  }
  return f;
}

}  // namespace launching

int launch_local(int nproc, const std::vector<std::string>& argv, int master_port, int max_restarts,
                 RestartScope scope, const std::function<bool()>& job_running) {
  launching::check_launch(nproc, argv, master_port, max_restarts, scope);
  return launching::launch_checked(nproc, argv, master_port, max_restarts, scope, job_running, nullptr);
}

std::optional<int> maybe_launch_local(int argc, char** argv, int master_port, RestartScope scope,
                                      const std::function<bool()>& job_running) {
  const launching::LaunchFlags f = launching::launch_flags(argc, argv);
  if (f.nproc < 0) return std::nullopt;
  return launch_local(f.nproc, f.rest, master_port, f.max_restarts, scope, job_running);
}


}  // namespace fsdp
