// Checkpoints a team can bet a month of training on (issue 25; docs/checkpoints.md): a resumed run
// that owns its future, one job per folder, ranks that load the one checkpoint rank 0 chose,
// manifests checked field by field, loads that change nothing unless they change everything, a
// full disk reported at once by every rank, re-saves without a crash window, and files read as
// strictly as Python reads them. Then the checkpoint fuzzer. Each test is a user's program:
// fsdp-train, or the library's calls in fsdp-test-worker (tests/worker/checkpoint_hostile.cpp).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <fstream>
#include <sstream>
#include <thread>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;

using fsdp_test::fresh_dir;
using fsdp_test::read_file;
using fsdp_test::step_dir;

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

fsdp_test::Run train(const std::string& args, const std::string& env = "", int timeout = 300) {
  return fsdp_test::sh(env + " " + fsdp_test::fsdp_train() + " --log-every 1000 --model tiny " + args, timeout);
}

// CRC-32C, bit by bit: the manifest's checksum, recomputed by a test that edits a manifest the way
// a person (or an adversary) would, so that the schema, not the checksum, must catch the edit.
uint32_t crc32c(const std::string& s) {
  uint32_t crc = ~0u;
  for (unsigned char c : s) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc & 1) ? 0x82F63B78u ^ (crc >> 1) : crc >> 1;
  }
  return ~crc;
}

void write_manifest(const std::string& folder, json m, bool recompute = true) {
  m.erase("manifest_crc32c");
  if (recompute) m["manifest_crc32c"] = crc32c(m.dump());
  write_file(folder + "/manifest.json", m.dump(1) + "\n");
}

json manifest(const std::string& folder) { return json::parse(read_file(folder + "/manifest.json")); }

// The library's calls on 2 ranks: fsdp-test-worker checkpoint_hostile.
std::vector<json> hostile(const std::string& variant, const std::string& path, const std::string& extra = "") {
  return fsdp_test::expect_ranks("checkpoint_hostile", 2, "--variants " + variant + " --path " + path + " " + extra);
}

// A saved set of checkpoints for the tests that damage copies: sharded/step-2 and 3, full/ and
// local/ step 2 (worker "save").
std::string saved_checkpoints(const std::string& name) {
  const std::string dir = fresh_dir(name);
  hostile("save", dir);
  return dir;
}

// A load that must fail on every rank with `expect` in its error, and change nothing.
void expect_refused_unchanged(const std::string& path, const std::string& expect, const std::string& what) {
  const auto ranks = hostile("load", path);
  ASSERT_EQ(ranks.size(), 2u) << what;
  for (const auto& r : ranks) {
    const std::string err = r["error"];
    EXPECT_NE(err.find(expect), std::string::npos) << what << ": rank " << r["rank"] << " said: " << err;
    EXPECT_EQ(r["before"], r["after"]) << what << ": rank " << r["rank"] << "'s model or optimizer changed in a failed load";
  }
}

// ---------------------------------------------------------------------------------------------
// 1. A run resumed from an older step owns its future.

TEST(CheckpointFolder, ResumedRunMovesTheAbandonedFutureAside) {
  const std::string dir = fresh_dir("rollback"), c = dir + "/c";
  ASSERT_EQ(train("--nproc-per-node 2 --steps 8 --save-every 2 --save-dir " + c).exit_code, 0);
  // Back to step 4, keeping the newest 2: the run saves 6, 8, 10.
  const auto r = train("--nproc-per-node 2 --steps 10 --save-every 2 --keep-last 2 --save-dir " + c + " --resume " +
                       step_dir(c, 4));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("abandoned run's step-00000006, step-00000008 moved to " + c + "/abandoned-"), std::string::npos)
      << r.output;
  const auto listing = fsdp_test::sh("cd " + c + " && ls -d step-* abandoned-*/step-*");
  const std::string aside = listing.output.substr(listing.output.find("abandoned-"));
  EXPECT_EQ(listing.output.substr(0, listing.output.find("abandoned-")), "") << listing.output;
  const auto steps = fsdp_test::sh("cd " + c + " && ls -d step-*");
  EXPECT_EQ(steps.output, "step-00000008\nstep-00000010\n") << "keep-last must keep the resumed run's own newest";
  EXPECT_NE(aside.find("/step-00000006\n"), std::string::npos) << listing.output;
  EXPECT_NE(aside.find("/step-00000008\n"), std::string::npos) << listing.output;
  // --resume of the folder continues the new run, not the abandoned one.
  const auto again = train("--nproc-per-node 2 --steps 12 --resume " + c);
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("resumed from " + step_dir(c, 10)), std::string::npos) << again.output;
  fsdp_test::sh("rm -rf " + dir);
}

