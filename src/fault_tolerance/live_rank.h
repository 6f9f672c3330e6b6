// One rank of a live replica group (fsdp/fault_tolerance.h, LiveReplicas): its state and its side
// of the quorum protocol (quorum.h).
//
// Rank states, in order: connected -> admitted (its group is in a round) -> in a round -> done
// (commit or discard) -> the next round, or sitting out (back to asking to join). A failure of a
// replica collective never reaches the model: the engine's collectives stay inside the group
// (its F ranks, one host), and the one collective across groups runs after backward. When a
// member fails, the others' collective either errors (its sockets closed) or never completes (a
// host that vanished sends nothing): the coordinator then discards the round, and a rank waiting
// on it abandons the group (its threads end at their own timeout; it is never reused).
//
// The store and the waits are in live_rank.cpp, the state a joining group receives in
// state_transfer.cpp, the public calls in live_replicas.cpp.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/mesh_state.h"
#include "fault_tolerance/quorum.h"
#include "fsdp/fault_tolerance.h"

namespace fsdp {

namespace detail {
// The first line of an error (a c10 error's message carries its backtrace after it).
inline std::string first_line_of(const std::string& s) { return s.substr(0, s.find('\n')); }
}  // namespace detail

struct LiveReplicas::Impl {
  using Clock = std::chrono::steady_clock;

  LaunchEnv env;
  LiveOptions options;
  MeshOptions mesh_options;
  c10::intrusive_ptr<c10d::TCPStore> store;
  int F = 1, R = 1, replica = 0, shard_rank = 0, gen = 0;
  std::shared_ptr<Mesh> mesh;
  std::thread heartbeat;
  // The watchdog: a rank whose heartbeat has not reached the coordinator for options.timeout is
  // cut off (its store calls may block on a link that sends no reset); it stops the process with
  // the reason, as the NCCL watchdog does. Disarmed once this rank finished training.
  std::thread watchdog;
  std::atomic<int64_t> last_beat_ms{0};
  std::atomic<bool> disarmed{false};
  std::atomic<bool> stop{false};
  int64_t next_round = -1;  // -1: this rank's group must ask to be admitted
  detail::Round round;      // the round in progress
  int64_t epoch = -1;       // the epoch `group` was built for
  GroupPtr group;           // this rank's replica process group: the same shard rank in every member
  bool poisoned = false;    // `group` may be mid-collective: never used again
  // The user's own state a joining group receives (LiveReplicas::register_state), by name.
  struct UserState {
    std::function<std::string()> save;
    std::function<void(const std::string&)> load;
  };
  std::map<std::string, UserState> user_states;
  bool user_states_declared = false;  // compared with the job's names before the first round
  bool in_round = false;              // a round was returned and its step not yet committed or discarded

  std::string key(const std::string& k) const { return detail::kLivePrefix + k; }
  std::string me() const { return std::to_string(env.rank); }
  std::string who() const { return "rank " + me() + " (replica group " + std::to_string(replica) + ")"; }

  // --- the coordinator's store (live_rank.cpp) ---
  // Losing it is this rank's end, with an error that says so.
  [[noreturn]] void lost(const std::string& what, const std::exception& e) const;
  std::optional<std::string> read(const std::string& k);  // authentic values only (value_signing.h)
  bool has(const std::string& k);
  std::string get(const std::string& k);
  void set(const std::string& k, const std::string& v);
  void erase(const std::string& k);
  // Blocks until the coordinator writes `k`; its loss or silence, or this rank's group being left
  // out of the job, is this rank's error.
  std::string wait_for(const std::string& k, const char* what);
  // Throws, with the coordinator's reason, when it left this rank's group out of the job.
  void check_dropped();

  // --- the replica process group (live_rank.cpp) ---
  void wait_or_abandon(const c10::intrusive_ptr<c10d::Work>& work);
  void drop_group();
  void build_group();
  void broadcast(std::vector<at::Tensor> tensors, int root);
  // A round this rank cannot run: says so, learns the verdict, and says it is ready for the next.
  void discard(const std::string& why);

  // --- what a joining group receives (state_transfer.cpp) ---
  int64_t sync_state(int64_t held_step, const std::vector<at::Tensor>& params, torch::optim::Optimizer* optimizer,
                     int64_t* bytes);
  void sync_user_states(int root, bool receiving, int64_t* bytes);
  // The names of the registered states must be the job's (the first rank's): a joiner that
  // registered others is refused by name before it asks to join, as declare_identity refuses.
  void declare_user_states();
};

namespace detail {

// A store client of the coordinator at MASTER_ADDR:MASTER_PORT; an error that says where it
// looked when there is none.
c10::intrusive_ptr<c10d::TCPStore> coordinator_client(const LaunchEnv& env, std::chrono::milliseconds timeout);

// Tensors packed into flat buffers of one dtype each, and back: one collective per dtype instead
// of one per tensor.
struct Packed {
  std::vector<at::Tensor> buffers;
  std::vector<std::pair<size_t, int64_t>> where;  // tensor -> (buffer, offset)
};
Packed pack(const std::vector<at::Tensor>& tensors);
void unpack(const Packed& p, std::vector<at::Tensor>& tensors);

}  // namespace detail
}  // namespace fsdp
