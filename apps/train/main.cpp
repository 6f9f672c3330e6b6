// fsdp-train: the main job. Trains one of the paper's three workloads (workload.h): by default a
// GPT-style decoder (plain libtorch, models/gpt.h) on real text with a byte-level tokenizer; T5
// (--model t5-*) on a sequence-to-sequence task over the same text; a DHEN-like recommendation
// model (--model dhen-*) on synthetic clicks. Sharded with fsdp across local ranks
// (--nproc-per-node) or ranks started by torchrun. The global batch is fixed whatever the world
// size, so runs at different W compute the same math.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "config.h"
#include "fsdp/fault_tolerance.h"
#include "fsdp/launch.h"
#include "live_training.h"
#include "run_folder.h"

namespace {

// --live-replicas with --nproc-per-node: this process is the coordinator (in a thread: it outlives
// every rank) and the launcher, which starts a failed rank again alone so that it joins the groups
// that trained on (fsdp/launch.h, RestartScope::rank).
int launch_live_locally(std::vector<char*>& args) {
  // A secret for this job's values in the store (fsdp/fault_tolerance.h, CoordinatorOptions::secret),
  // which the ranks inherit, unless the user gave one.
  if (!std::getenv("FSDP_LIVE_SECRET") && !std::getenv("FSDP_LIVE_SECRET_FILE")) {
    std::ifstream random("/dev/urandom", std::ios::binary);
    unsigned char bytes[24] = {};
    random.read(reinterpret_cast<char*>(bytes), sizeof(bytes));
    if (!random) throw std::runtime_error("fsdp-train: cannot read /dev/urandom for the live job's secret");
    std::string secret;
    for (unsigned char b : bytes) secret += "0123456789abcdef"[b >> 4], secret += "0123456789abcdef"[b & 15];
    ::setenv("FSDP_LIVE_SECRET", secret.c_str(), 1);
  }
  auto port = std::make_shared<std::promise<int>>();
  auto verdict = std::make_shared<std::promise<int>>();
  auto decided = std::make_shared<std::atomic<bool>>(false);
  auto end_verdict = std::make_shared<std::atomic<int>>(-1);  // what on_end said, before the coordinator lingers
  std::future<int> port_f = port->get_future(), verdict_f = verdict->get_future();
  std::thread([port, verdict, decided, end_verdict] {
    bool listening = false;
    try {
      fsdp::CoordinatorOptions o = fsdp::CoordinatorOptions::from_environment();
      o.port = 0;
      o.bind_address = "127.0.0.1";  // this machine's ranks only
      o.on_end = [decided, end_verdict](int v) {
        *end_verdict = v;
        *decided = true;
      };
      verdict->set_value(fsdp::run_coordinator(o, [&](int p) {
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
  auto running = [decided, &verdict_f] {
    return !*decided && verdict_f.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
  };
  const auto launched = fsdp::maybe_launch_local(static_cast<int>(args.size()), args.data(), master_port,
                                                 fsdp::RestartScope::rank, running);
  const int code = launched.value_or(1);
  // Every rank ended. The coordinator ends too once the last member finished every step (it
  // lingers while a heartbeat is fresh: at most dead_after once the last rank ended); if it still
  // waits, it waits for a replacement nobody will start.
  // The end's verdict is known when the coordinator decides it (on_end), before it lingers up to 10 s
  // for the last heartbeats: waiting for its return only, a job that trained every step was
  // reported failed (issue 37, item 10).
  const auto linger = fsdp::CoordinatorOptions::from_environment().dead_after + std::chrono::seconds(3);
  if (*end_verdict >= 0 || verdict_f.wait_for(linger) == std::future_status::ready) {
    const int verdict_code = *end_verdict >= 0 ? end_verdict->load() : verdict_f.get();
    // 0: every step was trained by the groups in the job, whatever happened to the ones that left
    // (`code` holds only failures after that: a rank's own work once training ended). Otherwise
    // the job was lost: no group with its state is left (restart it from its newest checkpoint).
    const int result = verdict_code == 0 ? code : (code != 0 ? code : verdict_code);
    if (verdict_f.wait_for(std::chrono::seconds(0)) == std::future_status::ready) return result;
    std::fflush(nullptr);
    std::_Exit(result);  // the coordinator's thread still lingers: leave without destructors
  }
  std::cerr << "fsdp-train: every rank ended before the job's last step and none is left to rejoin (out of "
               "--max-restarts): the job failed\n"
            << std::flush;
  std::fflush(nullptr);
  std::_Exit(code != 0 ? code : 1);  // the coordinator's thread still runs: leave without destructors
}

}  // namespace

int main(int argc, char** argv) {
  train::Config c;
  if (auto code = train::parse_cli(argc, argv, c)) return *code;
  try {
    if (!c.export_init.empty()) return train::export_init(c);
    if (c.plan) {
      if (c.plan_world <= 0) c.plan_world = std::max(1, c.nproc);
      return train::plan(c);
    }
    if (c.simulate_rank >= 0) {
      if (c.plan_world <= 0) throw std::invalid_argument("--simulate-rank needs --world-size: the job's ranks");
      if (c.nproc > 0) throw std::invalid_argument("--simulate-rank runs one process; drop --nproc-per-node");
      return train::train(c);
    }
    // A job that restarts itself must find its checkpoints again: the run folder's name (which
    // holds the start time) is fixed here, once, for every start.
    std::vector<std::string> args{argv, argv + argc};
    const bool launcher = std::getenv("RANK") == nullptr && std::getenv("WORLD_SIZE") == nullptr;
    if (launcher && c.max_restarts > 0 && !c.live_replicas && c.save_dir.empty() && c.run_dir == "auto") {
      args.insert(args.end(), {"--run-dir", train::default_run_dir(c)});
    }
    std::vector<char*> pointers;
    for (auto& a : args) pointers.push_back(a.data());
    if (launcher && c.live_replicas) {
      if (c.nproc <= 0) {
        throw std::invalid_argument(
            "--live-replicas needs more than one replica group: give --nproc-per-node N to run the ranks and their "
            "coordinator here, or start fsdp-coordinator and launch the ranks with torchrun (docs/cluster.md)");
      }
      train::LiveTraining::check(c, c.nproc, c.nproc);
      return launch_live_locally(pointers);
    }
    if (auto code = fsdp::maybe_launch_local(static_cast<int>(pointers.size()), pointers.data())) return *code;
    if (launcher) {
      // Neither launched nor asked to launch: one local rank.
      args[0] = "/proc/self/exe";
      return fsdp::launch_local(1, args, 0, c.max_restarts);
    }
    return train::train(c);
  } catch (const c10::Error& e) {
    // One write per line: ranks share the terminal.
    std::cerr << (std::string("fsdp-train: error: ") + e.what_without_backtrace() + "\n") << std::flush;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << (std::string("fsdp-train: error: ") + e.what() + "\n") << std::flush;
    return 1;
  }
}