// 2. One job per folder; a crashed holder leaves nothing stuck.
TEST(CheckpointFolder, SecondJobIsRefusedAndACrashedHolderIsNot) {
  const std::string dir = fresh_dir("lock"), c = dir + "/c";
  // Job A trains long in its own session, saving into c. Whatever happens below, the session goes
  // at the end of the test (a failed assertion must not leave A training on the machine).
  fsdp_test::sh("setsid " + fsdp_test::fsdp_train() + " --log-every 1000 --model tiny --nproc-per-node 2 --steps 1000000 "
                "--save-every 1000000 --save-dir " + c + " > " + dir + "/a.log 2>&1 < /dev/null & echo $! > " + dir + "/a.pid");
  std::string session = read_file(dir + "/a.pid");  // setsid: the launcher leads its session
  session = session.substr(0, session.find('\n'));
  ASSERT_FALSE(session.empty());
  struct EndSession {
    std::string sid;
    ~EndSession() { fsdp_test::sh("pkill -9 -s " + sid + "; exit 0"); }
  } end_a{session};
  std::string holder;
  for (int i = 0; i < 600 && holder.find("pid ") != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    holder = read_file(c + "/.lock");
  }
  ASSERT_EQ(holder.find("pid "), 0u) << "job A never locked its folder:\n" << read_file(dir + "/a.log");
  const std::string pid = holder.substr(4, holder.find(' ', 4) - 4);
  // Job B, same folder: refused at start, naming A.
  const auto b = train("--nproc-per-node 2 --steps 2 --save-dir " + c);
  EXPECT_NE(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("is in use by another job (pid " + pid + " on "), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("fsdp-train"), std::string::npos) << "the holder's command line: " << b.output;
  EXPECT_LT(b.seconds, 60);
  // A crashes (SIGKILL: no destructor runs); its launcher ends the other rank.
  fsdp_test::sh("kill -9 " + pid);
  const auto ended = fsdp_test::sh("for i in $(seq 100); do pgrep -s " + session + " > /dev/null || exit 0; sleep 0.2; "
                                   "done; exit 1");
  EXPECT_EQ(ended.exit_code, 0) << "job A's other ranks outlived its rank 0";
  const auto after = train("--nproc-per-node 2 --steps 2 --save-dir " + c);
  EXPECT_EQ(after.exit_code, 0) << after.output;
  EXPECT_TRUE(fsdp_test::sh("test -f " + step_dir(c, 2) + "/manifest.json").exit_code == 0);
  fsdp_test::sh("rm -rf " + dir);
}

// 3. Rank 0 decides which checkpoint; ranks that read different ones refuse together.
TEST(CheckpointFolder, RanksLoadTheCheckpointRankZeroChose) {
  const std::string dir = saved_checkpoints("agree");
  const auto ranks = hostile("agree", dir);
  ASSERT_EQ(ranks.size(), 2u);
  for (const auto& r : ranks) {
    EXPECT_EQ(r["found"], step_dir(dir + "/sharded", 3)) << "rank " << r["rank"] << " must get rank 0's choice";
    EXPECT_NE(r["error"].get<std::string>().find("ranks read different manifests"), std::string::npos) << r["error"];
    EXPECT_EQ(r["before"], r["after"]) << "rank " << r["rank"];
  }
  fsdp_test::sh("rm -rf " + dir);
}

