// What this rank issued on one process group, numbered in issue order (the idea of PyTorch's NCCL
// flight recorder), so that a collective that waits long can find out why: it publishes its recent
// entries through the store and reads its peers'. Gloo pairs collectives by their order on a group,
// not by what they are, so ranks whose control flow differs (a unit skipped on one rank) pair an
// all-gather of one unit with another unit's of the same size: they compute with each other's
// parameters, and then wait for collectives their peers never issue, until the collective timeout
// blames a peer that "probably exited". The first entry where two ranks' logs differ names the
// collective where they parted, and the caller gets that instead, seconds after the ranks stop.
//
// The entries are what every rank writes for the same collective (kind, unit, payload, size,
// dtype; never a rank number), so logs of ranks that agree are prefixes of each other: a rank that
// is merely slow, or a snapshot published before its rank went on, is never a difference.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/collectives.h"

namespace fsdp {

class CollectiveLog {
 public:
  // `store`: where the group's ranks meet (keys are prefixed with the group's name); `world_rank`
  // names this rank in messages. `check_after`: how long a wait goes before comparing (0: never).
  CollectiveLog(c10::intrusive_ptr<c10d::Store> store, std::string group_name, int group_rank, int group_size,
                int world_rank, std::chrono::milliseconds check_after);

  // The group this log is of: kept alive for the rest of the process once its ranks are found to
  // differ (below).
  void set_group(const c10::intrusive_ptr<c10d::Backend>& group);

  // Called as each collective is issued on the group, in issue order. Returns its number on the
  // group (0, 1, ...), the same on every rank whose collectives on the group agree.
  int64_t record(const std::string& description);

  // Publishes this rank's recent entries and compares them with those its peers published.
  // Returns the explanation of the first collective where two ranks differ (an error message that
  // says what to change), or "" when none is seen yet. A failing store gives "" (the collective's
  // own timeout still ends the wait). When it finds a difference, the group is never destroyed:
  // its threads wait in collectives no peer will complete, and destroying it would join them, so a
  // program that ends on the error would wait out the collective timeout on its way out.
  std::string compare_with_peers();

  std::chrono::milliseconds check_after() const { return check_after_; }
  const std::string& group_name() const { return group_name_; }

  // How many entries a rank keeps and publishes: a divergence is found when it lies within the
  // last this-many collectives of both ranks (ranks stop a handful of collectives after it).
  static constexpr size_t kKept = 256;

 private:
  struct Entry {
    int64_t seq;
    std::string what;
  };
  std::string payload();  // under mutex_: this rank's world rank, then "seq\twhat" per entry

  c10::intrusive_ptr<c10d::Store> store_;
  std::string group_name_;
  int group_rank_, group_size_, world_rank_;
  std::chrono::milliseconds check_after_;
  std::mutex mutex_;
  std::deque<Entry> recent_;
  int64_t issued_ = 0;
  std::optional<c10::weak_intrusive_ptr<c10d::Backend>> group_;
};

// What a wait for a collective on `log`'s group (null: none) does when it takes long (`blocks`: a
// CPU wait that blocks the thread) or fails: compare the ranks' logs.
SlowWaitCheck compare_when_slow(CollectiveLog* log, bool blocks = true);

// The same advice wherever fsdp finds that ranks issued different collectives.
extern const char* const kSameCollectivesOnEveryRank;

}  // namespace fsdp
