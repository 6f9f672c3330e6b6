// The coordinator of live replica groups (fsdp/fault_tolerance.h): it hosts the store the ranks
// meet in, so it must outlive every rank (rank 0 can fail like any other), and it decides every
// round: who is in it, who joins and from whom it copies, and whether the step is committed.
//
// One loop, one round at a time (the protocol is in quorum.h):
//   write round q -> collect every member's "done" (or notice a member gone) -> write commit q ->
//   decide round q + 1's members (drop gone groups, apply the schedule, admit complete joiners).
// A discarded round waits until each member either says it is ready for the next one or is gone,
// so that a group that failed mid-round is not put in the next round only to fail it again.
#include "fsdp/fault_tolerance.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "fault_tolerance/quorum.h"
#include "fault_tolerance/value_signing.h"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;
using detail::kLivePrefix;
using detail::Round;

class Coordinator {
 public:
  Coordinator(const CoordinatorOptions& options, c10::intrusive_ptr<c10d::Store> store)
      : options_(options), store_(std::move(store)) {
    if (!options_.events_jsonl.empty()) events_.open(options_.events_jsonl, std::ios::app);
  }

  int run() {
    if (!wait_for_config()) return 1;
    Round round;
    if (!first_round(round)) return 1;
    while (true) {
      set("round/" + std::to_string(round.number), round.to_json().dump());
      event({{"event", "round"}, {"round", round.number}, {"step", round.step}, {"members", round.members},
             {"joining", round.joining}, {"source", round.source}, {"left", round.left}, {"epoch", round.epoch}},
            !round.left.empty() || !round.joining.empty() || round.number == 0);
      std::string why;
      const Outcome outcome = collect(round, &why);
      if (outcome == Outcome::kFinished) {
        set("end", "1");
        event({{"event", "end"}, {"step", round.step}, {"members", round.members}}, true);
        if (options_.on_end) options_.on_end(0);
        linger();
        return 0;
      }
      const bool committed = outcome == Outcome::kCommitted;
      set("commit/" + std::to_string(round.number), committed ? "1" : "0");
      if (!committed) {
        event({{"event", "discarded"}, {"round", round.number}, {"step", round.step}, {"why", why}}, true);
      }
      forget(round.number - 2);
      std::optional<Round> next = decide_next(round, committed);
      if (!next) return 1;
      round = *next;
    }
  }

 private:
  enum class Outcome { kCommitted, kDiscarded, kFinished };

  struct Beat {
    std::string value;
    Clock::time_point changed;
  };

  // Whether `key` holds an authentic value: a forged or damaged one counts as none (the rank's own
  // write, when it comes, replaces it).
  bool has(const std::string& key) { return store_->check({kLivePrefix + key}) && read(key).has_value(); }
  // A value as a rank wrote it, when it carries the job's secret (value_signing.h); nullopt for
  // one that does not (forged, or a process without the secret), said once.
  std::optional<std::string> read(const std::string& key) {
    const std::string stored = detail::to_string(store_->get(kLivePrefix + key));
    auto value = detail::verify_value(options_.secret, key, stored);
    if (!value && malformed_.insert(key + "=" + stored).second) {
      event({{"event", "unauthenticated"}, {"key", key}, {"value", stored.substr(0, 80)}}, true);
    }
    return value;
  }
  // The value, or "" (which no rank writes) for one that is not authentic.
  std::string get(const std::string& key) { return read(key).value_or(""); }
  void set(const std::string& key, const std::string& value) {
    store_->set(kLivePrefix + key, detail::to_bytes(detail::sign_value(options_.secret, key, value)));
  }
  void erase(const std::string& key) { store_->deleteKey(kLivePrefix + key); }

  void event(nlohmann::json j, bool print) {
    j["time"] = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    j["source_of"] = "coordinator";
    if (events_) events_ << j.dump() << std::endl;
    if (print) std::cerr << ("fsdp-coordinator: " + j.dump() + "\n") << std::flush;
  }