// 4. A manifest is checked against its checksum and a schema; the field is named.
TEST(CheckpointManifest, FieldsAreCheckedAndNamed) {
  const std::string dir = saved_checkpoints("schema");
  const std::string good = step_dir(dir + "/sharded", 2), copy = dir + "/edited";
  struct Edit {
    std::string name, expect;
    std::function<void(json&)> edit;
    bool recompute = true;
  };
  const std::vector<Edit> edits = {
      {"missing", "field `world_size` is missing", [](json& m) { m.erase("world_size"); }},
      {"fractional", "field `world_size` must be an integer, not a fractional number 2.9", [](json& m) { m["world_size"] = 2.9; }},
      {"huge", "field `step` is 18446744073709551615, above its limit", [](json& m) { m["step"] = UINT64_MAX; }},
      {"negative", "field `optimizer.steps[", [](json& m) { m["optimizer"]["steps"].begin().value() = -1; }},
      {"escape", "must stay inside the checkpoint folder", [](json& m) {
         const std::string f = m["files"].begin().key();
         m["files"]["model/../../" + f] = m["files"][f];
         m["files"].erase(f);
         for (auto& [n, list] : m["pieces"].items()) {
           for (auto& p : list) {
             if (p["file"] == f) p["file"] = "model/../../" + f;
           }
         }
       }},
      {"absolute", "must be a path relative to the checkpoint folder", [](json& m) {
         const std::string f = m["files"].begin().key();
         m["files"]["/etc/" + f] = m["files"][f];
       }},
      {"unlisted", "which `files` does not list", [](json& m) { m["files"].erase(m["files"].begin().key()); }},
      {"out_of_range", ".flat[1]` is", [](json& m) { m["pieces"].begin().value()[0]["flat"][1] = 1 << 30; }},
      {"wrong_type", "field `model.params` must be a JSON object, not array", [](json& m) { m["model"]["params"] = json::array(); }},
      {"corrupt", "is corrupt: its manifest_crc32c", [](json& m) { m["step"] = 7; }, false},
  };
  for (const auto& e : edits) {
    fsdp_test::sh("rm -rf " + copy + " && cp -r " + good + " " + copy);
    json m = manifest(copy);
    e.edit(m);
    write_manifest(copy, m, e.recompute);
    expect_refused_unchanged(copy, e.expect, e.name);
  }
  fsdp_test::sh("rm -rf " + dir);
}

// 5. A load checks everything on every rank, agrees, then applies: a generator state that only
//    rank 1 cannot take changes nothing anywhere.
// fsdp-train's learning-rate schedule in a hand-edited manifest (checksum recomputed) is checked
// as the flags are (the outside review of issue 39: a negative or unknown schedule trained on);
// a missing --resume folder is named as missing; and a longer run of a constant rate, whose
// schedule differs only by the saved horizon, gets no note that the schedule changed.
TEST(CheckpointManifest, FsdpTrainsScheduleIsCheckedAsItsFlagsAre) {
  const std::string dir = fresh_dir("schedule-edit");
  const auto saved = train("--nproc-per-node 2 --steps 4 --save-dir " + dir + "/c");
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  const std::string step = step_dir(dir + "/c", 4);
  const json good = manifest(step);
  const auto longer = train("--nproc-per-node 2 --steps 6 --resume " + step);
  EXPECT_EQ(longer.exit_code, 0) << longer.output;
  EXPECT_EQ(longer.output.find("learning-rate schedule continues"), std::string::npos) << longer.output;
  for (const auto& [field, value] : std::vector<std::pair<std::string, json>>{
           {"peak", -1.0}, {"kind", "bogus"}, {"warmup_steps", 10}, {"min_lr", 0.5}}) {
    json m = good;
    m["training"]["lr_schedule"][field] = value;
    if (field == "warmup_steps") m["training"]["lr_schedule"]["kind"] = "cosine";
    write_manifest(step, m);
    const auto r = train("--nproc-per-node 2 --steps 6 --resume " + step);
    EXPECT_NE(r.exit_code, 0) << field << "\n" << r.output;
    EXPECT_NE(r.output.find("its learning-rate schedule (training.lr_schedule in manifest.json) cannot run"),
              std::string::npos) << field << "\n" << r.output;
  }
  write_manifest(step, good);
  const auto missing = train("--nproc-per-node 2 --steps 6 --resume " + dir + "/no-such-folder");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("no-such-folder: no such file or folder"), std::string::npos) << missing.output;
  fsdp_test::sh("rm -rf " + dir);
}

