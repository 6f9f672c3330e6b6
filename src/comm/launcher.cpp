#include "fsdp/launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>

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

// A free TCP port on 127.0.0.1 for the job's store.
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("fsdp: socket() failed while picking a free port");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    throw std::runtime_error("fsdp: could not find a free port on 127.0.0.1");
  }
  const int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

}  // namespace

int launch_local(int nproc, const std::vector<std::string>& argv, int master_port) {
  if (nproc < 1) throw std::invalid_argument("fsdp: --nproc-per-node must be at least 1");
  if (argv.empty()) throw std::invalid_argument("fsdp: launch_local needs a program to run");
  if (master_port == 0) master_port = free_port();

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  struct sigaction old_int {}, old_term {};
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);

  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fsdp: fork() failed while launching rank " + std::to_string(r));
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(master_port).c_str(), 1);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      std::cerr << "fsdp: could not exec " << argv[0] << ": " << std::strerror(errno) << std::endl;
      ::_exit(127);
    }
    pids.push_back(pid);
  }

  // When a rank fails, the launcher says which and how, then gives the others a grace period to
  // notice it on their own (their collectives fail as soon as the peer's sockets close) and report
  // what they were doing, before it stops them: SIGTERM, then SIGKILL.
  const auto grace = std::chrono::milliseconds(static_cast<int64_t>(1000 * launcher_grace_seconds()));
  using Clock = std::chrono::steady_clock;
  int first_failure = 0;
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
        if (first_failure == 0) {
          first_failure = code;
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
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  return first_failure;
}

std::optional<int> maybe_launch_local(int argc, char** argv) {
  std::vector<std::string> rest{"/proc/self/exe"};
  int nproc = -1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string value;
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
  if (nproc < 0) return std::nullopt;
  return launch_local(nproc, rest);
}

}  // namespace fsdp
