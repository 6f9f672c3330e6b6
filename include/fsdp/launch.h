// The built-in local launcher: any fsdp program given --nproc-per-node N spawns N ranks of itself on
// loopback with the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) and returns the first non-zero exit code. When a rank fails, the
// launcher says which and how (exit code or signal), gives the others a grace period to notice and
// report on their own (FSDP_LAUNCHER_GRACE_S, default 20 s), then stops them, so one failing rank
// never leaves the rest hanging.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

// Spawns `nproc` processes running `argv` (argv[0] is the program path) and waits for all of
// them. Returns 0 when every rank exited 0, else the first failure's exit code (128+signal for a
// rank killed by a signal). `master_port` 0: the launcher hosts the job's store itself, on a port
// the kernel picks (see kStoreHostedEnv).
//
// `max_restarts` > 0: when a rank fails, the others are stopped as above and every rank is started
// again, up to that many times, with TORCHELASTIC_RESTART_COUNT = the restart (as torchrun sets
// it): the program resumes from its newest checkpoint (fsdp-train does). An interrupt (SIGINT,
// SIGTERM to the launcher) is not restarted.
//
// What a restart starts again (`scope`):
//   RestartScope::job  every rank, from the newest checkpoint (the default; full_shard and anything
//                      that cannot lose a rank);
//   RestartScope::rank only the rank that failed, with TORCHELASTIC_RESTART_COUNT = the restarts so
//                      far, and the others are left running: live replica groups
//                      (fsdp/fault_tolerance.h), where the surviving groups train on and the
//                      restarted ranks join them as a replacement. The store must then be the
//                      coordinator's (`master_port` names it). Out of restarts, a failed rank stays
//                      down and the others still run on: the coordinator decides when the job ends.
//                      `job_running` says whether it still runs: a rank that fails once it returns
//                      false is not restarted, and only such failures make the exit code.
enum class RestartScope { job, rank };
// The exit code of a rank whose live replica group the coordinator left out of the job
// (fsdp::LeftOutOfJob): with RestartScope::rank it is restarted like any failure while the job
// runs, and once the job has ended it is not the job's failure (the others trained every step).
inline constexpr int kLeftOutExitCode = 3;
int launch_local(int nproc, const std::vector<std::string>& argv, int master_port = 0, int max_restarts = 0,
                 RestartScope scope = RestartScope::job, const std::function<bool()>& job_running = {});

// Set (to 1) in the ranks' environment by launch_local when the launcher hosts the job's store
// itself (master_port 0: a port it holds for the job's life); rank 0 then connects as a client.
inline constexpr const char* kStoreHostedEnv = "FSDP_STORE_HOSTED";

// For a program's main(): when argv holds "--nproc-per-node N" (or "--nproc-per-node=N") and this
// process is not itself a launched rank, runs launch_local() on the same command line without
// that flag and returns its exit code ("--max-restarts N" is the launcher's too: not passed on).
// Otherwise returns nullopt and the program runs as one rank. A bad --nproc-per-node or
// --max-restarts value throws std::invalid_argument (catch it in main to print it). Arguments
// after "--" are the program's, passed on with the "--" even where they look like the launcher's.
// The ranks end (SIGTERM) when the launcher dies, however it dies.
// `master_port`, `scope` and `job_running` as for launch_local.
std::optional<int> maybe_launch_local(int argc, char** argv, int master_port = 0,
                                      RestartScope scope = RestartScope::job,
                                      const std::function<bool()>& job_running = {});

// The same, with the first start's ranks forked from this process instead of started anew: each
// rank skips loading libtorch again (about 0.6 CPU-seconds and 0.15 s of wall time per rank here,
// most of a short job's cost). A forked rank returns nullopt from this call with *argc and *argv
// holding its command line (the launcher's flags removed), and RANK, WORLD_SIZE, ... set: the
// program then runs as that rank, as if it had been started with that command line. Call it first
// in main(), before anything that starts threads or reads the environment's RANK: a process that
// already has threads (a forked child of one may only exec) starts its ranks anew as above, and so
// does every restart, and FSDP_LAUNCH_EXEC=1 asks for that always.
std::optional<int> maybe_launch_local(int* argc, char*** argv, int master_port = 0,
                                      RestartScope scope = RestartScope::job,
                                      const std::function<bool()>& job_running = {});

}  // namespace fsdp
