#include "comm/collective_log.h"

#include <map>
#include <sstream>
#include <utility>
#include <vector>

namespace fsdp {

const char* const kSameCollectivesOnEveryRank =
    "Every rank must run the same units in the same order in every forward and backward: most often the "
    "model's control flow depends on this rank's data (a unit skipped, or run twice, on some ranks only), or "
    "the ranks run different loops (one rank runs an extra forward, backward or no_sync step). Run every "
    "branch on every rank (multiply an unused branch's output by zero), or agree on the branch first (an "
    "all-reduce of the decision).";

namespace {
std::string one_line(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\t') c = ' ';
  }
  return s;
}
std::string key_of(int group_rank) { return "rank/" + std::to_string(group_rank); }
}  // namespace

CollectiveLog::CollectiveLog(c10::intrusive_ptr<c10d::Store> store, std::string group_name, int group_rank,
                             int group_size, int world_rank, std::chrono::milliseconds check_after)
    : store_(std::move(store)),
      group_name_(std::move(group_name)),
      group_rank_(group_rank),
      group_size_(group_size),
      world_rank_(world_rank),
      check_after_(check_after) {}

void CollectiveLog::set_group(const c10::intrusive_ptr<c10d::Backend>& group) {
  std::lock_guard<std::mutex> lock(mutex_);
  group_.emplace(group);
}

int64_t CollectiveLog::record(const std::string& description) {
  std::lock_guard<std::mutex> lock(mutex_);
  recent_.push_back(Entry{issued_, description});
  if (recent_.size() > kKept) recent_.pop_front();
  return issued_++;
}

std::string CollectiveLog::payload() {
  std::string out = std::to_string(world_rank_) + "\n";
  for (const Entry& e : recent_) out += std::to_string(e.seq) + "\t" + one_line(e.what) + "\n";
  return out;
}

SlowWaitCheck compare_when_slow(CollectiveLog* log, bool blocks) {
  SlowWaitCheck slow;
  if (log == nullptr || log->check_after().count() <= 0) return slow;
  if (blocks) slow.every = log->check_after();
  slow.check = [log] { return log->compare_with_peers(); };
  return slow;
}

std::string CollectiveLog::compare_with_peers() {
  try {
    std::map<int64_t, std::string> mine;
    std::string published;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      published = payload();
      for (const Entry& e : recent_) mine.emplace(e.seq, one_line(e.what));
    }
    store_->set(key_of(group_rank_), std::vector<uint8_t>(published.begin(), published.end()));
    struct Difference {
      int64_t seq = -1;
      int peer = -1;
      std::string theirs;
    } first;
    for (int r = 0; r < group_size_; ++r) {
      if (r == group_rank_ || !store_->check({key_of(r)})) continue;  // not waiting (yet): nothing to compare
      const std::vector<uint8_t> raw = store_->get(key_of(r));
      std::istringstream in(std::string(raw.begin(), raw.end()));
      std::string line;
      std::getline(in, line);
      const int peer = std::stoi(line);
      while (std::getline(in, line)) {
        const size_t tab = line.find('\t');
        if (tab == std::string::npos) continue;
        const int64_t seq = std::stoll(line.substr(0, tab));
        const auto it = mine.find(seq);
        if (it == mine.end() || it->second == line.substr(tab + 1)) continue;
        if (first.seq < 0 || seq < first.seq) first = Difference{seq, peer, line.substr(tab + 1)};
        break;
      }
    }
    if (first.seq < 0) return "";
    {
      // Never destroyed from here on (set_group): a leak of one group in a process that is ending.
      static auto* const kept = new std::vector<c10::intrusive_ptr<c10d::Backend>>();
      static std::mutex kept_mutex;
      std::lock_guard<std::mutex> lock(mutex_);
      if (group_) {
        if (auto group = group_->lock()) {
          std::lock_guard<std::mutex> k(kept_mutex);
          kept->push_back(std::move(group));
        }
      }
    }
    return "fsdp: the ranks issued different collectives on process group '" + group_name_ + "': its collective #" +
           std::to_string(first.seq + 1) + " was the " + mine.at(first.seq) + " on rank " +
           std::to_string(world_rank_) + ", but the " + first.theirs + " on rank " + std::to_string(first.peer) +
           ". Gloo pairs a group's collectives by their order, not by what they are: from that one on, the ranks "
           "exchanged each other's data, and now each waits for a collective its peers never issue. " +
           kSameCollectivesOnEveryRank;
  } catch (const std::exception&) {
    return "";
  }
}

}  // namespace fsdp
