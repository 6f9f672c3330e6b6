// The quorum protocol between the coordinator (coordinator.cpp) and the ranks
// (live_replicas.cpp), spoken through the store the coordinator hosts. Every key is under
// "fsdp/live/"; g is a global rank, r a replica group, q a round:
//
//   config                 "fsdp-live/3 W F steps min_replicas max_retries schedule" of the job (the
//                          protocol's version first); the first rank sets it, the others must find
//                          the same (a mismatched launch is refused before training)
//   identity               the job's identity items (job_identity.h): a joiner of another job is refused
//   incarnation/g          a counter: the generation of each process that has been rank g
//   hb/g                   "gen:counter", rewritten every heartbeat by a thread of rank g
//   join/g                 "gen:step": rank g (generation gen, state at step) asks to be in a round
//   admit/g/gen            the round a joining rank is in
//   round/q                the round's decision (Round, as JSON)
//   done/q/g               "ok" or "fail: why": how rank g's step went
//   commit/q               "1": every member finished the step; "0": discard it
//   ready/q/g              after a discarded round: rank g is alive and wants round q
//   finished/g             rank g trained every step
//   dropped/g              "gen:why": the coordinator left rank g's group out of the job (a rank of it
//                          was stuck past the ready timeout, or its failures hit the retry limit);
//                          the rank stops with `why` instead of waiting for rounds it is not in
//   end                    "1": every step was trained; "lost": no group with the job's state is left
//
// A round is one attempt at one step. Its members are whole replica groups (all F ranks of a
// generation, every heartbeat fresh). The members of round q + 1 are those of q, less groups with
// a rank that is gone, less groups the schedule sends out, plus groups whose F ranks all asked to
// join; whenever they change the epoch changes, and the replica process groups are rebuilt under
// a store prefix named after it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fsdp::detail {

inline const std::string kLivePrefix = "fsdp/live/";
// The protocol's version, first in the config: a rank of another build is refused by name.
inline const std::string kLiveProtocol = "fsdp-live/3";

struct Round {
  int64_t number = 0;
  int64_t step = 0;                // the training step this round computes
  int64_t epoch = 0;               // the members' version: the replica groups' name
  std::vector<int> members;        // replica groups, ascending
  std::map<int, int> generation;   // member -> the generation of its ranks
  std::vector<int> joining;        // members that receive the state this round
  int source = -1;                 // the member that sends it (-1: nobody joins)
  std::vector<int> left;           // members of the previous round that are not in this one
  std::vector<int> sitting_out;    // of `left`: sent out by the schedule (they wait to come back)
  bool end = false;                // the job ended: no more rounds
  // The job's first round: every member takes the source's state (its parameters, optimizer state
  // and registered states), so that groups built apart start as one replica, as DDP's first
  // broadcast and torchft's init_sync make them.
  bool synchronize = false;

  nlohmann::json to_json() const;
  static Round from_json(const nlohmann::json& j);
  bool has(int replica) const;
};

// One scheduled membership change: group `replica` leaves (out) or comes back (in) at `step`.
struct ScheduledChange {
  bool out = true;
  int replica = 0;
  int64_t step = 0;
};
// "out:1@5,in:1@8" -> the changes; throws std::invalid_argument saying what is wrong.
std::vector<ScheduledChange> parse_schedule(const std::string& text, int replicas);
// Refuses a schedule that cannot run: a group's items not alternating out, in at rising steps, or
// fewer than min_replicas groups in at some step.
void check_schedule(const std::vector<ScheduledChange>& changes, int replicas, int min_replicas);

// "W F steps min_replicas max_retries schedule" and back.
struct LiveConfig {
  int world_size = 0;
  int ranks_per_replica = 0;
  int64_t total_steps = 0;
  int min_replicas = 1;  // LiveOptions::min_replicas
  int max_retries = 3;   // LiveOptions::max_retries
  std::string schedule;
  std::string encode() const;
  static LiveConfig decode(const std::string& text);
};

// Values the ranks write, read defensively (a malformed one is nullopt, never an exception that
// would end the coordinator): "a:b" of two integers (a heartbeat's or a join's), one integer.
std::optional<std::pair<int64_t, int64_t>> parse_pair(const std::string& text);
std::optional<int64_t> parse_integer(const std::string& text);

// A positive number of seconds from the environment variable `name`, or `fallback` when unset;
// throws std::invalid_argument naming the variable for anything else.
std::chrono::milliseconds seconds_from_environment(const char* name, std::chrono::milliseconds fallback);
// A whole number from `name` within [low, high], or `fallback` when unset.
int integer_from_environment(const char* name, int fallback, int low, int high);

std::string to_string(const std::vector<uint8_t>& bytes);
std::vector<uint8_t> to_bytes(const std::string& text);
std::string list_text(const std::vector<int>& groups);  // "1, 2"

}  // namespace fsdp::detail
