// The coordinator of live replica groups (fsdp/fault_tolerance.h): it hosts the store the ranks
// meet in, so it must outlive every rank (rank 0 can fail like any other), and it decides every
// round: who is in it, who joins and from whom it copies, and whether the step is committed.
//
// One loop, one round at a time (the protocol is in quorum.h):
//   write round q -> collect every member's "done" (or notice a member gone) -> write commit q ->
//   decide round q + 1's members (drop gone groups, apply the schedule, admit complete joiners).
// A discarded round waits until each member either says it is ready for the next one or is gone,
// so that a group that failed mid-round is not put in the next round only to fail it again.
//
// The loop and its decisions are in coordinator.cpp; what the coordinator knows of the ranks
// (their values in the store, their heartbeats, who asks to join) in coordinator_membership.cpp;
// the listening socket in coordinator_listen.cpp.
#pragma once

#include <chrono>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "fault_tolerance/quorum.h"
#include "fsdp/fault_tolerance.h"

namespace fsdp::detail {

class Coordinator {
 public:
  Coordinator(const CoordinatorOptions& options, c10::intrusive_ptr<c10d::Store> store);
  int run();  // 0: every step trained; 1: the job is lost (or never started)

 private:
  using Clock = std::chrono::steady_clock;
  enum class Outcome { kCommitted, kDiscarded, kFinished };
  struct Beat {
    std::string value;
    Clock::time_point changed;
  };
  using Joiners = std::map<int, std::pair<int, int64_t>>;  // replica -> (generation, step held)

  // --- the store and the ranks (coordinator_membership.cpp) ---
  bool has(const std::string& key);
  std::optional<std::string> read(const std::string& key);
  std::string get(const std::string& key);
  void set(const std::string& key, const std::string& value);
  void erase(const std::string& key);
  void event(nlohmann::json j, bool print);
  bool wait_for_config();
  void poll_heartbeats();
  int beat_generation(int g) const;
  bool alive(int g, int generation) const;
  std::vector<int> ranks_of(int replica) const;
  Joiners complete_joiners();
  void admit(Round& round, const Joiners& joiners);
  bool first_round(Round& round);
  void tell_dropped(int replica, int generation, const std::string& why);

  // --- the rounds (coordinator.cpp) ---
  Outcome collect(const Round& round, std::string* why);
  void apply_schedule(Round& round, std::set<int>* let_in);
  std::optional<Round> decide_next(const Round& prev, bool committed);
  std::set<int> over_the_retry_limit(const Round& prev);
  std::chrono::milliseconds ready_timeout() const;
  void linger();
  void forget(int64_t q);

  CoordinatorOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::ofstream events_;
  LiveConfig config_;
  int replicas_ = 0;
  std::vector<ScheduledChange> schedule_;
  std::set<std::ptrdiff_t> applied_;
  std::set<int> held_out_;
  std::set<int> needs_state_;  // members that have not yet got the job's state in a committed round
  std::vector<Beat> beats_;
  std::set<std::string> malformed_;  // malformed values already reported (key=value)
  Clock::time_point last_poll_{};
  bool waiting_logged_ = false;
  // The slowest committed round so far, from its decision to its last "done" (it holds the step
  // and whatever the ranks did between steps: an optimizer step, a checkpoint's save).
  std::chrono::milliseconds slowest_round_{0};
  // Discarded attempts in a row with the same members (a failure that repeats every round).
  int discards_in_a_row_ = 0;
  std::string last_failure_;  // why the last discarded round was discarded
  int first_failed_ = -1;  // the member whose "done" said it failed first in the round (-1: none)
  std::vector<int> discarded_members_;
};

}  // namespace fsdp::detail
