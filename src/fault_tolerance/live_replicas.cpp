// A rank of a live replica group (fsdp/fault_tolerance.h): its side of the quorum protocol
// (quorum.h), the replica process group of each epoch, the state a joining group receives, and
// the once-per-step average over the members.
//
// Rank states, in order: connected -> admitted (its group is in a round) -> in a round -> done
// (commit or discard) -> the next round, or sitting out (back to asking to join). A failure of a
// replica collective never reaches the model: the engine's collectives stay inside the group
// (its F ranks, one host), and the one collective across groups runs after backward, here. When a
// member fails, the others' collective either errors (its sockets closed) or never completes (a
// host that vanished sends nothing): the coordinator then discards the round, and a rank waiting
// on it abandons the group (its threads end at their own timeout; it is never reused).
#include "fsdp/fault_tolerance.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <set>
#include <stdexcept>
#include <thread>

#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "checkpoint/optimizer_state.h"
#include "comm/mesh_state.h"
#include "fault_tolerance/job_identity.h"
#include "fault_tolerance/quorum.h"
#include "fault_tolerance/value_signing.h"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;
using detail::kLivePrefix;
using detail::Round;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

std::chrono::milliseconds seconds_from_env(const char* name, std::chrono::milliseconds fallback) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') return fallback;
  char* end = nullptr;
  const double s = std::strtod(raw, &end);
  if (end == raw || *end != '\0' || !(s > 0) || s > 1e6) {
    throw std::invalid_argument(std::string("fsdp: ") + name + "='" + raw + "' is not a positive number of seconds");
  }
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

c10::intrusive_ptr<c10d::TCPStore> client(const LaunchEnv& env, std::chrono::milliseconds timeout) {
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
                             first_line(e.what()) + ")");
  }
}

// Tensors packed into flat buffers of one dtype each, and back: one collective per dtype instead
// of one per tensor.
struct Packed {
  std::vector<at::Tensor> buffers;
  std::vector<std::pair<size_t, int64_t>> where;  // tensor -> (buffer, offset)
};
Packed pack(const std::vector<at::Tensor>& tensors) {
  Packed p;
  std::map<c10::ScalarType, size_t> buffer_of;
  std::vector<int64_t> sizes;
  for (const auto& t : tensors) {
    auto [it, fresh] = buffer_of.try_emplace(t.scalar_type(), sizes.size());
    if (fresh) sizes.push_back(0);
    p.where.emplace_back(it->second, sizes[it->second]);
    sizes[it->second] += t.numel();
  }
  for (const auto& [dtype, b] : buffer_of) {
    p.buffers.resize(std::max(p.buffers.size(), b + 1));
    p.buffers[b] = at::empty({sizes[b]}, at::TensorOptions().dtype(dtype));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto [b, off] = p.where[i];
    p.buffers[b].narrow(0, off, tensors[i].numel()).copy_(tensors[i].reshape({-1}));
  }
  return p;
}
void unpack(const Packed& p, std::vector<at::Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto [b, off] = p.where[i];
    tensors[i].copy_(p.buffers[b].narrow(0, off, tensors[i].numel()).view(tensors[i].sizes()));
  }
}

}  // namespace

LiveOptions LiveOptions::from_environment() {
  LiveOptions o;
  o.timeout = seconds_from_env("FSDP_LIVE_TIMEOUT_S", o.timeout);
  o.secret = detail::live_secret_from_environment();
  return o;
}

struct LiveReplicas::Impl {
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
  Round round;              // the round in progress
  int64_t epoch = -1;       // the epoch `group` was built for
  GroupPtr group;           // this rank's replica process group: the same shard rank in every member
  bool poisoned = false;    // `group` may be mid-collective: never used again

  std::string key(const std::string& k) const { return kLivePrefix + k; }
  std::string me() const { return std::to_string(env.rank); }

