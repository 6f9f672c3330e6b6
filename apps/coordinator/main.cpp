// fsdp-coordinator: the coordinator of live replica groups (fsdp/fault_tolerance.h). Start it where
// every rank reaches it (not on a training host: it must outlive them), before the ranks, and point
// the ranks' MASTER_ADDR/MASTER_PORT at it:
//
//   fsdp-coordinator --port 29500 --events coordinator.jsonl
//   (on each host) torchrun ... --no-python fsdp-train --strategy hybrid_shard --live-replicas ...
//
// It exits 0 once every member trained every step, 1 when no replica group with the job's state
// is left (the job must then restart from its newest checkpoint).
#include <iostream>

#include <CLI/CLI.hpp>

#include "fsdp/fault_tolerance.h"

int main(int argc, char** argv) {
  CLI::App app{"fsdp-coordinator: decides who is in each step of a job with live replica groups (fsdp-train --live-replicas)"};
  fsdp::CoordinatorOptions o;
  double dead_after = -1, ready_timeout = -1, start_timeout = 120, empty_timeout = 600;
  app.add_option("--port", o.port, "the port the ranks reach it on (their MASTER_PORT)")->capture_default_str();
  app.add_option("--bind", o.bind_address,
                 "listen on this IPv4 address only (default: every interface; 127.0.0.1: this machine's ranks only)");
  app.add_option("--events", o.events_jsonl, "append every decision to this file, one JSON object per line");
  app.add_option("--dead-after", dead_after,
                 "seconds without a heartbeat after which a rank is gone (default 3; FSDP_LIVE_DEAD_AFTER_S)");
  app.add_option("--ready-timeout", ready_timeout,
                 "seconds a live rank may take to be ready for the redo of a discarded step before its group is "
                 "dropped as stuck; at least 3 times the slowest step seen (default 60; FSDP_LIVE_READY_TIMEOUT_S)");
  app.add_option("--start-timeout", start_timeout,
                 "seconds the first step waits for every replica group before it starts with those present")
      ->capture_default_str();
  app.add_option("--empty-timeout", empty_timeout, "seconds to wait for a group to join when none is left")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    const fsdp::CoordinatorOptions env = fsdp::CoordinatorOptions::from_environment();
    o.secret = env.secret;
    if (o.secret.empty()) {
      std::cerr << "fsdp-coordinator: no FSDP_LIVE_SECRET: values in the store are not authenticated, so anyone who "
                   "reaches this port can decide commits; set the same secret here and on every rank\n";
    }
    o.dead_after = dead_after > 0 ? std::chrono::milliseconds(static_cast<int64_t>(dead_after * 1000)) : env.dead_after;
    o.ready_timeout =
        ready_timeout > 0 ? std::chrono::milliseconds(static_cast<int64_t>(ready_timeout * 1000)) : env.ready_timeout;
    o.start_timeout = std::chrono::milliseconds(static_cast<int64_t>(start_timeout * 1000));
    o.empty_timeout = std::chrono::milliseconds(static_cast<int64_t>(empty_timeout * 1000));
    return fsdp::run_coordinator(o, [](int port) {
      std::cerr << ("fsdp-coordinator: listening on port " + std::to_string(port) + "\n") << std::flush;
    });
  } catch (const std::exception& e) {
    std::cerr << (std::string("fsdp-coordinator: error: ") + e.what() + "\n") << std::flush;
    return 1;
  }
}