TEST(CheckpointLoad, OneRanksBadGeneratorStateChangesNothingAnywhere) {
  const std::string dir = saved_checkpoints("rng");
  const std::string copy = dir + "/bad-rng";
  fsdp_test::sh("cp -r " + step_dir(dir + "/sharded", 2) + " " + copy);
  json m = manifest(copy);
  m["rng"]["1"]["cpu"] = "00ff";  // valid hexadecimal, not a generator state
  write_manifest(copy, m);
  expect_refused_unchanged(copy, "random number generator state", "rank 1's generator");
  fsdp_test::sh("rm -rf " + dir);
}

// 6. A FULL save that rank 0 cannot write (a file size limit: a real write failure, EFBIG) fails
//    every rank within seconds, naming it, and the previous checkpoint stays.
TEST(CheckpointSave, FullSaveThatCannotBeWrittenFailsEveryRankAtOnce) {
  const std::string dir = fresh_dir("efbig"), c = dir + "/c";
  ASSERT_EQ(train("--nproc-per-node 2 --steps 2 --checkpoint-kind full --save-dir " + c).exit_code, 0);
  const auto size = fsdp_test::sh("stat -c %s " + step_dir(c, 2) + "/model/model.safetensors");
  const long limit_kib = std::stol(size.output) / 1024 / 2;  // half the model file
  // Ignored SIGXFSZ is inherited: the write returns EFBIG instead of killing the rank.
  const auto r = train("--nproc-per-node 2 --steps 4 --save-every 2 --checkpoint-kind full --save-dir " + c +
                           " --resume " + c,
                       "trap \"\" XFSZ; ulimit -f " + std::to_string(limit_kib) + ";", 120);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 60) << "the ranks must not wait for the collective timeout:\n" << r.output;
  size_t reports = 0;
  for (size_t at = 0; (at = r.output.find("File too large", at)) != std::string::npos; ++at) ++reports;
  EXPECT_GE(reports, 2u) << "every rank must say what went wrong:\n" << r.output;
  EXPECT_NE(r.output.find("rank 0 could not write its part"), std::string::npos) << r.output;
  const auto listing = fsdp_test::sh("ls -a " + c);
  EXPECT_NE(listing.output.find("step-00000002"), std::string::npos) << listing.output;
  EXPECT_EQ(listing.output.find("step-00000004"), std::string::npos) << listing.output;
  EXPECT_EQ(listing.output.find(".tmp-"), std::string::npos) << "a failed save gives its space back: " << listing.output;
  const auto resumed = train("--nproc-per-node 2 --steps 3 --resume " + c);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + step_dir(c, 2)), std::string::npos) << resumed.output;
  fsdp_test::sh("rm -rf " + dir);
}

