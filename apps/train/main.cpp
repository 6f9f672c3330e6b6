// fsdp-train: the main job. Trains one of the paper's three workloads (workload.h): by default a
// GPT-style decoder (plain libtorch, models/gpt.h) on real text with a byte-level tokenizer; T5
// (--model t5-*) on a sequence-to-sequence task over the same text; a DHEN-like recommendation
// model (--model dhen-*) on synthetic clicks. Sharded with fsdp across local ranks
// (--nproc-per-node) or ranks started by torchrun. The global batch is fixed whatever the world
// size, so runs at different W compute the same math.
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "config.h"
#include "fsdp/fault_tolerance.h"
#include "fsdp/live_manager.h"
#include "fsdp/launch.h"
#include "live_training.h"
#include "lr_schedule.h"
#include "metrics_log.h"
#include "run_folder.h"

int main(int argc, char** argv) {
  train::Config c;
  if (auto code = train::parse_cli(argc, argv, c)) return *code;
  try {
    if (!c.export_init.empty()) return train::export_init(c);
    train::lr_schedule_of(c);  // its flags refused here, once, before any rank starts
    train::make_metrics_folder(c.metrics_jsonl);
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
    // Neither launched nor asked to launch: one local rank, started as --nproc-per-node 1 starts it.
    if (launcher && c.nproc <= 0 && !c.live_replicas) args.insert(args.end(), {"--nproc-per-node", "1"});
    std::vector<char*> pointers;
    for (auto& a : args) pointers.push_back(a.data());
    if (launcher && c.live_replicas) {
      if (c.nproc <= 0) {
        throw std::invalid_argument(
            "--live-replicas needs more than one replica group: give --nproc-per-node N to run the ranks and their "
            "coordinator here, or start fsdp-coordinator and launch the ranks with torchrun (docs/cluster.md)");
      }
      train::LiveTraining::check(c, c.nproc, c.nproc);
      // This process: the coordinator and the launcher (fsdp/live_manager.h).
      return fsdp::launch_live_local(static_cast<int>(pointers.size()), pointers.data()).value_or(1);
    }
    int rank_argc = static_cast<int>(pointers.size());
    char** rank_argv = pointers.data();
    if (auto code = fsdp::maybe_launch_local(&rank_argc, &rank_argv)) return *code;
    if (launcher) {
      // A rank forked from this launcher: its command line is the launcher's without its flags.
      train::Config rank;
      if (auto code = train::parse_cli(rank_argc, rank_argv, rank)) return *code;
      return train::train(rank);
    }
    return train::train(c);
  } catch (const fsdp::LeftOutOfJob& e) {
    std::cerr << (std::string("fsdp-train: error: ") + e.what() + "\n") << std::flush;
    return fsdp::kLeftOutExitCode;  // the job goes on without this group (fsdp/launch.h)
  } catch (const c10::Error& e) {
    // One write per line: ranks share the terminal.
    std::cerr << (std::string("fsdp-train: error: ") + e.what_without_backtrace() + "\n") << std::flush;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << (std::string("fsdp-train: error: ") + e.what() + "\n") << std::flush;
    return 1;
  }
}
