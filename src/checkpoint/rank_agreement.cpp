// The collectives by which a checkpoint's ranks agree (rank_agreement.h).
#include "checkpoint/rank_agreement.h"

#include <algorithm>
#include <set>
#include <vector>

#include "checkpoint/checkpoint_folder.h"
#include "checkpoint/dcp_reader.h"
#include "checkpoint/file_system.h"
#include "wrap/sharded_root.h"
#include "fsdp/checkpoint.h"

namespace fsdp {

void agree(const GroupPtr& group, const std::string& mine, const std::string& what) {
  const auto all = all_gather_strings(group, mine);
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) {
      throw std::runtime_error("fsdp: " + what + " failed on rank " + std::to_string(r) + ": " + all[r]);
    }
  }
}

// A checkpoint holds one value of each buffer (buffers are whole on every rank; rank 0 writes
// them, as PyTorch's state dicts hold rank 0's). Buffers that differ across ranks -- BatchNorm's
// running statistics, any buffer a forward updates from the rank's own rows -- come back as rank
// 0's on every rank, so a resumed run is not bit for bit the one saved on the other ranks (an
// evaluation with them, a forward that reads them). Found by the conformance scenario
// Buffers.CheckpointsRestoreBuffersBitwise. Not refused (a BatchNorm model trained without
// synchronized statistics must stay checkpointable, as in PyTorch), but said: the names of the
// buffers that differ, "" when none do. Every rank calls it (a collective).
std::string buffers_that_differ(const GroupPtr& group, detail::ShardedRoot& root) {
  if (group->getSize() == 1) return "";
  std::vector<std::string> names;
  std::string mine;
  for (const auto& b : root.module().named_buffers(true)) {
    if (!b.value().defined()) continue;
    const at::Tensor t = b.value().detach().to(c10::kCPU).contiguous();
    uint64_t h = 1469598103934665603ULL;  // FNV-1a over the bytes
    const auto* p = static_cast<const unsigned char*>(t.data_ptr());
    for (size_t i = 0; i < t.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ULL;
    names.push_back(b.key());
    mine += std::to_string(h) + ",";
  }
  if (names.empty()) return "";
  const auto all = all_gather_strings(group, mine);
  auto split = [](const std::string& s) {
    std::vector<std::string> out;
    size_t from = 0;
    for (size_t comma = s.find(','); comma != std::string::npos; from = comma + 1, comma = s.find(',', from)) {
      out.push_back(s.substr(from, comma - from));
    }
    return out;
  };
  const auto rank0 = split(all[0]);
  std::vector<std::string> differ;
  int first_rank = -1;
  for (size_t i = 0; i < names.size(); ++i) {
    for (size_t r = 1; r < all.size(); ++r) {
      const auto theirs = split(all[r]);
      if (i >= theirs.size() || i >= rank0.size() || theirs[i] != rank0[i]) {
        differ.push_back("'" + names[i] + "'");
        if (first_rank < 0) first_rank = static_cast<int>(r);
        break;
      }
    }
  }
  if (differ.empty()) return "";
  std::string list;
  for (size_t i = 0; i < differ.size() && i < 8; ++i) list += (i ? ", " : "") + differ[i];
  if (differ.size() > 8) list += " and " + std::to_string(differ.size() - 8) + " more";
  return list + " differ across ranks (rank " + std::to_string(first_rank) + "'s from rank 0's)";
}

// Every rank's optimizer must step the same parameters in the same groups (in any order): the
// manifest records rank 0's groups, and a rank whose optimizer lacks a parameter would save no
// state for its piece of it, a checkpoint that resumes that parameter from nothing. Collective:
// throws on every rank, naming the rank and the parameters, before anything is written.
void check_same_optimizer_on_all_ranks(const GroupPtr& group, const RankState& rs) {
  nlohmann::json mine = nullptr;  // no optimizer given
  if (rs.optimizer) {
    std::vector<std::vector<std::string>> groups;
    for (const auto& g : rs.optimizer->groups) {
      std::vector<std::string> names = g.at("params").get<std::vector<std::string>>();
      std::sort(names.begin(), names.end());
      groups.push_back(std::move(names));
    }
    std::sort(groups.begin(), groups.end());
    mine = groups;
  }
  const auto all = all_gather_strings(group, mine.dump());
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    const auto theirs = nlohmann::json::parse(all[r]), first = nlohmann::json::parse(all[0]);
    auto names_of = [](const nlohmann::json& j) {
      std::set<std::string> out;
      if (j.is_array()) {
        for (const auto& g : j) {
          for (const auto& n : g) out.insert(n.get<std::string>());
        }
      }
      return out;
    };
    const auto a = names_of(first), b = names_of(theirs);
    auto list = [](const std::set<std::string>& s) {
      std::string out;
      for (const auto& n : s) out += (out.empty() ? "" : ", ") + n;
      return out;
    };
    std::set<std::string> lacks, extra;
    for (const auto& n : a) if (!b.count(n)) lacks.insert(n);
    for (const auto& n : b) if (!a.count(n)) extra.insert(n);
    const std::string who = "rank " + std::to_string(r) + "'s optimizer";
    std::string what;
    if (first.is_null() != theirs.is_null()) {
      what = first.is_null() ? who + " was given and rank 0's was not" : who + " was not given and rank 0's was";
    } else if (!lacks.empty() || !extra.empty()) {
      if (!lacks.empty()) what = who + " lacks " + list(lacks) + ", which rank 0's steps";
      if (!extra.empty()) what += (what.empty() ? who : std::string(", and")) + " steps " + list(extra) + ", which rank 0's lacks";
    } else {
      what = who + " groups the parameters otherwise than rank 0's";
    }
    throw std::invalid_argument("fsdp: saving a checkpoint: the optimizers differ across ranks: " + what +
                                ". Every rank must build its optimizer from the same parameters in the same groups "
                                "(the wrapper's parameters(), in any order); nothing was saved");
  }
}

// Which checkpoint `path` means (itself when it holds a manifest, else the newest good one under
// it), decided by rank 0 alone and sent to every rank: ranks that looked on their own could see
// different folders (a commit landing between their listings, a network file system's cache).
std::optional<std::string> decided_by_rank0(const GroupPtr& group, const std::string& path) {
  std::string mine;
  if (group->getRank() == 0) {
    if (path_exists(path + "/manifest.json") || is_dcp_folder(path)) {
      mine = "=" + path;
    } else if (auto found = latest_checkpoint(path)) {
      mine = "=" + *found;
    }
  }
  const std::string decided = all_gather_strings(group, mine).at(0);
  if (decided.empty()) return std::nullopt;
  return decided.substr(1);
}

}  // namespace fsdp
