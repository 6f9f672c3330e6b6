// What the coordinator (coordinator.h) knows of the ranks: their values in the store (authentic
// ones only: value_signing.h), their heartbeats, the groups that ask to join and the first round.
#include <algorithm>
#include <iostream>
#include <thread>

#include "fault_tolerance/coordinator.h"
#include "fault_tolerance/value_signing.h"

namespace fsdp::detail {

Coordinator::Coordinator(const CoordinatorOptions& options, c10::intrusive_ptr<c10d::Store> store)
    : options_(options), store_(std::move(store)) {
  if (!options_.events_jsonl.empty()) events_.open(options_.events_jsonl, std::ios::app);
}

// Whether `key` holds an authentic value: a forged or damaged one counts as none (the rank's own
// write, when it comes, replaces it).
bool Coordinator::has(const std::string& key) { return store_->check({kLivePrefix + key}) && read(key).has_value(); }
// A value as a rank wrote it, when it carries the job's secret (value_signing.h); nullopt for
// one that does not (forged, or a process without the secret), said once.
std::optional<std::string> Coordinator::read(const std::string& key) {
  const std::string stored = detail::to_string(store_->get(kLivePrefix + key));
  auto value = detail::verify_value(options_.secret, key, stored);
  if (!value && malformed_.insert(key + "=" + stored).second) {
    event({{"event", "unauthenticated"}, {"key", key}, {"value", stored.substr(0, 80)}}, true);
  }
  return value;
}
// The value, or "" (which no rank writes) for one that is not authentic.
std::string Coordinator::get(const std::string& key) { return read(key).value_or(""); }
void Coordinator::set(const std::string& key, const std::string& value) {
  store_->set(kLivePrefix + key, detail::to_bytes(detail::sign_value(options_.secret, key, value)));
}
void Coordinator::erase(const std::string& key) { store_->deleteKey(kLivePrefix + key); }

void Coordinator::event(nlohmann::json j, bool print) {
  j["time"] = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  j["source_of"] = "coordinator";
  if (events_) events_ << j.dump() << std::endl;
  if (print) std::cerr << ("fsdp-coordinator: " + j.dump() + "\n") << std::flush;
}

bool Coordinator::wait_for_config() {
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
void Coordinator::poll_heartbeats() {
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
int Coordinator::beat_generation(int g) const {
  // A malformed beat (not "gen:counter") is no generation's: that rank looks gone.
  const auto beat = detail::parse_pair(beats_[static_cast<size_t>(g)].value);
  return beat ? static_cast<int>(beat->first) : 0;
}
bool Coordinator::alive(int g, int generation) const {
  const auto& b = beats_[static_cast<size_t>(g)];
  return !b.value.empty() && beat_generation(g) == generation && Clock::now() - b.changed < options_.dead_after;
}
std::vector<int> Coordinator::ranks_of(int replica) const {
  std::vector<int> out;
  for (int f = 0; f < config_.ranks_per_replica; ++f) out.push_back(replica * config_.ranks_per_replica + f);
  return out;
}

// Groups whose F ranks all asked to join with one generation and are alive: replica -> (gen, step).
Coordinator::Joiners Coordinator::complete_joiners() {
  poll_heartbeats();
  Joiners out;
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

void Coordinator::admit(Round& round, const Joiners& joiners) {
  for (const auto& [r, gs] : joiners) {
    for (int g : ranks_of(r)) {
      erase("join/" + std::to_string(g));
      set("admit/" + std::to_string(g) + "/" + std::to_string(gs.first), std::to_string(round.number));
    }
  }
}

bool Coordinator::first_round(Round& round) {
  const auto start = Clock::now();
  Joiners joiners;
  while (true) {
    joiners = complete_joiners();
    if (static_cast<int>(joiners.size()) == replicas_) break;
    const bool enough = joiners.size() >= static_cast<size_t>(std::max(1, config_.min_replicas));
    // A rank down for good (refused, or failed with no restarts left): its group never completes,
    // so the groups that are complete start (a slower healthy one joins them later).
    if (enough && options_.replacements_exhausted && options_.replacements_exhausted()) break;
    // Ranks down for good before any group started (refused at their first step, or failed with no
    // restart left): a group with one of them never completes. At most down / F groups lose one.
    const int down = options_.ranks_down_for_good ? options_.ranks_down_for_good() : 0;
    const int could = replicas_ - (down + config_.ranks_per_replica - 1) / config_.ranks_per_replica;
    const bool hopeless = down > 0 && could < std::max(1, config_.min_replicas);
    if (hopeless || Clock::now() - start > options_.start_timeout) {
      if (enough) break;
      const std::string why =
          hopeless ? std::to_string(down) + " rank(s) are down for good before the first step, so at most " +
                         std::to_string(std::max(0, could)) + " replica group(s) could still have all their ranks, "
                         "fewer than the job's minimum of " + std::to_string(std::max(1, config_.min_replicas))
                   : std::to_string(joiners.size()) + " replica group(s) had all their ranks within the start timeout, "
                     "fewer than the job's minimum of " + std::to_string(std::max(1, config_.min_replicas));
      event({{"event", "error"}, {"why", why}}, true);
      // The ranks waiting to be admitted read the end and stop (they do not wait for the timeout).
      set("end", "lost");
      if (options_.on_end) options_.on_end(1);
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
  round.synchronize = round.members.size() > 1;  // the source's state for everyone (Round::synchronize)
  apply_schedule(round, nullptr);
  admit(round, joiners);
  return true;
}

// A group left out while its ranks live (stuck, or over the retry limit) is told why: its ranks
// stop with that instead of waiting for rounds they are not in (and blaming the coordinator).
void Coordinator::tell_dropped(int replica, int generation, const std::string& why) {
  for (int g : ranks_of(replica)) set("dropped/" + std::to_string(g), std::to_string(generation) + ":" + why);
  event({{"event", "dropped"}, {"replica", replica}, {"why", why}}, true);
}

}  // namespace fsdp::detail
