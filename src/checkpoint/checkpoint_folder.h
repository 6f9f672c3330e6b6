// The folder a run saves its checkpoints into (step-00000010/, step-00000020/, ...), and its life
// over a month of training (docs/checkpoints.md, "The checkpoint folder"):
//   - which of its checkpoints are complete, and which is the newest good one (a damaged newest
//     one is skipped, loudly, for the one before it);
//   - one job at a time: a lock on the folder that names its holder and that the kernel releases
//     when the holder dies, so a crashed job never leaves it stuck;
//   - a new copy of a step replaces the old one without a moment where neither is there;
//   - a run resumed from an older step owns the future: the newer checkpoints of the run it
//     abandoned are moved aside under a name that says so, never deleted, never resumed from.
// Rank 0 does all of this; checkpoint.cpp makes the other ranks agree with it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

struct StepFolder {
  int64_t step = 0;
  std::string path;
};

std::string step_name(int64_t step);  // "step-00000010"

// Complete checkpoints under `dir` (step-N/ with a manifest.json), oldest first.
std::vector<StepFolder> complete_checkpoints(const std::string& dir);

// Why `path` cannot be loaded as it is (its manifest fails its checksum or schema, a file it lists
// is missing or of another size), or "" when it looks whole. Cheap: no data is read.
std::string checkpoint_damage(const std::string& path);

// The newest complete checkpoint under `dir` without damage; the damaged newer ones are appended
// to `skipped` as "path: why".
std::optional<std::string> newest_good_checkpoint(const std::string& dir, std::vector<std::string>* skipped);

// Moves `abandoned` (checkpoints of `dir`) into a new folder dir/abandoned-<UTC time>/ and returns
// its path.
std::string set_aside(const std::string& dir, const std::vector<StepFolder>& abandoned);

// Makes the complete folder `tmp` visible as `final_path`. When `final_path` exists, the two are
// exchanged atomically (renameat2 RENAME_EXCHANGE) and the old copy, now at `tmp`, is removed;
// where the file system cannot exchange, the old copy goes to .old-step-N first and sweep()
// restores it if a crash comes before the new one is in place.
void commit_folder(const std::string& tmp, const std::string& final_path);

// Before a save: removes what killed saves left (.tmp-*) and restores a .old-step-N whose step-N is
// missing; a .old-step-N whose step-N is there is removed.
void sweep(const std::string& dir);

// An exclusive lock on `dir` (its file .lock), held from construction to destruction. Throws,
// naming the holder (host, process, start time, command line), when another process holds it.
class FolderLock {
 public:
  explicit FolderLock(const std::string& dir);
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace fsdp