  // The coordinator's store; losing it is this rank's end, with an error that says so.
  [[noreturn]] void lost(const std::string& what, const std::exception& e) const {
    throw std::runtime_error("fsdp: rank " + me() + " (replica group " + std::to_string(replica) + ") " + what +
                             " the live replicas' coordinator at " + env.master_addr + ":" +
                             std::to_string(env.master_port) + ": it is gone or unreachable, and with it who is in each "
                             "step: restart the job from its newest checkpoint (scripts/cluster --max-restarts does). (" + first_line(e.what()) + ")");
  }
  // The value of `k` when it carries the job's secret (value_signing.h); nullopt for one that does not.
  std::optional<std::string> read(const std::string& k) {
    std::string stored;
    try {
      stored = detail::to_string(store->get(key(k)));
    } catch (const std::exception& e) {
      lost("lost", e);
    }
    return detail::verify_value(options.secret, k, stored);
  }
  // Whether `k` holds an authentic value: a forged one counts as none.
  bool has(const std::string& k) {
    try {
      if (!store->check({key(k)})) return false;
    } catch (const std::exception& e) {
      lost("lost", e);
    }
    return read(k).has_value();
  }
  // The authentic value of `k` (which exists): a forged one is never acted on; the coordinator's
  // write replaces it, so this waits for that, up to the timeout.
  std::string get(const std::string& k) {
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
  void set(const std::string& k, const std::string& v) {
    try {
      store->set(key(k), detail::to_bytes(detail::sign_value(options.secret, k, v)));
    } catch (const std::exception& e) {
      lost("lost", e);
    }
  }

  void erase(const std::string& k) {
    try {
      store->deleteKey(key(k));
    } catch (const std::exception& e) {
      lost("lost", e);
    }
  }

  // Blocks until the coordinator writes `k`; its loss or silence is this rank's error.
  std::string wait_for(const std::string& k, const char* what) {
    const auto t0 = Clock::now();
    try {
      store->wait({key(k)}, options.timeout);
    } catch (const std::exception& e) {
      // Its connection closed (it died) or it said nothing for the whole timeout (it hangs, or
      // the network between is down).
      if (Clock::now() - t0 < options.timeout) lost("lost", e);
      lost("got no " + std::string(what) + " within " + std::to_string(options.timeout.count() / 1000) +
               " s (FSDP_LIVE_TIMEOUT_S) from",
           e);
    }
    return get(k);
  }

  // A collective on the replica group: done, or abandoned once the coordinator discards the round.
  void wait_or_abandon(const c10::intrusive_ptr<c10d::Work>& work) {
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

  void drop_group() {
    // A group left mid-collective has threads blocked until their timeout: destroying it would
    // wait for them, so it is let go without destruction.
    if (group && poisoned) (void)group.release();
    group.reset();
    epoch = -1;
    poisoned = false;
  }

  void build_group(const std::shared_ptr<Mesh>& m) {
    drop_group();
    const auto pos = std::find(round.members.begin(), round.members.end(), replica) - round.members.begin();
    auto prefix = c10::make_intrusive<c10d::PrefixStore>(
        kLivePrefix + "epoch" + std::to_string(round.epoch) + "/shard" + std::to_string(shard_rank) + "/", store);
    group = detail::MeshState::of(*m).make_group_on(prefix, "replicas", static_cast<int>(pos),
                                                   static_cast<int>(round.members.size()), c10::DeviceType::CPU);
    epoch = round.epoch;
  }

  // The source's parameters, optimizer state and step, sent to every member (the others hold the
  // same values already; they receive them too, which keeps this one broadcast).
  int64_t sync_state(int64_t held_step, const std::vector<at::Tensor>& params, torch::optim::Optimizer* optimizer,
                     int64_t* bytes) {
    const int root = static_cast<int>(std::find(round.members.begin(), round.members.end(), round.source) -
                                      round.members.begin());
    std::unique_ptr<OptimizerStateAdapter> adapter;
    if (optimizer) adapter = OptimizerStateAdapter::for_optimizer(*optimizer);
    const std::vector<std::string> keys = adapter ? adapter->tensor_keys() : std::vector<std::string>{};
    const int64_t per = 2 + static_cast<int64_t>(keys.size());
    // The header: the step, then per parameter whether it has state, its step and which tensors.
    at::Tensor header = at::zeros({1 + static_cast<int64_t>(params.size()) * per}, at::kLong);
    auto h = header.accessor<int64_t, 1>();
    h[0] = held_step;
    for (size_t i = 0; i < params.size() && adapter; ++i) {
      const ParamOptimState s = adapter->get(*optimizer, params[i]);
      h[1 + i * per] = s.present ? 1 : 0;
      h[2 + i * per] = s.step;
      for (size_t k = 0; k < keys.size(); ++k) h[3 + i * per + k] = s.tensors.count(keys[k]) ? 1 : 0;
    }
    broadcast({header}, root);
    // Every member's state takes the source's shape, then the source's values.
    std::vector<at::Tensor> tensors;
    for (size_t i = 0; i < params.size(); ++i) tensors.push_back(params[i].detach());
    for (size_t i = 0; i < params.size() && adapter; ++i) {
      ParamOptimState mine = adapter->get(*optimizer, params[i]);
      ParamOptimState want;
      want.present = h[1 + i * per] != 0;
      want.step = h[2 + i * per];
      for (size_t k = 0; k < keys.size() && want.present; ++k) {
        if (h[3 + i * per + k] == 0) continue;
        auto it = mine.tensors.find(keys[k]);
        want.tensors[keys[k]] = it != mine.tensors.end() && it->second.sizes() == params[i].sizes()
                                    ? it->second
                                    : at::zeros_like(params[i].detach());
        tensors.push_back(want.tensors[keys[k]]);
      }
      adapter->set(*optimizer, params[i], want);
    }
    Packed packed = pack(tensors);
    broadcast(packed.buffers, root);
    unpack(packed, tensors);
    *bytes = 0;
    for (const auto& b : packed.buffers) *bytes += b.numel() * static_cast<int64_t>(b.element_size());
    return h[0];
  }

  void broadcast(std::vector<at::Tensor> tensors, int root) {
    for (auto& t : tensors) {
      std::vector<at::Tensor> one{t};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      wait_or_abandon(group->broadcast(one, o));
    }
  }

  // A round this rank cannot run: says so, learns the verdict, and says it is ready for the next.
  void discard(const std::string& why) {
    const std::string q = std::to_string(round.number);
    set("done/" + q + "/" + me(), "fail: " + why);
    wait_for("commit/" + q, "verdict");
    poisoned = true;
    set("ready/" + std::to_string(round.number + 1) + "/" + me(), "1");
    next_round = round.number + 1;
  }
};

LiveReplicas::LiveReplicas(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

LiveReplicas::~LiveReplicas() {
  impl_->stop = true;
  if (impl_->watchdog.joinable()) impl_->watchdog.join();
  if (impl_->heartbeat.joinable()) impl_->heartbeat.join();
  if (impl_->group && impl_->poisoned) (void)impl_->group.release();
}

void check_live_layout(int world_size, int local_world_size, int F) {
  if (F < 1 || world_size % F != 0) {
    throw std::invalid_argument("fsdp: live replicas of " + std::to_string(F) + " ranks each do not divide the " +
                                std::to_string(world_size) + " ranks: the shard size must divide the world size");
  }
  if (world_size / F < 2) {
    throw std::invalid_argument("fsdp: live replicas need at least 2 replica groups (the world size over the shard "
                                "size is " + std::to_string(world_size / F) + "): with one there is nobody to "
                                "keep training when it fails; use the launcher's --max-restarts instead");
  }
  if (F > local_world_size ? F % local_world_size != 0 : local_world_size % F != 0) {
    throw std::invalid_argument("fsdp: a live replica group of " + std::to_string(F) + " ranks must be whole hosts or "
                                "divide one (" + std::to_string(local_world_size) + " ranks per host)");
  }
}

std::shared_ptr<LiveReplicas> LiveReplicas::connect(const LaunchEnv& env, LiveOptions options, MeshOptions mesh_options) {
  const int F = options.ranks_per_replica;
  check_live_layout(env.world_size, env.local_world_size, F);
  auto impl = std::make_unique<Impl>();
  impl->env = env;
  impl->options = options;
  impl->mesh_options = mesh_options;
  impl->F = F;
  impl->R = env.world_size / F;
  impl->replica = env.rank / F;
  impl->shard_rank = env.rank % F;
  detail::parse_schedule(options.schedule, impl->R);  // refused here, with the item, before it reaches anyone
  impl->store = client(env, mesh_options.init_timeout);
  detail::LiveConfig cfg{env.world_size, F, options.total_steps, options.schedule};
  const std::string mine = cfg.encode();
  const std::string stored = detail::to_string(
      impl->store->compareSet(impl->key("config"), {}, detail::to_bytes(detail::sign_value(options.secret, "config", mine))));
  const auto authentic = detail::verify_value(options.secret, "config", stored);
  if (!authentic) {
    throw std::invalid_argument("fsdp: this rank (" + impl->me() + ") holds a job secret the job's config was not written "
                                "with (or the job has one and this rank none): give every rank and the coordinator the "
                                "same FSDP_LIVE_SECRET (or FSDP_LIVE_SECRET_FILE)");
  }
  const std::string& theirs = *authentic;
  if (theirs.rfind(detail::kLiveProtocol + " ", 0) != 0) {
    throw std::invalid_argument("fsdp: this rank (" + impl->me() + ") speaks the live replicas' protocol " +
                                detail::kLiveProtocol + ", but the job's config reads '" + theirs.substr(0, 80) +
                                "': a rank of another fsdp build (or not fsdp) started the job; run the same build on "
                                "every rank");
  }
  if (theirs != mine) {
    throw std::invalid_argument("fsdp: this rank (" + impl->me() + ") was started as '" + mine +
                                "' (world size, shard size, steps, schedule) but the job's first rank as '" + theirs +
                                "': start every rank with the same flags");
  }
  // A second live holder of a rank is refused: only a replacement of a dead one joins (the newest
  // generation would otherwise take the place of a healthy rank and evict its group). The holder's
  // heartbeat changes every interval while it lives; a dead one's stands still.
  const std::string beat_key = impl->key("hb/" + impl->me());
  if (impl->store->check({beat_key})) {
    const auto before = impl->store->get(beat_key);
    std::this_thread::sleep_for(3 * options.heartbeat + std::chrono::milliseconds(100));
    if (impl->store->get(beat_key) != before) {
      throw std::invalid_argument("fsdp: rank " + impl->me() + " of the live job is alive (its heartbeat reaches the "
                                  "coordinator): this process, started as RANK " + impl->me() + " too, is refused and "
                                  "the job goes on. Start a rank again only once it has stopped (a replacement of a "
                                  "dead rank joins), or give this one the RANK of a rank that is gone");
    }
  }
  impl->gen = static_cast<int>(impl->store->add(impl->key("incarnation/" + impl->me()), 1));
  // The heartbeat has a connection of its own: the main one blocks while it waits for decisions.
  auto beat_store = client(env, mesh_options.init_timeout);
  Impl* p = impl.get();
  auto now_ms = [] {
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
  };
  impl->last_beat_ms = now_ms();
  impl->heartbeat = std::thread([p, beat_store, now_ms] {
    int64_t n = 0;
    const std::string k = p->key("hb/" + p->me());
    while (!p->stop) {
      try {
        beat_store->set(k, detail::to_bytes(detail::sign_value(p->options.secret, "hb/" + p->me(),
                                                                std::to_string(p->gen) + ":" + std::to_string(n++))));
        // A set is not answered: it succeeds into the socket of a coordinator that is frozen
        // (stopped, not dead). A check is: the beat counts only once the coordinator replied, so
        // the watchdog below stops this rank when it does not (issue 37, item 6).
        beat_store->check({k});
        p->last_beat_ms = now_ms();
      } catch (const std::exception&) {
        return;  // the coordinator is gone: the main thread's next wait says so
      }
      std::this_thread::sleep_for(p->options.heartbeat);
    }
  });
  impl->watchdog = std::thread([p, now_ms] {
    while (!p->stop) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (p->disarmed || now_ms() - p->last_beat_ms < p->options.timeout.count()) continue;
      const std::string msg = "fsdp-train: error: fsdp: rank " + p->me() + " (replica group " +
                              std::to_string(p->replica) + ") has not reached the live replicas' coordinator at " +
                              p->env.master_addr + ":" + std::to_string(p->env.master_port) + " for " +
                              std::to_string(p->options.timeout.count() / 1000) +
                              " s (FSDP_LIVE_TIMEOUT_S): it is gone, or this host is cut off from it. This rank "
                              "stops; its group is out of the job (start it again to rejoin)\n";
      (void)!::write(2, msg.data(), msg.size());
      std::_Exit(1);
    }
  });
  // The group's own mesh, apart from every earlier incarnation's.
  LaunchEnv sub = env;
  sub.rank = impl->shard_rank;
  sub.world_size = F;
  sub.local_world_size = std::min(F, env.local_world_size);
  sub.local_rank = impl->shard_rank % sub.local_world_size;
  auto prefix = c10::make_intrusive<c10d::PrefixStore>(
      kLivePrefix + "replica" + std::to_string(impl->replica) + "/gen" + std::to_string(impl->gen) + "/", impl->store);
  try {
    impl->mesh = detail::MeshState::over_store(prefix, sub, mesh_options, env.local_world_size);
  } catch (...) {
    impl->stop = true;  // a joinable thread must not outlive its Impl
    impl->watchdog.join();
    impl->heartbeat.join();
    throw;
  }
  return std::shared_ptr<LiveReplicas>(new LiveReplicas(std::move(impl)));
}

const std::shared_ptr<Mesh>& LiveReplicas::replica_mesh() const { return impl_->mesh; }
int LiveReplicas::replica() const { return impl_->replica; }
int LiveReplicas::replicas() const { return impl_->R; }
int LiveReplicas::generation() const { return impl_->gen; }

void LiveReplicas::declare_identity(const std::map<std::string, std::string>& items) {
  Impl& s = *impl_;
  const std::string mine = detail::encode_identity(items);
  std::string stored;
  try {
    stored = detail::to_string(
        s.store->compareSet(s.key("identity"), {}, detail::to_bytes(detail::sign_value(s.options.secret, "identity", mine))));
  } catch (const std::exception& e) {
    s.lost("lost", e);
  }
  const std::string theirs = detail::verify_value(s.options.secret, "identity", stored).value_or(stored);
  if (auto why = detail::identity_difference(mine, theirs)) {
    throw std::invalid_argument("fsdp: rank " + s.me() + " (replica group " + std::to_string(s.replica) + ", generation " +
                                std::to_string(s.gen) + ") is not the same job as the live one: " + *why +
                                ". It does not join, and the groups in the job train on; start it with the job's "
                                "flags (model, optimizer, strategy, data, seed)");
  }
}

LiveRound LiveReplicas::next_round(int64_t held_step, const std::vector<at::Tensor>& params,
                                   torch::optim::Optimizer* optimizer) {
  Impl& s = *impl_;
  const auto t0 = Clock::now();
  LiveRound out;
  while (true) {
    if (s.next_round < 0) {
      // Ask to be admitted, then wait: the coordinator admits a whole group at a step boundary.
      s.set("join/" + s.me(), std::to_string(s.gen) + ":" + std::to_string(held_step));
      const std::string admit = "admit/" + s.me() + "/" + std::to_string(s.gen);
      while (!s.has(admit)) {
        if (s.has("end")) {
          if (s.get("end") != "1") {
            throw std::runtime_error("fsdp: rank " + s.me() + " (replica group " + std::to_string(s.replica) +
                                     ") asked to join, but the coordinator lost the job: no replica group with its "
                                     "state is left. Restart the job from its newest checkpoint");
          }
          out.step = s.options.total_steps;  // the job ended before this group got in
          return out;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      const auto admitted = detail::parse_integer(s.get(admit));
      if (!admitted) {
        throw std::runtime_error("fsdp: rank " + s.me() + ": the coordinator's admission '" + s.get(admit).substr(0, 80) +
                                 "' is not a round number: the store holds a value no coordinator wrote");
      }
      s.next_round = *admitted;
      s.erase(admit);  // a group that sits out later asks again under the same name
    }
    const std::string decision = s.wait_for("round/" + std::to_string(s.next_round), "round");
    try {
      s.round = Round::from_json(nlohmann::json::parse(decision));
    } catch (const std::exception& e) {
      throw std::runtime_error("fsdp: rank " + s.me() + ": round " + std::to_string(s.next_round) + " in the store ('" +
                               decision.substr(0, 80) + "') is not a decision the coordinator wrote: " + first_line(e.what()));
    }
    if (!s.round.has(s.replica)) {
      const bool sitting_out = std::count(s.round.sitting_out.begin(), s.round.sitting_out.end(), s.replica) > 0;
      if (!sitting_out) {
        throw std::runtime_error("fsdp: replica group " + std::to_string(s.replica) + " was dropped from the job at step " +
                                 std::to_string(s.round.step) + " (a rank of it stopped responding or failed); the "
                                 "other groups train on. Restart this group's ranks to rejoin");
      }
      s.drop_group();
      s.next_round = -1;  // sit out: ask again, the schedule lets it back in
      out.left.push_back(s.replica);
      continue;
    }
    if (s.round.generation.at(s.replica) != s.gen) {
      throw std::runtime_error("fsdp: rank " + s.me() + " is generation " + std::to_string(s.gen) +
                               " but its replica group's round names generation " +
                               std::to_string(s.round.generation.at(s.replica)) + ": a newer rank took its place");
    }
    try {
      if (s.round.epoch != s.epoch || s.poisoned || !s.group) s.build_group(s.mesh);
      out.wait_ms = ms_since(t0);
      if (!s.round.joining.empty()) {
        const auto t1 = Clock::now();
        const int64_t step = s.sync_state(held_step, params, optimizer, &out.transfer_bytes);
        out.transfer_ms = ms_since(t1);
        if (step != s.round.step) {
          throw std::runtime_error("the source held step " + std::to_string(step) + ", the round is for step " +
                                   std::to_string(s.round.step));
        }
      }
    } catch (const std::exception& e) {
      s.discard(first_line(e.what()));
      continue;
    }
    out.number = s.round.number;
    out.step = s.round.step;
    out.members = s.round.members;
    out.left.insert(out.left.end(), s.round.left.begin(), s.round.left.end());
    out.joined = s.round.joining;
    out.source = s.round.source;
    out.i_joined = std::count(s.round.joining.begin(), s.round.joining.end(), s.replica) > 0;
    return out;
  }
}

bool LiveReplicas::average(std::vector<at::Tensor>& tensors, std::string* why) {
  Impl& s = *impl_;
  try {
    Packed packed = pack(tensors);
    for (auto& b : packed.buffers) {
      std::vector<at::Tensor> one{b};
      s.wait_or_abandon(s.group->allreduce(one));
      b.div_(static_cast<double>(s.round.members.size()));
    }
    unpack(packed, tensors);
    return true;
  } catch (const std::exception& e) {
    if (why) *why = first_line(e.what());
    return false;
  }
}

bool LiveReplicas::commit(bool ok, const std::string& why) {
  Impl& s = *impl_;
  const std::string q = std::to_string(s.round.number);
  s.set("done/" + q + "/" + s.me(), ok ? "ok" : "fail: " + why);
  const std::string verdict = s.wait_for("commit/" + q, "verdict");
  if (!ok && verdict == "1") {
    // The coordinator commits only when every member said "ok", and this rank said it failed: the
    // verdict is forged or damaged. Applying it would step from gradients this rank did not average.
    throw std::runtime_error("fsdp: rank " + s.me() + ": round " + q + " reads committed, but this rank's own average "
                             "failed (" + why + "): the verdict is not the coordinator's. This rank stops rather than "
                             "apply a step it did not average; restart it to rejoin");
  }
  const bool committed = verdict == "1";
  s.next_round = s.round.number + 1;
  if (!committed) {
    // The group is rebuilt for the redo. Where this rank's own collectives completed (ok), it has
    // no thread blocked in it and is destroyed; where one failed or was abandoned, average()
    // marked it poisoned: let go, never reused.
    s.epoch = -1;
    s.set("ready/" + std::to_string(s.next_round) + "/" + s.me(), "1");
  }
  return committed;
}

void LiveReplicas::finish() {
  impl_->set("finished/" + impl_->me(), "1");
  impl_->disarmed = true;  // what the rank does after training needs no coordinator
}

}  // namespace fsdp
