// A live rank's store and replica process group (live_rank.h): what it reads and writes in the
// coordinator's store, how it waits for decisions, and how it leaves a collective the coordinator
// gave up on.
#include "fault_tolerance/live_rank.h"

#include <algorithm>
#include <stdexcept>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "fault_tolerance/value_signing.h"

namespace fsdp {

namespace detail {

c10::intrusive_ptr<c10d::TCPStore> coordinator_client(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const std::exception& e) {
    throw std::runtime_error("fsdp: rank " + std::to_string(env.rank) + " cannot reach the live replicas' coordinator at " +
                             env.master_addr + ":" + std::to_string(env.master_port) +
                             ": start fsdp-coordinator there first (MASTER_ADDR/MASTER_PORT name it). (" +
                             detail::first_line_of(e.what()) + ")");
  }
}

}  // namespace detail

void LiveReplicas::Impl::lost(const std::string& what, const std::exception& e) const {
  throw std::runtime_error("fsdp: " + who() + " " + what + " the live replicas' coordinator at " + env.master_addr + ":" +
                           std::to_string(env.master_port) + ": it is gone or unreachable, and with it who is in each "
                           "step: restart the job from its newest checkpoint (scripts/cluster --max-restarts does). (" +
                           detail::first_line_of(e.what()) + ")");
}

std::optional<std::string> LiveReplicas::Impl::read(const std::string& k) {
  std::string stored;
  try {
    stored = detail::to_string(store->get(key(k)));
  } catch (const std::exception& e) {
    lost("lost", e);
  }
  return detail::verify_value(options.secret, k, stored);
}

// Whether `k` holds an authentic value: a forged one counts as none.
bool LiveReplicas::Impl::has(const std::string& k) {
  try {
    if (!store->check({key(k)})) return false;
  } catch (const std::exception& e) {
    lost("lost", e);
  }
  return read(k).has_value();
}

// The authentic value of `k` (which exists): a forged one is never acted on; the coordinator's
// write replaces it, so this waits for that, up to the timeout.
std::string LiveReplicas::Impl::get(const std::string& k) {
  const auto t0 = Clock::now();
  while (true) {
    if (auto value = read(k)) return *value;
    if (Clock::now() - t0 > options.timeout) {
      throw std::runtime_error("fsdp: rank " + me() + ": the value of '" + k + "' in the live replicas' store has not "
                               "carried the job's secret for " + std::to_string(options.timeout.count() / 1000) +
                               " s: another client keeps writing it, or the coordinator runs without this rank's "
                               "FSDP_LIVE_SECRET. This rank acts on nothing unauthenticated and stops");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void LiveReplicas::Impl::set(const std::string& k, const std::string& v) {
  try {
    store->set(key(k), detail::to_bytes(detail::sign_value(options.secret, k, v)));
  } catch (const std::exception& e) {
    lost("lost", e);
  }
}

void LiveReplicas::Impl::erase(const std::string& k) {
  try {
    store->deleteKey(key(k));
  } catch (const std::exception& e) {
    lost("lost", e);
  }
}

void LiveReplicas::Impl::check_dropped() {
  const std::string k = "dropped/" + me();
  if (!has(k)) return;
  const std::string v = get(k);
  const auto colon = v.find(':');
  if (colon == std::string::npos || detail::parse_integer(v.substr(0, colon)) != std::optional<int64_t>(gen)) return;
  throw LeftOutOfJob("fsdp: replica group " + std::to_string(replica) + " was left out of the job by the "
                           "coordinator: " + v.substr(colon + 1) + ". The other groups train on; start this group's "
                           "ranks again to rejoin (they take the job's state from a live group)");
}

// Polls (a check is answered in tens of microseconds): every millisecond for the first 50 ms, where
// most decisions come, then every 10 ms. Between polls a rank left out of the job learns it
// (dropped/g) instead of waiting out the timeout for a decision that names others, and a decision
// the coordinator says it is holding back (waiting/q: too few groups, or a member that is slow to
// be ready) is waited for as long as it says so. (A blocking wait with a timeout would do too, but
// the store logs a warning for each one that times out.)
std::string LiveReplicas::Impl::wait_for(const std::string& k, const char* what) {
  const auto start = Clock::now();
  const std::string round_prefix = "round/", commit_prefix = "commit/";
  std::string waiting;
  if (k.rfind(round_prefix, 0) == 0) waiting = "waiting/" + k.substr(round_prefix.size());
  auto since = start, last_check = start;
  while (true) {
    if (has(k)) return get(k);
    const auto now = Clock::now();
    if (now - last_check > std::chrono::milliseconds(250)) {
      last_check = now;
      check_dropped();
      if (!waiting.empty() && has(waiting)) since = now;
    }
    if (now - since > options.timeout) {
      // It said nothing for the whole timeout while its store answers: it hangs.
      lost("got no " + std::string(what) + " within " + std::to_string(options.timeout.count() / 1000) +
               " s (FSDP_LIVE_TIMEOUT_S) from",
           std::runtime_error("no decision"));
    }
    std::this_thread::sleep_for(now - start < std::chrono::milliseconds(50) ? std::chrono::milliseconds(1)
                                                                            : std::chrono::milliseconds(10));
  }
}

// A collective on the replica group: done, or abandoned once the coordinator discards the round
// (or left this rank's group out of the job).
void LiveReplicas::Impl::wait_or_abandon(const c10::intrusive_ptr<c10d::Work>& work) {
  auto last_check = Clock::now();
  const std::string commit = "commit/" + std::to_string(round.number);
  while (!work->isCompleted()) {
    if (Clock::now() - last_check > std::chrono::milliseconds(50)) {
      last_check = Clock::now();
      if (has(commit) && read(commit) == std::optional<std::string>("0")) {
        poisoned = true;
        throw std::runtime_error("the coordinator discarded the round while this rank waited for its peers");
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  try {
    work->wait();
  } catch (...) {
    poisoned = true;
    throw;
  }
}

void LiveReplicas::Impl::drop_group() {
  // A group left mid-collective has threads blocked until their timeout: destroying it would
  // wait for them, so it is let go without destruction.
  if (group && poisoned) (void)group.release();
  group.reset();
  epoch = -1;
  poisoned = false;
}

void LiveReplicas::Impl::build_group() {
  drop_group();
  const auto pos = std::find(round.members.begin(), round.members.end(), replica) - round.members.begin();
  auto prefix = c10::make_intrusive<c10d::PrefixStore>(
      detail::kLivePrefix + "epoch" + std::to_string(round.epoch) + "/shard" + std::to_string(shard_rank) + "/", store);
  group = detail::MeshState::of(*mesh).make_group_on(prefix, "replicas", static_cast<int>(pos),
                                                     static_cast<int>(round.members.size()), c10::DeviceType::CPU);
  epoch = round.epoch;
}

void LiveReplicas::Impl::broadcast(std::vector<at::Tensor> tensors, int root) {
  for (auto& t : tensors) {
    std::vector<at::Tensor> one{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    wait_or_abandon(group->broadcast(one, o));
  }
}

void LiveReplicas::Impl::discard(const std::string& why) {
  const std::string q = std::to_string(round.number);
  set("done/" + q + "/" + me(), "fail: " + why);
  wait_for("commit/" + q, "verdict");
  poisoned = true;
  set("ready/" + std::to_string(round.number + 1) + "/" + me(), "1");
  next_round = round.number + 1;
}

}  // namespace fsdp