// 7. Saving a step again: killed at the worst moment, one whole copy of the step is there.
TEST(CheckpointSave, ResaveKilledInItsCommitLeavesAWholeCopy) {
  struct Case {
    std::string name, env;
    int copy;  // which save's copy must be there after the kill
  };
  for (const Case& k : {Case{"exchange", "FSDP_TEST_KILL_IN_COMMIT=exchanged:1", 2},
                        Case{"no_exchange", "FSDP_TEST_NO_RENAME_EXCHANGE=1 FSDP_TEST_KILL_IN_COMMIT=old-aside:1", 1}}) {
    const std::string dir = fresh_dir("resave-" + k.name);
    const auto r = fsdp_test::sh(k.env + " " + fsdp_test::worker() + " checkpoint_hostile --nproc-per-node 2 --variants resave "
                                 "--path " + dir + "/c --out " + dir + "/out");
    EXPECT_NE(r.exit_code, 0) << k.name << ": the kill hook must end the job\n" << r.output;
    EXPECT_NE(r.output.find("killed in the commit"), std::string::npos) << r.output;
    // The folder still names a whole step 3 (the new copy after the exchange; the old one when the
    // kill came between the two renames), and it loads.
    const auto ranks = hostile("load", dir + "/c");
    ASSERT_EQ(ranks.size(), 2u) << k.name;
    EXPECT_EQ(ranks[0]["error"], "") << k.name;
    EXPECT_EQ(ranks[0]["training"]["copy"], k.copy) << k.name;
    // The next checkpointer on the folder tidies it (nothing half-done left beside step 3); its
    // own step 3 moves the one it found aside, as any run's save of a step it did not write.
    const auto again = hostile("resave", dir + "/c");
    ASSERT_EQ(again.size(), 2u);
    EXPECT_EQ(again[0]["latest"], step_dir(dir + "/c", 3));
    const std::string listing = fsdp_test::sh("ls -A " + dir + "/c").output;
    EXPECT_EQ(listing.find(".tmp-"), std::string::npos) << k.name << ": " << listing;
    EXPECT_EQ(listing.find(".old-"), std::string::npos) << k.name << ": " << listing;
    EXPECT_NE(listing.find("\nstep-00000003\n"), std::string::npos) << k.name << ": " << listing;
    fsdp_test::sh("rm -rf " + dir);
  }
}

// 9. Files are read as strictly as Python reads them.
struct Safetensors {
  json header;
  std::string data;
  static Safetensors read(const std::string& path) {
    const std::string bytes = read_file(path);
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    return {json::parse(bytes.substr(8, n)), bytes.substr(8 + n)};
  }
  void write(const std::string& path, size_t header_bytes = 0) const {
    std::string text = header.dump();
    if (header_bytes > text.size()) text.append(header_bytes - text.size(), ' ');
    const uint64_t n = text.size();
    std::string out(reinterpret_cast<const char*>(&n), 8);
    write_file(path, out + text + data);
  }
  // The first tensor's name.
  std::string first() const {
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() != "__metadata__") return it.key();
    }
    return "";
  }
};