  bool wait_for_config() {
    const auto start = Clock::now();
    while (!has("config")) {
      if (Clock::now() - start > options_.start_timeout) {
        event({{"event", "error"}, {"why", "no rank arrived"}}, true);
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const auto config = read("config");
    if (!config) {
      event({{"event", "error"}, {"why", "the job's config does not carry this coordinator's secret: start the ranks and "
                                         "the coordinator with the same FSDP_LIVE_SECRET (or FSDP_LIVE_SECRET_FILE)"}},
            true);
      return false;
    }
    try {
      config_ = detail::LiveConfig::decode(*config);
    } catch (const std::exception& e) {
      event({{"event", "error"}, {"why", e.what()}}, true);
      return false;
    }
    if (config_.world_size < 1 || config_.ranks_per_replica < 1 || config_.world_size % config_.ranks_per_replica != 0) {
      event({{"event", "error"}, {"why", "the ranks' config is damaged: " + get("config")}}, true);
      return false;
    }
    replicas_ = config_.world_size / config_.ranks_per_replica;
    schedule_ = detail::parse_schedule(config_.schedule, replicas_);
    beats_.assign(static_cast<size_t>(config_.world_size), Beat{});
    event({{"event", "config"}, {"world_size", config_.world_size}, {"ranks_per_replica", config_.ranks_per_replica},
           {"replicas", replicas_}, {"steps", config_.total_steps}, {"schedule", config_.schedule}},
          true);
    return true;
  }

  // Heartbeats: a rank is alive while its value keeps changing.
  void poll_heartbeats() {
    const auto now = Clock::now();
    if (now - last_poll_ < std::chrono::milliseconds(50)) return;
    last_poll_ = now;
    for (int g = 0; g < config_.world_size; ++g) {
      const std::string key = "hb/" + std::to_string(g);
      if (!has(key)) continue;
      const auto beat = read(key);
      if (!beat) continue;  // not the rank's: its last authentic beat stands
      const std::string& v = *beat;
      auto& b = beats_[static_cast<size_t>(g)];
      if (v != b.value) {
        b.value = v;
        b.changed = now;
      }
    }
  }
  int beat_generation(int g) const {
    // A malformed beat (not "gen:counter") is no generation's: that rank looks gone.
    const auto beat = detail::parse_pair(beats_[static_cast<size_t>(g)].value);
    return beat ? static_cast<int>(beat->first) : 0;
  }
  bool alive(int g, int generation) const {
    const auto& b = beats_[static_cast<size_t>(g)];
    return !b.value.empty() && beat_generation(g) == generation && Clock::now() - b.changed < options_.dead_after;
  }
  std::vector<int> ranks_of(int replica) const {
    std::vector<int> out;
    for (int f = 0; f < config_.ranks_per_replica; ++f) out.push_back(replica * config_.ranks_per_replica + f);
    return out;
  }

  // Groups whose F ranks all asked to join with one generation and are alive: replica -> (gen, step).
  std::map<int, std::pair<int, int64_t>> complete_joiners() {
    poll_heartbeats();
    std::map<int, std::pair<int, int64_t>> out;
    for (int r = 0; r < replicas_; ++r) {
      int gen = -1;
      int64_t step = -1;
      bool complete = true;
      for (int g : ranks_of(r)) {
        const std::string key = "join/" + std::to_string(g);
        if (!has(key)) { complete = false; break; }
        const std::string v = get(key);
        const auto join = detail::parse_pair(v);
        if (!join) {
          // Not "gen:step": not a rank of this protocol (or a stray client). Said once, then ignored.
          if (malformed_.insert(key + "=" + v).second) {
            event({{"event", "malformed"}, {"key", key}, {"value", v.substr(0, 80)}}, true);
          }
          complete = false;
          break;
        }
        const int their_gen = static_cast<int>(join->first);
        const int64_t their_step = join->second;
        if ((gen >= 0 && their_gen != gen) || (step >= 0 && their_step != step) || !alive(g, their_gen)) {
          complete = false;
          break;
        }
        gen = their_gen;
        step = their_step;
      }
      if (complete) out[r] = {gen, step};
    }
    return out;
  }

  void admit(Round& round, const std::map<int, std::pair<int, int64_t>>& joiners) {
    for (const auto& [r, gs] : joiners) {
      for (int g : ranks_of(r)) {
        erase("join/" + std::to_string(g));
        set("admit/" + std::to_string(g) + "/" + std::to_string(gs.first), std::to_string(round.number));
      }
    }
  }

  bool first_round(Round& round) {
    const auto start = Clock::now();
    std::map<int, std::pair<int, int64_t>> joiners;
    while (true) {
      joiners = complete_joiners();
      if (static_cast<int>(joiners.size()) == replicas_) break;
      if (Clock::now() - start > options_.start_timeout) {
        if (!joiners.empty()) break;
        event({{"event", "error"}, {"why", "no replica group had all its ranks within the start timeout"}}, true);
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // The newest state among them is the job's; groups behind it copy it.
    int64_t step = -1;
    for (const auto& [r, gs] : joiners) step = std::max(step, gs.second);
    round.number = 0;
    round.step = step;
    for (const auto& [r, gs] : joiners) {
      round.members.push_back(r);
      round.generation[r] = gs.first;
      if (gs.second != step) needs_state_.insert(r);
      else if (round.source < 0) round.source = r;
    }
    round.joining.assign(needs_state_.begin(), needs_state_.end());
    if (round.joining.empty()) round.source = -1;
    apply_schedule(round, nullptr);
    admit(round, joiners);
    return true;
  }

  // Every member's "done" for this round, or the first failure: a member that says it failed or
  // whose heartbeat stopped.
  Outcome collect(const Round& round, std::string* why) {
    std::set<int> pending;
    for (int r : round.members) {
      for (int g : ranks_of(r)) pending.insert(g);
    }
    const int total = static_cast<int>(pending.size());
    int finished = 0;
    const std::string q = std::to_string(round.number);
    while (!pending.empty()) {
      poll_heartbeats();
      for (auto it = pending.begin(); it != pending.end();) {
        const int g = *it;
        const int r = g / config_.ranks_per_replica;
        const std::string done = "done/" + q + "/" + std::to_string(g);
        if (has(done)) {
          const std::string v = get(done);
          if (v != "ok") {
            *why = "rank " + std::to_string(g) + " (replica group " + std::to_string(r) + "): " + v;
            return Outcome::kDiscarded;
          }
          it = pending.erase(it);
        } else if (has("finished/" + std::to_string(g))) {
          ++finished;
          it = pending.erase(it);
        } else if (!alive(g, round.generation.at(r))) {
          *why = "rank " + std::to_string(g) + " (replica group " + std::to_string(r) + ") stopped responding";
          return Outcome::kDiscarded;
        } else {
          ++it;
        }
      }
      if (!pending.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return finished == total ? Outcome::kFinished : Outcome::kCommitted;
  }

  // The schedule's changes at round.step: groups it sends out sit out (and are held out until it
  // lets them back); groups it lets back are admitted as soon as they ask.
  void apply_schedule(Round& round, std::set<int>* let_in) {
    for (const auto& c : schedule_) {
      if (c.step != round.step || applied_.count(&c - schedule_.data())) continue;
      applied_.insert(&c - schedule_.data());
      if (c.out) {
        held_out_.insert(c.replica);
        if (round.has(c.replica)) {
          round.members.erase(std::find(round.members.begin(), round.members.end(), c.replica));
          round.generation.erase(c.replica);
          round.sitting_out.push_back(c.replica);
          round.left.push_back(c.replica);
        }
      } else {
        held_out_.erase(c.replica);
        if (let_in) let_in->insert(c.replica);
      }
    }
  }

  std::optional<Round> decide_next(const Round& prev, bool committed) {
    Round next;
    next.number = prev.number + 1;
    next.step = committed ? prev.step + 1 : prev.step;
    if (committed) {
      for (int r : prev.joining) needs_state_.erase(r);
    }
    // Who of the previous round is still here: after a discarded round each member rank says it
    // is ready, or is gone (its heartbeat stops within dead_after). A rank that is alive may be
    // mid-step (it learns of the discard only when it reaches the replica average), so it gets
    // ready_timeout, not dead_after.
    const std::string ready = "ready/" + std::to_string(next.number) + "/";
    const auto deadline = Clock::now() + options_.ready_timeout;
    std::set<int> gone;
    while (true) {
      poll_heartbeats();
      gone.clear();
      bool waiting = false;
      for (int r : prev.members) {
        for (int g : ranks_of(r)) {
          if (!alive(g, prev.generation.at(r))) {
            gone.insert(r);
          } else if (!committed && !has(ready + std::to_string(g))) {
            waiting = true;
          }
        }
      }
      if (!waiting || Clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (!committed) {  // alive but not ready by the deadline: stuck; dropped like a gone group
      for (int r : prev.members) {
        for (int g : ranks_of(r)) {
          if (!has(ready + std::to_string(g))) gone.insert(r);
        }
      }
    }
    for (int r : prev.members) {
      if (gone.count(r)) {
        next.left.push_back(r);
        needs_state_.erase(r);
        continue;
      }
      next.members.push_back(r);
      next.generation[r] = prev.generation.at(r);
    }
    std::set<int> let_in;
    apply_schedule(next, &let_in);
    // A group the schedule lets back in at this step joins now: wait for it to ask. Not after the
    // last step: the members do not run that round (their loop has ended), so a joiner would wait
    // for a state nobody sends (issue 37, item 8); it reads the end instead.
    const bool past_the_end = next.step >= config_.total_steps && !next.members.empty();
    const auto until = Clock::now() + options_.empty_timeout;
    std::map<int, std::pair<int, int64_t>> joiners;
    while (!past_the_end) {
      joiners = complete_joiners();
      for (auto it = joiners.begin(); it != joiners.end();) {
        it = next.has(it->first) || held_out_.count(it->first) ? joiners.erase(it) : std::next(it);
      }
      bool missing = false;
      for (int r : let_in) missing = missing || !joiners.count(r);
      const bool nobody = next.members.empty() && joiners.empty();
      if ((!missing && !nobody) || Clock::now() > until) break;
      if (nobody && !waiting_logged_) {
        event({{"event", "waiting"}, {"why", "no replica group is left; waiting for one to join"}}, true);
        waiting_logged_ = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    waiting_logged_ = false;
    for (const auto& [r, gs] : joiners) {
      next.members.push_back(r);
      next.generation[r] = gs.first;
      needs_state_.insert(r);
    }
    std::sort(next.members.begin(), next.members.end());
    for (int r : next.members) {
      if (!needs_state_.count(r)) {
        next.source = r;
        break;
      }
    }
    if (next.members.empty() || next.source < 0) {
      const std::string why = next.members.empty() ? "no replica group is left"
                                                   : "no replica group with the job's state is left to copy from";
      event({{"event", "lost"}, {"step", next.step}, {"why", why + ": restart the job from its newest checkpoint"}},
            true);
      set("end", "lost");
      if (options_.on_end) options_.on_end(1);
      return std::nullopt;
    }
    for (int r : next.members) {
      if (needs_state_.count(r)) next.joining.push_back(r);
    }
    if (next.joining.empty()) next.source = -1;
    // A discarded round's replica groups may have been left mid-collective: every member rebuilds;
    // so it does when a group came back as a new generation (a replacement took its place within
    // one decision: the same members, other processes).
    next.epoch = prev.epoch + (next.members != prev.members || next.generation != prev.generation || !committed ? 1 : 0);
    admit(next, joiners);
    return next;
  }

  // The store stays up until every rank is gone (a group sitting out must still read "end"), for
  // at most 10 s: a rank's own work after training (its evaluation, its export) needs no store.
  void linger() {
    const auto until = Clock::now() + std::chrono::seconds(10);
    while (Clock::now() < until) {
      poll_heartbeats();
      bool any = false;
      for (int g = 0; g < config_.world_size && !any; ++g) any = alive(g, beat_generation(g));
      if (!any) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  // Keys of an old round: the store keeps only what the next decisions read.
  void forget(int64_t q) {
    if (q < 0) return;
    const std::string n = std::to_string(q);
    erase("round/" + n);
    erase("commit/" + n);
    for (int g = 0; g < config_.world_size; ++g) {
      erase("done/" + n + "/" + std::to_string(g));
      erase("ready/" + n + "/" + std::to_string(g));
    }
  }

  CoordinatorOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::ofstream events_;
  detail::LiveConfig config_;
  int replicas_ = 0;
  std::vector<detail::ScheduledChange> schedule_;
  std::set<std::ptrdiff_t> applied_;
  std::set<int> held_out_;
  std::set<int> needs_state_;  // members that have not yet got the job's state in a committed round
  std::vector<Beat> beats_;
  std::set<std::string> malformed_;  // malformed values already reported (key=value)
  Clock::time_point last_poll_{};
  bool waiting_logged_ = false;
};

}  // namespace

CoordinatorOptions CoordinatorOptions::from_environment() {
  CoordinatorOptions o;
  o.secret = detail::live_secret_from_environment();
  const char* raw = std::getenv("FSDP_LIVE_DEAD_AFTER_S");
  if (raw != nullptr && *raw != '\0') {
    char* end = nullptr;
    const double s = std::strtod(raw, &end);
    if (end == raw || *end != '\0' || !(s > 0) || s > 3600) {
      throw std::invalid_argument(std::string("fsdp: FSDP_LIVE_DEAD_AFTER_S='") + raw + "' is not a number of seconds");
    }
    o.dead_after = std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
  }
  return o;
}

int run_coordinator(const CoordinatorOptions& options, const std::function<void(int)>& on_listening) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(options.port);
  if (!options.bind_address.empty()) {
    // The store binds every interface by itself; a socket bound here, listening, is handed to it.
    in_addr address{};
    if (::inet_pton(AF_INET, options.bind_address.c_str(), &address) != 1) {
      throw std::invalid_argument("fsdp-coordinator: cannot bind '" + options.bind_address +
                                  "': give an IPv4 address of this host (127.0.0.1 for this machine's ranks only)");
    }
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in at{};
    at.sin_family = AF_INET;
    at.sin_port = htons(static_cast<uint16_t>(options.port));
    at.sin_addr = address;
    socklen_t len = sizeof(at);
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof(at)) != 0 || ::listen(fd, 128) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&at), &len) != 0) {
      const std::string why = std::strerror(errno);
      if (fd >= 0) ::close(fd);
      throw std::runtime_error("fsdp-coordinator: cannot listen on " + options.bind_address + ":" +
                               std::to_string(options.port) + " (" + why + ")");
    }
    so.port = ntohs(at.sin_port);
    so.masterListenFd = fd;
  }
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = std::chrono::seconds(60);
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>("0.0.0.0", so);
  } catch (const std::exception& e) {
    throw std::runtime_error("fsdp-coordinator: cannot listen on port " + std::to_string(options.port) +
                             " (is it in use?): " + std::string(e.what()).substr(0, std::string(e.what()).find('\n')));
  }
  if (on_listening) on_listening(store->getPort());
  Coordinator coordinator(options, store);
  return coordinator.run();
}

}  // namespace fsdp
