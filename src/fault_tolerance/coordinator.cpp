// The coordinator's loop (coordinator.h): one round at a time, its verdict, and the members of
// the next one.
#include <algorithm>
#include <thread>

#include "fault_tolerance/coordinator.h"

namespace fsdp::detail {

int Coordinator::run() {
  if (!wait_for_config()) return 1;
  Round round;
  if (!first_round(round)) return 1;
  while (true) {
    const auto started = Clock::now();
    set("round/" + std::to_string(round.number), round.to_json().dump());
    event({{"event", "round"}, {"round", round.number}, {"step", round.step}, {"members", round.members},
           {"joining", round.joining}, {"source", round.source}, {"left", round.left}, {"epoch", round.epoch}},
          !round.left.empty() || !round.joining.empty() || round.number == 0);
    std::string why;
    first_failed_ = -1;
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
    if (committed) {
      slowest_round_ = std::max(slowest_round_,
                                std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started));
    }
    if (!committed) {
      last_failure_ = why;
      event({{"event", "discarded"}, {"round", round.number}, {"step", round.step}, {"why", why}}, true);
    }
    forget(round.number - 2);
    std::optional<Round> next = decide_next(round, committed);
    if (!next) return 1;
    round = *next;
  }
}

// Every member's "done" for this round, or the first failure: a member that says it failed or
// whose heartbeat stopped.
Coordinator::Outcome Coordinator::collect(const Round& round, std::string* why) {
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
          first_failed_ = r;  // the others fail after it, at the discard: this one is the cause
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
void Coordinator::apply_schedule(Round& round, std::set<int>* let_in) {
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

std::optional<Round> Coordinator::decide_next(const Round& prev, bool committed) {
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
  const auto deadline = Clock::now() + ready_timeout();
  bool holding = false;  // "waiting/<next>" written
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
    // A member slow to be ready may keep the others waiting longer than their FSDP_LIVE_TIMEOUT_S:
    // they read that the next round is held back, not that the coordinator is gone.
    if (!holding && Clock::now() > deadline - ready_timeout() + std::chrono::seconds(1)) {
      set("waiting/" + std::to_string(next.number), "a member is not yet ready for the redo");
      holding = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (!committed) {  // alive but not ready by the deadline: stuck; dropped like a gone group
    for (int r : prev.members) {
      for (int g : ranks_of(r)) {
        if (gone.count(r) || has(ready + std::to_string(g))) continue;
        gone.insert(r);
        tell_dropped(r, prev.generation.at(r),
                     "rank " + std::to_string(g) + " was not ready for the redo of step " + std::to_string(prev.step) +
                         " within the ready timeout (" + std::to_string(ready_timeout().count() / 1000) +
                         " s: FSDP_LIVE_READY_TIMEOUT_S, or 3 times the slowest step so far)");
      }
    }
    for (int r : over_the_retry_limit(prev)) gone.insert(r);
  } else {
    discards_in_a_row_ = 0;
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
  Joiners joiners;
  while (!past_the_end) {
    joiners = complete_joiners();
    for (auto it = joiners.begin(); it != joiners.end();) {
      it = next.has(it->first) || held_out_.count(it->first) ? joiners.erase(it) : std::next(it);
    }
    bool missing = false;
    for (int r : let_in) missing = missing || !joiners.count(r);
    // Fewer groups than the job's minimum (at least one): the round waits for joiners, and its
    // members wait with it (they read "waiting/q" and do not time out).
    const size_t have = next.members.size() + joiners.size();
    const bool too_few = have < static_cast<size_t>(std::max(1, config_.min_replicas));
    const bool hopeless = too_few && options_.replacements_exhausted && options_.replacements_exhausted();
    if ((!missing && !too_few) || Clock::now() > until || hopeless) break;
    if (too_few && !waiting_logged_) {
      const std::string why = have == 0 ? "no replica group is left; waiting for one to join"
                                        : std::to_string(have) + " replica group(s) left, fewer than the job's minimum of " +
                                              std::to_string(config_.min_replicas) + "; waiting for more to join";
      set("waiting/" + std::to_string(next.number), why);
      event({{"event", "waiting"}, {"step", next.step}, {"why", why}}, true);
      waiting_logged_ = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (waiting_logged_ || holding) erase("waiting/" + std::to_string(next.number));
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
  const bool too_few = next.members.size() < static_cast<size_t>(std::max(1, config_.min_replicas));
  if (too_few || next.source < 0) {
    const std::string why = next.members.empty() ? "no replica group is left"
                            : too_few ? "fewer replica groups than the job's minimum (" +
                                            std::to_string(config_.min_replicas) +
                                            "), and none joined within the empty timeout or can (the launcher is out "
                                            "of --max-restarts)"
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

// A failure that repeats with the same members every round (a partition between two groups that
// both reach the coordinator, a transfer that always fails) would be redone forever: after the
// job's max_retries redos in a row, one group is left out, as torchft's max_retries does. Which:
// the groups that were joining (the transfer is theirs), else the group whose failure discarded
// the last attempt (the others' fail after it, at the discard); never the last group with the
// job's state.
std::set<int> Coordinator::over_the_retry_limit(const Round& prev) {
  if (prev.members == discarded_members_) {
    ++discards_in_a_row_;
  } else {
    discards_in_a_row_ = 1;
    discarded_members_ = prev.members;
  }
  if (config_.max_retries < 0 || discards_in_a_row_ <= config_.max_retries) return {};
  std::set<int> out(prev.joining.begin(), prev.joining.end());
  if (out.empty() && first_failed_ >= 0 && prev.has(first_failed_)) {
    int holders = 0;
    for (int r : prev.members) holders += needs_state_.count(r) ? 0 : 1;
    if (holders > 1 || needs_state_.count(first_failed_)) out.insert(first_failed_);
  }
  for (int r : out) {
    tell_dropped(r, prev.generation.at(r),
                 "step " + std::to_string(prev.step) + " failed " + std::to_string(discards_in_a_row_) +
                     " times in a row with the same groups (the job's max_retries is " +
                     std::to_string(config_.max_retries) + "; the last failure: " + last_failure_ +
                     "): this group is left out so that the others train on");
  }
  if (!out.empty()) {
    event({{"event", "retry_limit"}, {"step", prev.step}, {"attempts", discards_in_a_row_},
           {"left_out", std::vector<int>(out.begin(), out.end())}},
          true);
    discards_in_a_row_ = 0;
    discarded_members_.clear();
  }
  return out;
}

// How long a member alive after a discarded round may take to say it is ready: at least the
// configured time, and 3 times the slowest committed round, so that a group whose steps (or the
// checkpoint saves between them) are slow is never taken for a stuck one.
std::chrono::milliseconds Coordinator::ready_timeout() const {
  return std::max(options_.ready_timeout, 3 * slowest_round_);
}

// The store stays up until every rank is gone (a group sitting out must still read "end"), for
// at most 10 s: a rank's own work after training (its evaluation, its export) needs no store.
void Coordinator::linger() {
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
void Coordinator::forget(int64_t q) {
  if (q < 0) return;
  const std::string n = std::to_string(q);
  erase("round/" + n);
  erase("commit/" + n);
  for (int g = 0; g < config_.world_size; ++g) {
    erase("done/" + n + "/" + std::to_string(g));
    erase("ready/" + n + "/" + std::to_string(g));
  }
}

}  // namespace fsdp::detail