TEST(CheckpointFiles, SafetensorsReadAsStrictlyAsPython) {
  const std::string dir = fresh_dir("strict"), model = dir + "/model.safetensors";
  ASSERT_EQ(train("--nproc-per-node 2 --steps 1 --export-full " + model).exit_code, 0);
  const Safetensors good = Safetensors::read(model);
  // A header of 0x4B50 bytes: the file starts with "PK" and is not a zip archive.
  good.write(dir + "/pk.safetensors", 0x4B50);
  ASSERT_EQ(read_file(dir + "/pk.safetensors").substr(0, 2), "PK");
  const auto pk = train("--nproc-per-node 2 --steps 1 --load-weights " + dir + "/pk.safetensors");
  EXPECT_EQ(pk.exit_code, 0) << "a safetensors file that starts with PK is still safetensors:\n" << pk.output;

  struct Bad {
    std::string name, expect;
    std::function<void(Safetensors&)> edit;
  };
  const std::vector<Bad> bads = {
      {"negative", "a dimension -4", [](Safetensors& s) { s.header[s.first()]["shape"][0] = -4; }},
      {"overflow", "more than 2^62 elements",
       [](Safetensors& s) { s.header[s.first()]["shape"] = {int64_t{1} << 40, int64_t{1} << 40}; }},
      {"overlap", "overlapping", [](Safetensors& s) {
         // Two tensors' spans moved onto each other: the second starts inside the first.
         std::vector<std::string> names;
         for (auto it = s.header.begin(); it != s.header.end(); ++it) {
           if (it.key() != "__metadata__") names.push_back(it.key());
         }
         json& a = s.header[names[0]];
         json& b = s.header[names[1]];
         const int64_t a0 = a["data_offsets"][0], b0 = b["data_offsets"][0], b1 = b["data_offsets"][1];
         if (a0 < b0) {
           b["data_offsets"] = {b0 - 4, b1 - 4};
         } else {
           a["data_offsets"] = {a0 - 4, a0 - 4 + (a["data_offsets"][1].get<int64_t>() - a0)};
         }
       }},
      {"trailing", "bytes follow the last tensor's data", [](Safetensors& s) { s.data += "appended"; }},
  };
  for (const auto& b : bads) {
    Safetensors s = good;
    b.edit(s);
    const std::string path = dir + "/" + b.name + ".safetensors";
    s.write(path);
    const auto r = train("--nproc-per-node 2 --steps 1 --load-weights " + path);
    EXPECT_NE(r.exit_code, 0) << b.name;
    EXPECT_NE(r.output.find(b.expect), std::string::npos) << b.name << ":\n" << r.output;
    EXPECT_NE(r.output.find(path), std::string::npos) << b.name << " must name the file:\n" << r.output;
  }
  fsdp_test::sh("rm -rf " + dir);
}

// 9. latest() skips a damaged newest checkpoint, loudly, for the newest good one.
TEST(CheckpointFolder, DamagedNewestCheckpointIsSkippedLoudly) {
  const std::string dir = fresh_dir("latest"), c = dir + "/c";
  ASSERT_EQ(train("--nproc-per-node 2 --steps 4 --save-every 2 --save-dir " + c).exit_code, 0);
  fsdp_test::sh("truncate -s -10 " + step_dir(c, 4) + "/model/rank-00001-of-00002.safetensors");
  const auto r = train("--nproc-per-node 2 --steps 5 --resume " + c);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("WARNING: skipping damaged checkpoint " + step_dir(c, 4)), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("resumed from " + step_dir(c, 2)), std::string::npos) << r.output;
  fsdp_test::sh("rm -rf " + dir);
}

// The checkpoint fuzzer, fixed mutations: every one ends in an exact load or a named error on
// every rank, within seconds; a failed load changes nothing (the model, optimizer and generator
// hashed before and after). `ctest -L long` runs more (scripts/checkpoint_fuzz).
TEST(CheckpointFuzz, EveryMutationLoadsExactlyOrIsRefusedByName) {
  const std::string dir = saved_checkpoints("fuzz");
  const auto ranks = hostile("fuzz", dir, "--seeds 0:300");
  ASSERT_EQ(ranks.size(), 2u);
  for (const auto& r : ranks) {
    EXPECT_TRUE(r["bad"].empty()) << "rank " << r["rank"] << ":\n" << r["bad"].dump(1);
    EXPECT_EQ(r["outcomes"].size(), 300u);
  }
  // Every rank ended each load the same way: all loaded, or all refused (an edited manifest with its
  // checksum recomputed may change one rank's pieces only: "exact load" on one, "loaded an edited
  // manifest" on the other).
  for (size_t i = 0; i < ranks[0]["outcomes"].size(); ++i) {
    const std::string a = ranks[0]["outcomes"][i]["outcome"], b = ranks[1]["outcomes"][i]["outcome"];
    EXPECT_EQ(a.rfind("refused", 0) == 0, b.rfind("refused", 0) == 0) << ranks[0]["outcomes"][i].dump() << " / " << b;
  }
  std::cout << "checkpoint fuzzer outcomes (rank 0): " << ranks[0]["counts"].dump(1) << "\n";
  fsdp_test::sh("rm -rf " + dir);
}

}  // namespace
