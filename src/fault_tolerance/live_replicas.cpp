// A rank of a live replica group (fsdp/fault_tolerance.h): connecting to the job (its config,
// its identity, its heartbeat and watchdog), and the calls of a step: the round, the average over
// the members, the commit. The rank's state and protocol are in live_rank.h.
#include "fsdp/fault_tolerance.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "fault_tolerance/job_identity.h"
#include "fault_tolerance/live_rank.h"
#include "fault_tolerance/value_signing.h"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;
using detail::kLivePrefix;
using detail::Round;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

}  // namespace

LiveOptions LiveOptions::from_environment() {
  LiveOptions o;
  o.timeout = detail::seconds_from_environment("FSDP_LIVE_TIMEOUT_S", o.timeout);
  o.min_replicas = detail::integer_from_environment("FSDP_LIVE_MIN_REPLICAS", o.min_replicas, 1, 1 << 20);
  o.max_retries = detail::integer_from_environment("FSDP_LIVE_MAX_RETRIES", o.max_retries, -1, 1 << 20);
  o.secret = detail::live_secret_from_environment();
  return o;
}

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
  if (options.min_replicas < 1 || options.min_replicas > impl->R) {
    throw std::invalid_argument("fsdp: live replicas' min_replicas " + std::to_string(options.min_replicas) +
                                " is not between 1 and the job's " + std::to_string(impl->R) + " replica groups");
  }
  // Refused here, with the item, before it reaches anyone.
  detail::check_schedule(detail::parse_schedule(options.schedule, impl->R), impl->R, options.min_replicas);
  impl->store = detail::coordinator_client(env, mesh_options.init_timeout);
  detail::LiveConfig cfg{env.world_size, F, options.total_steps, options.min_replicas, options.max_retries,
                         options.schedule};
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
                                "' (protocol, world size, shard size, steps, min replicas, max retries, schedule) but the job's first "
                                "rank as '" + theirs +
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
  auto beat_store = detail::coordinator_client(env, mesh_options.init_timeout);
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
      const std::string msg = "fsdp: error: rank " + p->me() + " (replica group " +
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
int64_t LiveReplicas::total_steps() const { return impl_->options.total_steps; }

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

void LiveReplicas::register_state(const std::string& name, std::function<std::string()> save,
                                  std::function<void(const std::string&)> load) {
  if (impl_->user_states_declared) {
    throw std::logic_error("fsdp: register_state('" + name + "') after the first round: register every state before "
                           "the first start_step (next_round), the same on every rank");
  }
  if (!save || !load) throw std::invalid_argument("fsdp: register_state('" + name + "') needs a save and a load function");
  if (!impl_->user_states.emplace(name, Impl::UserState{std::move(save), std::move(load)}).second) {
    throw std::invalid_argument("fsdp: a live state named '" + name + "' is registered already");
  }
}

LiveRound LiveReplicas::next_round(int64_t held_step, const std::vector<at::Tensor>& params,
                                   torch::optim::Optimizer* optimizer) {
  Impl& s = *impl_;
  if (s.in_round) {
    // Its peers wait for this rank's "done" of that step: it would wait for a round that never
    // comes, and they for a verdict.
    throw std::logic_error("fsdp: " + s.who() + " asked for the next round (LiveManager::start_step) while round " +
                           std::to_string(s.round.number) + " (step " + std::to_string(s.round.step) +
                           ") was not committed: call should_commit (LiveReplicas::average and commit) after every "
                           "step's backward, on every rank, and start the next step only after it");
  }
  if (!s.user_states_declared) s.declare_user_states();
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
                               decision.substr(0, 80) + "') is not a decision the coordinator wrote: " + detail::first_line_of(e.what()));
    }
    if (!s.round.has(s.replica)) {
      const bool sitting_out = std::count(s.round.sitting_out.begin(), s.round.sitting_out.end(), s.replica) > 0;
      if (!sitting_out) {
        s.check_dropped();  // the coordinator's reason, when it left this group out
        throw LeftOutOfJob("fsdp: replica group " + std::to_string(s.replica) + " was dropped from the job at step " +
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
      if (s.round.epoch != s.epoch || s.poisoned || !s.group) s.build_group();
      out.wait_ms = ms_since(t0);
      if (!s.round.joining.empty() || s.round.synchronize) {
        const auto t1 = Clock::now();
        const int64_t step = s.sync_state(held_step, params, optimizer, &out.transfer_bytes);
        out.transfer_ms = ms_since(t1);
        if (step != s.round.step) {
          throw std::runtime_error("the source held step " + std::to_string(step) + ", the round is for step " +
                                   std::to_string(s.round.step));
        }
      }
    } catch (const std::exception& e) {
      s.discard(detail::first_line_of(e.what()));
      continue;
    }
    out.number = s.round.number;
    out.step = s.round.step;
    out.members = s.round.members;
    out.left.insert(out.left.end(), s.round.left.begin(), s.round.left.end());
    out.joined = s.round.joining;
    out.source = s.round.source;
    out.i_joined = std::count(s.round.joining.begin(), s.round.joining.end(), s.replica) > 0;
    s.in_round = s.round.step < s.options.total_steps;
    return out;
  }
}

bool LiveReplicas::average(std::vector<at::Tensor>& tensors, std::string* why) {
  Impl& s = *impl_;
  try {
    detail::Packed packed = detail::pack(tensors);
    for (auto& b : packed.buffers) {
      std::vector<at::Tensor> one{b};
      s.wait_or_abandon(s.group->allreduce(one));
      b.div_(static_cast<double>(s.round.members.size()));
    }
    detail::unpack(packed, tensors);
    return true;
  } catch (const std::exception& e) {
    if (why) *why = detail::first_line_of(e.what());
    return false;
  }
}

bool LiveReplicas::agree(at::Tensor& values, std::string* why) {
  Impl& s = *impl_;
  try {
    std::vector<at::Tensor> one{values};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    s.wait_or_abandon(s.group->allreduce(one, o));
    return true;
  } catch (const std::exception& e) {
    if (why) *why = detail::first_line_of(e.what());
    return false;
  }
}

bool LiveReplicas::commit(bool ok, const std::string& why) {
  Impl& s = *impl_;
  const std::string q = std::to_string(s.round.number);
  s.set("done/" + q + "/" + s.me(), ok ? "ok" : "fail: " + why);
  const std::string verdict = s.wait_for("commit/" + q, "verdict");
  s.in_round = false;
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
