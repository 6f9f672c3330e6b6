// One machine's live job (fsdp/live_manager.h, launch_live_local): this process is the coordinator
// (in a thread: it outlives every rank) and the launcher, which starts a failed rank again alone
// so that it joins the groups that trained on (fsdp/launch.h, RestartScope::rank). Also where a
// live job's replica groups keep their checkpoints.
#include "fsdp/live_manager.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <thread>

#include "fsdp/checkpoint.h"
#include "fsdp/launch.h"

namespace fsdp {
namespace {

bool asks_to_launch(int argc, char** argv) {
  if (std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr) return false;  // a rank
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--nproc-per-node") == 0 || std::strncmp(argv[i], "--nproc-per-node=", 17) == 0) {
      return true;
    }
  }
  return false;
}

// A secret for this job's values in the store (CoordinatorOptions::secret), which the ranks
// inherit, unless the user gave one.
void make_secret() {
  if (std::getenv("FSDP_LIVE_SECRET") || std::getenv("FSDP_LIVE_SECRET_FILE")) return;
  std::ifstream random("/dev/urandom", std::ios::binary);
  unsigned char bytes[24] = {};
  random.read(reinterpret_cast<char*>(bytes), sizeof(bytes));
  if (!random) throw std::runtime_error("fsdp: cannot read /dev/urandom for the live job's secret");
  std::string secret;
  for (unsigned char b : bytes) secret += "0123456789abcdef"[b >> 4], secret += "0123456789abcdef"[b & 15];
  ::setenv("FSDP_LIVE_SECRET", secret.c_str(), 1);
}

}  // namespace

std::optional<int> launch_live_local(int argc, char** argv) {
  if (!asks_to_launch(argc, argv)) return std::nullopt;
  make_secret();
  // --max-restarts, as the launcher reads it: a failed rank beyond it stays down, and a group of it
  // can no longer come back (CoordinatorOptions::replacements_exhausted).
  int max_restarts = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--max-restarts" && i + 1 < argc) max_restarts = std::atoi(argv[i + 1]);
    if (a.rfind("--max-restarts=", 0) == 0) max_restarts = std::atoi(a.c_str() + 15);
  }
  auto failures = std::make_shared<std::atomic<int>>(0);
  auto port = std::make_shared<std::promise<int>>();
  auto verdict = std::make_shared<std::promise<int>>();
  auto decided = std::make_shared<std::atomic<bool>>(false);
  auto end_verdict = std::make_shared<std::atomic<int>>(-1);  // what on_end said, before the coordinator lingers
  std::future<int> port_f = port->get_future(), verdict_f = verdict->get_future();
  std::thread([port, verdict, decided, end_verdict, failures, max_restarts] {
    bool listening = false;
    try {
      CoordinatorOptions o = CoordinatorOptions::from_environment();
      o.port = 0;
      o.bind_address = "127.0.0.1";  // this machine's ranks only
      o.replacements_exhausted = [failures, max_restarts] { return failures->load() > max_restarts; };
      // Restarts are the job's, not a rank's: each failure beyond them leaves a rank down for good.
      o.ranks_down_for_good = [failures, max_restarts] { return std::max(0, failures->load() - max_restarts); };
      o.on_end = [decided, end_verdict](int v) {
        *end_verdict = v;
        *decided = true;
      };
      verdict->set_value(run_coordinator(o, [&](int p) {
        listening = true;
        port->set_value(p);
      }));
    } catch (...) {
      if (!listening) port->set_exception(std::current_exception());
      verdict->set_exception(std::current_exception());
    }
  }).detach();
  const int master_port = port_f.get();
  // A rank that fails once the coordinator decided the end (every step trained, or the job lost)
  // is not replaced, and its failure is the job's: its work after training failed.
  auto running = [decided, failures, &verdict_f] {  // asked once for each rank that fails
    const bool on = !*decided && verdict_f.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
    if (on) ++*failures;
    return on;
  };
  const int code = maybe_launch_local(argc, argv, master_port, RestartScope::rank, running).value_or(1);
  // Every rank ended. The end's verdict is known when the coordinator decides it (on_end), before
  // it lingers up to 10 s for the last heartbeats: waiting for its return only, a job that trained
  // every step was reported failed (issue 37, item 10). If it has not decided, it waits for a
  // replacement nobody will start.
  const auto linger = CoordinatorOptions::from_environment().dead_after + std::chrono::seconds(3);
  if (*end_verdict >= 0 || verdict_f.wait_for(linger) == std::future_status::ready) {
    const bool returned = verdict_f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    const int verdict_code = *end_verdict >= 0 ? end_verdict->load() : verdict_f.get();
    // 0: every step was trained by the groups in the job, whatever happened to the ones that left
    // (`code` holds only failures after that: a rank's own work once training ended). Otherwise
    // the job was lost: no group with its state is left (restart it from its newest checkpoint).
    const int result = verdict_code == 0 ? code : (code != 0 ? code : verdict_code);
    if (returned) return result;  // (a future read once holds no state: ask before get())
    std::fflush(nullptr);
    std::_Exit(result);  // the coordinator's thread still lingers: leave without destructors
  }
  std::cerr << "fsdp: every rank ended before the coordinator saw the job's last step (a rank that trained every "
               "step must call finish(): LiveManager::finish, LiveReplicas::finish), and none is left to rejoin (out "
               "of --max-restarts): the job failed\n"
            << std::flush;
  std::fflush(nullptr);
  std::_Exit(code != 0 ? code : 1);  // the coordinator's thread still runs: leave without destructors
}

std::string live_checkpoint_dir(const std::string& save_dir, int replica) {
  return save_dir + "/replica-" + std::to_string(replica);
}

std::string newest_live_checkpoint(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(fs::path(path) / "manifest.json", ec) || latest_checkpoint(path)) return path;
  std::string best = path;
  int64_t best_step = -1;
  for (const auto& e : fs::directory_iterator(path, ec)) {
    if (!e.is_directory(ec) || e.path().filename().string().rfind("replica-", 0) != 0) continue;
    const std::optional<std::string> newest = latest_checkpoint(e.path().string());
    if (!newest) continue;
    const std::string name = fs::path(*newest).filename().string();  // step-00000010
    const int64_t step = std::atoll(name.substr(name.find('-') + 1).c_str());
    if (step > best_step) {
      best_step = step;
      best = *newest;
    }
  }
  return best;
}

}  // namespace fsdp
