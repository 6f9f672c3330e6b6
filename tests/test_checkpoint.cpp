// Checkpoints as a user runs them (issue 11, docs/checkpoints.md): fsdp-train saves, stops and
// resumes in new processes; checkpoints are resharded onto other world sizes and strategies,
// damaged on purpose, written while a rank is killed, and read and written by Python.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;

const std::string kTrain = "--log-every 1000 ";

using fsdp_test::fresh_dir;
using fsdp_test::read_file;
using fsdp_test::step_dir;

struct TrainRun {
  fsdp_test::Run run;
  std::vector<json> rows;
  // (step, rank) -> loss
  std::map<std::pair<int, int>, double> losses() const {
    std::map<std::pair<int, int>, double> out;
    for (const auto& r : rows) {
      if (!r.contains("event")) out[{r["step"].get<int>(), r["rank"].get<int>()}] = r["loss"].get<double>();
    }
    return out;
  }
};

TrainRun train(const std::string& dir, const std::string& name, const std::string& args, const std::string& env = "") {
  const std::string metrics = dir + "/" + name + ".jsonl";
  TrainRun t;
  const std::string model = args.find("--model ") == std::string::npos ? "--model tiny " : "";
  t.run = fsdp_test::sh(env + " " + fsdp_test::fsdp_train() + " " + kTrain + model + "--metrics-jsonl " + metrics +
                        " " + args, 300);
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) t.rows.push_back(json::parse(line));
  return t;
}

// Every safetensors file of two checkpoints, byte for byte (the manifests hold the same state too,
// but also the RNG and file lists, compared by the files themselves).
void expect_same_tensors(const std::string& a, const std::string& b) {
  const auto files = fsdp_test::sh("cd " + a + " && find . -name \"*.safetensors\" | sort");
  ASSERT_EQ(files.exit_code, 0);
  std::istringstream list(files.output);
  std::string f;
  int n = 0;
  while (std::getline(list, f)) {
    ++n;
    const std::string x = read_file(a + "/" + f), y = read_file(b + "/" + f);
    EXPECT_FALSE(x.empty()) << a << "/" << f;
    EXPECT_TRUE(x == y) << f << " differs between " << a << " and " << b;
  }
  EXPECT_GT(n, 0) << "no tensor files in " << a;
  const json ma = json::parse(read_file(a + "/manifest.json")), mb = json::parse(read_file(b + "/manifest.json"));
  EXPECT_EQ(ma["optimizer"], mb["optimizer"]);
  EXPECT_EQ(ma["scaler"], mb["scaler"]);
}

struct ResumeCase {
  std::string name, flags;
};
void PrintTo(const ResumeCase& c, std::ostream* os) { *os << c.name; }

class ResumeIsBitExact : public testing::TestWithParam<ResumeCase> {};

// Train 20 steps, saving at step 10; separately resume the step-10 checkpoint in a new process and
// train to step 20: the losses of steps 10-19 and the final parameters and optimizer state are
// bitwise those of the uninterrupted run.
TEST_P(ResumeIsBitExact, LossesParametersAndOptimizerState) {
  const ResumeCase& c = GetParam();
  const std::string dir = fresh_dir("resume-" + c.name);
  const auto whole = train(dir, "whole", c.flags + " --steps 20 --save-every 10 --save-dir " + dir + "/whole");
  ASSERT_EQ(whole.run.exit_code, 0) << whole.run.output;
  const auto resumed = train(dir, "resumed", c.flags + " --steps 20 --save-dir " + dir + "/resumed --resume " +
                                                 step_dir(dir + "/whole", 10));
  ASSERT_EQ(resumed.run.exit_code, 0) << resumed.run.output;
  EXPECT_NE(resumed.run.output.find("resumed from"), std::string::npos) << resumed.run.output;
  const auto a = whole.losses(), b = resumed.losses();
  ASSERT_FALSE(b.empty());
  EXPECT_EQ(b.begin()->first.first, 10) << "the resumed run must start at step 10";
  for (const auto& [key, loss] : b) {
    ASSERT_TRUE(a.count(key));
    EXPECT_EQ(loss, a.at(key)) << "step " << key.first << " rank " << key.second;
  }
  expect_same_tensors(step_dir(dir + "/whole", 20), step_dir(dir + "/resumed", 20));
  // With --state-hash, each rank's hash of everything it holds and steps (shards, rows outside
  // fsdp, their optimizer state) at the end.
  const auto ha = fsdp_test::hashes(whole.rows), hb = fsdp_test::hashes(resumed.rows);
  EXPECT_EQ(ha.size(), hb.size());
  for (const auto& [rank, h] : ha) {
    ASSERT_TRUE(hb.count(rank)) << "rank " << rank;
    EXPECT_EQ(h["hash"], hb.at(rank)["hash"]) << "rank " << rank;
  }
  if (c.flags.find("--state-hash") != std::string::npos) EXPECT_FALSE(ha.empty()) << whole.run.output;
  fsdp_test::sh("rm -rf " + dir);
}

std::vector<ResumeCase> resume_cases() {
  std::vector<ResumeCase> out;
  for (const std::string s : {"full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"}) {
    const bool hybrid = s.rfind("hybrid", 0) == 0;
    const std::string launch = hybrid ? "--nproc-per-node 4 --shard-size 2" : "--nproc-per-node 2";
    for (const std::string mp : {"none", "bf16", "fp16"}) {
      out.push_back({s + "_" + mp, launch + " --strategy " + s + " --mixed-precision " + mp});
    }
  }
  out.push_back({"full_shard_local_kind", "--nproc-per-node 2 --checkpoint-kind local"});
  out.push_back({"full_shard_full_kind", "--nproc-per-node 2 --checkpoint-kind full"});
  out.push_back({"full_shard_async", "--nproc-per-node 2 --async-save"});
  // Dropout draws from each rank's generator: bit-exact only if the checkpoint restores them (with
  // dropout off nothing draws, and a restore that did nothing would pass every other case).
  out.push_back({"full_shard_dropout", "--nproc-per-node 2 --dropout 0.2"});
  out.push_back({"hybrid_shard_dropout_checkpointed", "--nproc-per-node 4 --shard-size 2 --strategy hybrid_shard "
                                                      "--dropout 0.2 --activation-checkpointing"});
  // The DHEN-like model: its embedding rows are outside fsdp, each rank its own
  // (Options::row_sharded_parameters), and are saved with the rest, their AdamW state too. Under
  // hybrid_shard every rank writes its rows (its replica's shards are written by the first one).
  for (const std::string kind : {"sharded", "full", "local"}) {
    out.push_back({"dhen_" + kind + "_kind", "--model dhen-tiny --nproc-per-node 2 --state-hash --checkpoint-kind " + kind});
  }
  out.push_back({"dhen_async", "--model dhen-tiny --nproc-per-node 2 --state-hash --async-save"});
  out.push_back({"dhen_hybrid_shard", "--model dhen-tiny --nproc-per-node 4 --shard-size 2 --strategy hybrid_shard "
                                      "--state-hash"});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Strategies, ResumeIsBitExact, testing::ValuesIn(resume_cases()),
                         [](const testing::TestParamInfo<ResumeCase>& i) { return i.param.name; });

// Issue 39: the learning-rate schedule (--lr-schedule, --warmup-steps, --min-lr) is saved with the
// checkpoint and continued by a resumed run, even one started without the flags: its rates and
// losses are those of the uninterrupted run, bit for bit, and it says whose schedule it follows.
TEST(Checkpoint, ALearningRateScheduleContinuesFromTheCheckpoint) {
  const std::string dir = fresh_dir("lr-schedule");
  const std::string schedule = " --lr 0.004 --lr-schedule cosine --warmup-steps 4 --min-lr 0.0004";
  const auto whole = train(dir, "whole", "--nproc-per-node 2 --steps 20 --save-every 10 --save-dir " + dir + "/whole" + schedule);
  ASSERT_EQ(whole.run.exit_code, 0) << whole.run.output;
  std::map<int, double> lr;
  for (const auto& r : whole.rows) {
    if (!r.contains("event") && r["rank"] == 0) lr[r["step"].get<int>()] = r["lr"].get<double>();
  }
  ASSERT_EQ(lr.size(), 20u);
  EXPECT_DOUBLE_EQ(lr[0], 0.001);  // warmup: 0.004 x 1/4, ...
  EXPECT_DOUBLE_EQ(lr[3], 0.004);  // ... the peak at the warmup's last step
  for (int s = 4; s < 19; ++s) EXPECT_GT(lr[s], lr[s + 1]) << "the cosine decays at step " << s;
  EXPECT_DOUBLE_EQ(lr[19], 0.0004);  // the floor at the last step
  // Resumed with --lr 0.004 alone: the checkpoint's schedule goes on.
  const auto resumed = train(dir, "resumed", "--nproc-per-node 2 --steps 20 --lr 0.004 --resume " + step_dir(dir + "/whole", 10));
  ASSERT_EQ(resumed.run.exit_code, 0) << resumed.run.output;
  EXPECT_NE(resumed.run.output.find("the checkpoint's learning-rate schedule continues (cosine from 0.004 to 0.0004 over 20 "
                                    "steps, 4 of warmup)"),
            std::string::npos)
      << resumed.run.output;
  const auto a = whole.losses(), b = resumed.losses();
  ASSERT_EQ(b.size(), 20u);  // steps 10 to 19 on 2 ranks
  for (const auto& [key, loss] : b) EXPECT_EQ(loss, a.at(key)) << "step " << key.first << " rank " << key.second;
  for (const auto& r : resumed.rows) {
    if (!r.contains("event") && r["rank"] == 0) EXPECT_EQ(r["lr"].get<double>(), lr[r["step"].get<int>()]);
  }
  // Resumed for longer than the schedule spans (the outside review: silently at a floor of 0
  // before): said, and the extra steps run at the floor.
  const auto longer = train(dir, "longer", "--nproc-per-node 2 --steps 24 --resume " + step_dir(dir + "/whole", 10));
  ASSERT_EQ(longer.run.exit_code, 0) << longer.run.output;
  EXPECT_NE(longer.run.output.find("steps 20 to 23 run at the schedule's floor, 0.0004 (its decay ended at step 19)"),
            std::string::npos) << longer.run.output;
  for (const auto& r : longer.rows) {
    if (!r.contains("event") && r["step"].get<int>() >= 19) EXPECT_EQ(r["lr"].get<double>(), 0.0004) << r.dump();
  }
  // A schedule with no step left to decay over, or a warmup longer than the run, is refused.
  const auto no_decay = train(dir, "no-decay", "--nproc-per-node 2 --steps 5 --warmup-steps 4 --lr-schedule cosine");
  EXPECT_NE(no_decay.run.exit_code, 0);
  EXPECT_NE(no_decay.run.output.find("give --steps 6 or more, or fewer --warmup-steps"), std::string::npos) << no_decay.run.output;
  const auto long_warmup = train(dir, "long-warmup", "--nproc-per-node 2 --steps 5 --warmup-steps 9");
  EXPECT_NE(long_warmup.run.output.find("--warmup-steps 9 is more than --steps 5"), std::string::npos) << long_warmup.run.output;
  fsdp_test::sh("rm -rf " + dir);
}

// Saved at W = 4 full_shard, resumed at W = 1, 2, 3 and hybrid F = 2: the losses follow the
// uninterrupted W = 4 run within 1e-5 (only the order of summation differs).
TEST(Checkpoint, ReshardsOntoOtherWorldSizesAndStrategies) {
  for (const std::string kind : {"sharded", "full"}) {
    const std::string dir = fresh_dir("reshard-" + kind);
    const std::string common = "--global-batch-size 12 --steps 20 --checkpoint-kind " + kind;
    const auto whole = train(dir, "w4", common + " --nproc-per-node 4 --save-every 10 --save-dir " + dir + "/w4");
    ASSERT_EQ(whole.run.exit_code, 0) << whole.run.output;
    const auto a = whole.losses();
    for (const std::string target : {"--nproc-per-node 2", "--nproc-per-node 1", "--nproc-per-node 3",
                                     "--nproc-per-node 4 --strategy hybrid_shard --shard-size 2",
                                     "--nproc-per-node 2 --strategy no_shard"}) {
      const auto r = train(dir, "target", common + " " + target + " --resume " + step_dir(dir + "/w4", 10));
      ASSERT_EQ(r.run.exit_code, 0) << kind << " " << target << "\n" << r.run.output;
      int compared = 0;
      for (const auto& [key, loss] : r.losses()) {
        if (key.second != 0) continue;
        ASSERT_GE(key.first, 10);
        EXPECT_NEAR(loss, a.at({key.first, 0}), 1e-5) << kind << " " << target << " step " << key.first;
        ++compared;
      }
      EXPECT_EQ(compared, 10) << kind << " " << target;
      std::remove((dir + "/target.jsonl").c_str());
    }
    fsdp_test::sh("rm -rf " + dir);
  }
}

// The DHEN-like model's tables (issue 35): saved at W = 4 (each rank a quarter of the rows, and
// their AdamW state), resumed at W = 3, 2 and 1, where each rank reads the rows its declaration
// names from the saved whole table (W = 3 splits the 256 rows 86, 86, 84: other boundaries than
// the saving ranks'). The global batch is the same at every W, so the losses follow the
// uninterrupted W = 4 run within fp32 rounding.
TEST(Checkpoint, DHENTablesReshardOntoOtherWorldSizes) {
  for (const std::string kind : {"sharded", "full"}) {
    const std::string dir = fresh_dir("dhen-reshard-" + kind);
    const std::string common = "--model dhen-tiny --global-batch-size 12 --steps 8 --checkpoint-kind " + kind;
    const auto whole = train(dir, "w4", common + " --nproc-per-node 4 --save-every 4 --save-dir " + dir + "/w4");
    ASSERT_EQ(whole.run.exit_code, 0) << whole.run.output;
    const auto a = whole.losses();
    for (const std::string target : {"--nproc-per-node 2", "--nproc-per-node 3", "--nproc-per-node 1"}) {
      const auto r = train(dir, "target", common + " " + target + " --resume " + step_dir(dir + "/w4", 4));
      ASSERT_EQ(r.run.exit_code, 0) << kind << " " << target << "\n" << r.run.output;
      int compared = 0;
      for (const auto& [key, loss] : r.losses()) {
        if (key.second != 0) continue;
        ASSERT_GE(key.first, 4);
        EXPECT_NEAR(loss, a.at({key.first, 0}), 1e-5) << kind << " " << target << " step " << key.first;
        ++compared;
      }
      EXPECT_EQ(compared, 4) << kind << " " << target;
      std::remove((dir + "/target.jsonl").c_str());
    }
    fsdp_test::sh("rm -rf " + dir);
  }
}

// Options::row_sharded_parameters (tests/worker/checkpoint_ignored.cpp, W = 2, the DHEN-like
// model's table): wrong declarations are refused by name on every rank when the model is wrapped;
// an ignored parameter left undeclared is replicated, and a save refuses it when the ranks' copies
// differ (a table's rows do); a checkpoint whose table has another shape is refused by name with
// nothing changed, and loads exactly into a model of the saved shape; full_state_dict,
// sharded_state_dict, export_full and load_model_file hold the table whole or the rows in place.
TEST(Checkpoint, IgnoredParametersDeclarationsAndRefusals) {
  const auto ranks = fsdp_test::expect_ranks("checkpoint_ignored", 2, "");
  ASSERT_EQ(ranks.size(), 2u);
  auto has = [](const json& r, const std::string& key, const std::string& text) {
    return r[key].get<std::string>().find(text) != std::string::npos;
  };
  for (const auto& r : ranks) {
    const std::string what = r.dump(1);
    EXPECT_EQ(r["declared"], "") << what;
    EXPECT_TRUE(has(r, "not_ignored", "'dense_proj.weight' is declared in Options::row_sharded_parameters but fsdp "
                                      "does not ignore it")) << what;
    EXPECT_TRUE(has(r, "not_ignored", "Options::ignored_modules")) << what;
    EXPECT_TRUE(has(r, "not_a_parameter", "is not a parameter of the wrapped model")) << what;
    EXPECT_TRUE(has(r, "declared_twice", "'sparse.weight' is declared twice")) << what;
    EXPECT_TRUE(has(r, "overlap", "the ranks' rows of 'sparse.weight' do not tile its 256 rows: rows [0, 128) are "
                                  "held by both rank 0 and rank 1")) << what;
    EXPECT_TRUE(has(r, "gap", "do not tile its 261 rows: rows [256, 261) are held by no rank")) << what;
    EXPECT_TRUE(has(r, "other_rows_per_rank", "rank 0 a table of 256 rows, rank 1 of 320")) << what;
    EXPECT_TRUE(has(r, "undeclared_save", "ignored parameter 'sparse.weight' is replicated")) << what;
    EXPECT_TRUE(has(r, "undeclared_save", "declare it in Options::row_sharded_parameters")) << what;
    EXPECT_TRUE(has(r, "load_other_rows", "shapes differ for sparse.weight (saved [256, 16], model [128, 16])")) << what;
    EXPECT_TRUE(has(r, "load_other_rows", "nothing was changed")) << what;
    EXPECT_TRUE(r["unchanged"].get<bool>()) << what;
    EXPECT_EQ(r["load_same_rows"], "") << what;
    EXPECT_TRUE(r["loaded_exactly"].get<bool>()) << "rows, shards and AdamW state as saved; " << what;
    EXPECT_TRUE(r["full_state_dict_table"].get<bool>()) << "the whole table, as one process draws it; " << what;
    EXPECT_TRUE(r["sharded_state_dict_table"].get<bool>()) << "this rank's rows at their place; " << what;
    EXPECT_TRUE(r["load_model_file_rows"].get<bool>()) << "export_full's file gives each rank its trained rows; " << what;
  }
  fsdp_test::sh("rm -rf " + fsdp_test::temp_prefix("checkpoint_ignored") + "-ckpt-ignored*");
}

// A LOCAL checkpoint holds raw shards: another layout is refused with the reason and the way out.
TEST(Checkpoint, LocalCheckpointRefusesAnotherLayout) {
  const std::string dir = fresh_dir("local-layout");
  ASSERT_EQ(train(dir, "save", "--nproc-per-node 2 --steps 2 --checkpoint-kind local --save-dir " + dir + "/c").run.exit_code, 0);
  const auto r = train(dir, "load", "--nproc-per-node 1 --steps 3 --resume " + dir + "/c");
  EXPECT_NE(r.run.exit_code, 0);
  EXPECT_NE(r.run.output.find("LOCAL checkpoints load only into the same layout"), std::string::npos) << r.run.output;
  fsdp_test::sh("rm -rf " + dir);
}

// A rank killed in the middle of a save (a deterministic point: after the first tensor of its
// first file in its second save) fails the job with an error, leaves the previous checkpoint
// complete and loadable, and the half-written one invisible to --resume.
TEST(Checkpoint, RankKilledDuringSaveLeavesThePreviousCheckpoint) {
  const std::string dir = fresh_dir("killed");
  const auto r = train(dir, "killed", "--nproc-per-node 2 --steps 10 --save-every 5 --save-dir " + dir + "/c",
                       "FSDP_TEST_KILL_RANK_IN_SAVE=1:2");
  EXPECT_NE(r.run.exit_code, 0) << r.run.output;
  EXPECT_NE(r.run.output.find("kills itself"), std::string::npos) << r.run.output;
  EXPECT_NE(r.run.output.find("rank 1"), std::string::npos) << r.run.output;
  const auto listing = fsdp_test::sh("ls -a " + dir + "/c");
  EXPECT_NE(listing.output.find("\nstep-00000005"), std::string::npos) << listing.output;
  EXPECT_EQ(listing.output.find("\nstep-00000010"), std::string::npos) << listing.output;
  const auto resumed = train(dir, "resumed", "--nproc-per-node 2 --steps 10 --resume " + dir + "/c");
  ASSERT_EQ(resumed.run.exit_code, 0) << resumed.run.output;
  EXPECT_NE(resumed.run.output.find("resumed from " + step_dir(dir + "/c", 5)), std::string::npos) << resumed.run.output;
  fsdp_test::sh("rm -rf " + dir);
}

// Damaged checkpoints are refused with the file and the problem named, and nothing is loaded.
TEST(Checkpoint, DamageIsNamedAndTheGoodCopyStillLoads) {
  const std::string dir = fresh_dir("damage");
  ASSERT_EQ(train(dir, "save", "--nproc-per-node 2 --steps 3 --save-dir " + dir + "/good").run.exit_code, 0);
  const std::string good = step_dir(dir + "/good", 3);
  const std::string file = "model/rank-00001-of-00002.safetensors";
  // Each damage is done to a copy of the good checkpoint, here in C++ (no shell quoting).
  auto flip_byte = [](const std::string& path) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-7, std::ios::end);
    const char b = static_cast<char>(f.get() ^ 0x5a);
    f.seekp(-7, std::ios::end);
    f.put(b);
  };
  struct Damage {
    std::string name, shell, expect;
    bool flip = false;
  };
  const std::vector<Damage> damages = {
      {"truncated", "truncate -s -100 X/" + file, "bytes, the manifest says"},
      {"flipped", "true", "is corrupt", true},
      {"missing", "rm X/" + file, "is missing"},
      {"no_manifest", "rm X/manifest.json", "no manifest.json"},
      {"bad_manifest", "echo \"{ not json\" > X/manifest.json", "not valid JSON"},
  };
  for (const auto& d : damages) {
    const std::string copy = dir + "/" + d.name;
    std::string how = d.shell;
    for (size_t p; (p = how.find("X/")) != std::string::npos;) how.replace(p, 1, copy);
    ASSERT_EQ(fsdp_test::sh("cp -r " + good + " " + copy + " && " + how).exit_code, 0) << d.name;
    if (d.flip) flip_byte(copy + "/" + file);
    const auto r = train(dir, d.name, "--nproc-per-node 2 --steps 5 --resume " + copy);
    EXPECT_NE(r.run.exit_code, 0) << d.name;
    EXPECT_NE(r.run.output.find(d.expect), std::string::npos) << d.name << ":\n" << r.run.output;
    if (d.name != "no_manifest" && d.name != "bad_manifest") {
      EXPECT_NE(r.run.output.find(copy + "/" + file), std::string::npos) << d.name << " must name the file:\n" << r.run.output;
    }
  }
  // A checkpoint of another model.
  const auto other = train(dir, "other", "--nproc-per-node 2 --steps 5 --model small --resume " + good);
  EXPECT_NE(other.run.exit_code, 0);
  EXPECT_NE(other.run.output.find("not a state of this model"), std::string::npos) << other.run.output;
  // The good one still loads.
  const auto ok = train(dir, "ok", "--nproc-per-node 2 --steps 5 --resume " + good);
  EXPECT_EQ(ok.run.exit_code, 0) << ok.run.output;
  fsdp_test::sh("rm -rf " + dir);
}

// keep-last keeps the newest K, and an asynchronous save is committed before the job ends.
TEST(Checkpoint, KeepLastKeepsTheNewest) {
  const std::string dir = fresh_dir("keep");
  const auto r = train(dir, "keep", "--nproc-per-node 2 --steps 8 --save-every 2 --keep-last 2 --async-save --save-dir " + dir + "/c");
  ASSERT_EQ(r.run.exit_code, 0) << r.run.output;
  const auto listing = fsdp_test::sh("ls " + dir + "/c");
  EXPECT_EQ(listing.output, "step-00000006\nstep-00000008\n");
  fsdp_test::sh("rm -rf " + dir);
}

// A FULL save gathers one unit at a time: rank 0's live tensor bytes grow by about one unit
// (its gathered flat tensor and the shard copy it gathers from), not by the model.
TEST(Checkpoint, FullSaveHoldsOneUnitBeyondTheShards) {
  const std::string dir = fresh_dir("fullmem");
  const auto r = train(dir, "full", "--model medium --global-batch-size 2 --block-size 64 --nproc-per-node 2 --steps 1 "
                       "--checkpoint-kind full --save-dir " + dir + "/c");
  ASSERT_EQ(r.run.exit_code, 0) << r.run.output;
  int checked = 0;
  for (const auto& row : r.rows) {
    if (!row.contains("checkpoint_memory")) continue;
    const json& m = row["checkpoint_memory"];
    const double unit = m["largest_unit_bytes"].get<double>(), increase = m["peak_increase_bytes"].get<double>();
    // Rank 0 receives each shard straight into the unit's buffer: one unit. The other rank sends a
    // copy of its shard: half a unit at W = 2. (Measured: 12.6 and 6.3 MB for 12.6 MB units.)
    const double bound = row["rank"].get<int>() == 0 ? unit : unit / 2;
    EXPECT_LE(increase, 1.02 * bound + (256 << 10)) << "rank " << row["rank"] << ": the save held " << increase / 1e6
                                                    << " MB above the shards; one unit is " << unit / 1e6 << " MB";
    ++checked;
  }
  EXPECT_EQ(checked, 2);
  fsdp_test::sh("rm -rf " + dir);
}

// Every optimizer adapter through a save and a load into other weights and another learning rate:
// the next steps' losses are bitwise those of the run that saved. Others are refused clearly.
TEST(Checkpoint, EveryOptimizerAdapterRoundTrips) {
  for (const std::string opt : {"sgd", "adam", "adamw", "rmsprop", "adagrad"}) {
    const std::string dir = fsdp_test::temp_prefix("checkpoint") + "-ckpt-" + opt;
    for (const auto& r : fsdp_test::expect_ranks("checkpoint", 2, "--strategy full_shard --variants " + opt)) {
      EXPECT_EQ(r["resumed_step"], 3) << opt;
      EXPECT_EQ(r["losses_a"], r["losses_b"]) << opt << " rank " << r["rank"];
      EXPECT_NE(r["unsupported"].get<std::string>().find("SGD, Adam, AdamW, RMSprop and Adagrad"), std::string::npos)
          << r["unsupported"];
    }
    fsdp_test::sh("rm -rf " + dir);
  }
}

// ---- Python, both ways (the project's Python environment: torch 2.11 and safetensors).

std::string python() { return FSDP_PYTHON; }
std::string interop() { return python() + " " + std::string(FSDP_SOURCE_DIR) + "/tests/python/checkpoint_interop.py "; }

json last_json_line(const std::string& output) {
  const size_t end = output.find_last_not_of("\n");
  const size_t start = output.rfind('\n', end);
  return json::parse(output.substr(start == std::string::npos ? 0 : start + 1, end - (start == std::string::npos ? 0 : start + 1) + 1));
}

// (a) A FULL checkpoint loads with safetensors.torch.load_file into the Python GPT port, and its
// loss on the next batch equals the one fsdp-train logged for that step.
TEST(CheckpointPython, FullCheckpointLoadsIntoThePythonModel) {
  const std::string dir = fresh_dir("py-full");
  ASSERT_EQ(fsdp_test::sh(fsdp_test::fsdp_train() + " " + kTrain + "--model tiny --steps 11 --export-init " + dir + "/init").exit_code, 0);
  const auto r = train(dir, "run", "--nproc-per-node 2 --steps 11 --save-every 10 --checkpoint-kind full --save-dir " + dir + "/c");
  ASSERT_EQ(r.run.exit_code, 0) << r.run.output;
  const auto py = fsdp_test::sh(interop() + "full-loss --checkpoint " + step_dir(dir + "/c", 10) + " --export-dir " + dir +
                                "/init --step 10");
  ASSERT_EQ(py.exit_code, 0) << py.output;
  const double ours = r.losses().at({10, 0}), theirs = last_json_line(py.output)["loss"].get<double>();
  // Ours is the mean of the ranks' means (equal halves), Python's the whole batch's: float32 sums.
  EXPECT_NEAR(theirs, ours, 1e-5 * std::abs(ours));
  fsdp_test::sh("rm -rf " + dir);
}

// (b) A SHARDED checkpoint saved at W = 4 loads in one Python process with
// torch.distributed.checkpoint's Hugging Face reader into plain tensors equal, bit for bit, to the
// FULL checkpoint of the same training state.
TEST(CheckpointPython, ShardedCheckpointLoadsWithTorchDistributedCheckpoint) {
  const std::string dir = fresh_dir("py-dcp");
  for (const std::string kind : {"sharded", "full"}) {
    const auto r = train(dir, kind, "--nproc-per-node 4 --steps 4 --checkpoint-kind " + kind + " --save-dir " + dir + "/" + kind);
    ASSERT_EQ(r.run.exit_code, 0) << r.run.output;
  }
  const auto py = fsdp_test::sh(interop() + "dcp-load --sharded " + step_dir(dir + "/sharded", 4) + " --full " +
                                step_dir(dir + "/full", 4));
  ASSERT_EQ(py.exit_code, 0) << py.output;
  const json res = last_json_line(py.output);
  EXPECT_TRUE(res["differ"].empty()) << res.dump();
  EXPECT_GT(res["checked"].get<int>(), 3 * res["params"].get<int>() - 1) << "model and both Adam moments: " << res.dump();
  fsdp_test::sh("rm -rf " + dir);
}

// (b) for the DHEN-like model's table (issue 35), whose rows the ranks hold outside fsdp: a SHARDED
// checkpoint saved at W = 4 holds each rank's rows as one box of the whole table (a quarter of its
// 256 rows), and torch.distributed.checkpoint's Hugging Face reader reads it whole with its AdamW
// state, equal bit for bit to the FULL checkpoint of the same state (rank 0 gathered the rows) and
// to the export_full file the saving run wrote.
TEST(CheckpointPython, DHENTableReadsWholeWithTorchDistributedCheckpoint) {
  const std::string dir = fresh_dir("py-dhen");
  for (const std::string kind : {"sharded", "full"}) {
    const auto r = train(dir, kind, "--model dhen-tiny --nproc-per-node 4 --steps 4 --checkpoint-kind " + kind +
                                        " --save-dir " + dir + "/" + kind + " --export-full " + dir + "/" + kind + ".safetensors");
    ASSERT_EQ(r.run.exit_code, 0) << r.run.output;
  }
  const auto py = fsdp_test::sh(interop() + "dcp-load --sharded " + step_dir(dir + "/sharded", 4) + " --full " +
                                step_dir(dir + "/full", 4) + " --export " + dir + "/sharded.safetensors --table sparse.weight");
  ASSERT_EQ(py.exit_code, 0) << py.output;
  const json res = last_json_line(py.output);
  EXPECT_TRUE(res["differ"].empty()) << res.dump();
  for (const std::string key : {"sparse.weight", "state.sparse.weight.exp_avg", "state.sparse.weight.exp_avg_sq"}) {
    EXPECT_NE(std::find(res["keys"].begin(), res["keys"].end(), key), res["keys"].end()) << key << ": " << res.dump();
  }
  ASSERT_EQ(res["pieces"].size(), 4u) << res.dump();
  for (int r = 0; r < 4; ++r) {
    const json& p = res["pieces"][r];
    EXPECT_EQ(p["file"], "rank-0000" + std::to_string(r) + "-of-00004.safetensors") << res.dump();
    EXPECT_EQ(p["saved_offsets"], json::array({64 * r, 0})) << res.dump();
    EXPECT_EQ(p["shape"], json::array({64, 16})) << res.dump();
  }
  fsdp_test::sh("rm -rf " + dir);
}

// (c) Python's state dicts load into the C++ model under fsdp: safetensors and torch.save of a
// dict exactly; torch.save of model.state_dict() (an OrderedDict libtorch cannot read) is refused
// with how to re-save it.
TEST(CheckpointPython, PythonStateDictsLoadIntoTheShardedModel) {
  const std::string dir = fresh_dir("py-save");
  ASSERT_EQ(fsdp_test::sh(fsdp_test::fsdp_train() + " " + kTrain + "--model tiny --steps 1 --export-init " + dir + "/init").exit_code, 0);
  const auto saved = fsdp_test::sh(interop() + "save --export-dir " + dir + "/init --out " + dir + "/py");
  ASSERT_EQ(saved.exit_code, 0) << saved.output;
  for (const std::string f : {"model.safetensors", "model_dict.pt"}) {
    const std::string out = dir + "/out-" + f + ".safetensors";
    const auto r = train(dir, "load", "--nproc-per-node 2 --steps 0 --load-weights " + dir + "/py/" + f + " --export-full " + out);
    ASSERT_EQ(r.run.exit_code, 0) << f << "\n" << r.run.output;
    const auto cmp = fsdp_test::sh(interop() + "compare --a " + dir + "/py/reference.safetensors --b " + out);
    ASSERT_EQ(cmp.exit_code, 0) << cmp.output;
    const json res = last_json_line(cmp.output);
    EXPECT_TRUE(res["differ"].empty()) << f << ": " << res.dump();
    EXPECT_GT(res["compared"].get<int>(), 10);
  }
  const auto ordered = train(dir, "ordered", "--nproc-per-node 2 --steps 0 --load-weights " + dir + "/py/model_ordered.pt");
  EXPECT_NE(ordered.run.exit_code, 0);
  EXPECT_NE(ordered.run.output.find("torch.save(dict(model.state_dict()), path)"), std::string::npos) << ordered.run.output;
  fsdp_test::sh("rm -rf " + dir);
}

// A run crosses languages with its optimizer (tests/python/optimizer_interop.py, PyTorch FSDP2 on
// 2 gloo processes): the same GPT, weights, batches and AdamW on both sides, so each side's
// continuation of the other's checkpoint must follow the other side's own continuation.
std::vector<double> losses_of(const json& j, const std::string& key) {
  std::vector<double> out;
  for (const auto& v : j[key]) out.push_back(v.get<double>());
  return out;
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE(std::abs(a[i] - b[i]), 1e-5 * std::abs(b[i])) << what << ", loss " << i << ": " << a[i] << " vs " << b[i];
  }
}

std::vector<double> rank0_losses(const TrainRun& t, int first, int last) {
  std::vector<double> out;
  for (int s = first; s < last; ++s) out.push_back(t.losses().at({s, 0}));
  return out;
}

TEST(CheckpointPython, FsdpRunResumesInPyTorchFSDP2WithItsAdamW) {
  const std::string dir = fresh_dir("to-fsdp2");
  ASSERT_EQ(fsdp_test::sh(fsdp_test::fsdp_train() + " --model tiny --export-init " + dir + "/e --steps 20").exit_code, 0);
  ASSERT_EQ(train(dir, "save", "--nproc-per-node 2 --steps 10 --save-dir " + dir + "/c").run.exit_code, 0);
  // Our own resume, in another folder (it saves at its end).
  fsdp_test::sh("cp -r " + dir + "/c " + dir + "/ours");
  const auto ours = train(dir, "ours", "--nproc-per-node 2 --steps 20 --resume " + dir + "/ours");
  ASSERT_EQ(ours.run.exit_code, 0) << ours.run.output;
  const auto py = fsdp_test::sh(python() + " " + std::string(FSDP_SOURCE_DIR) + "/tests/python/optimizer_interop.py resume "
                                "--checkpoint " + step_dir(dir + "/c", 10) + " --export-dir " + dir + "/e --first 10 --last 20", 600);
  ASSERT_EQ(py.exit_code, 0) << py.output;
  const json j = last_json_line(py.output);
  // The script checked every weight, every exp_avg and exp_avg_sq bit for bit against the files,
  // every step count and both groups' hyper-parameters after set_optimizer_state_dict.
  EXPECT_EQ(j["checked"]["optim"]["tensors"], 56) << j.dump();
  expect_close(losses_of(j, "losses"), rank0_losses(ours, 10, 20), "PyTorch FSDP2 resuming fsdp's step 10");
  fsdp_test::sh("rm -rf " + dir);
}

TEST(CheckpointPython, PyTorchFSDP2RunResumesInFsdpTrainWithItsAdamW) {
  const std::string dir = fresh_dir("from-fsdp2");
  ASSERT_EQ(fsdp_test::sh(fsdp_test::fsdp_train() + " --model tiny --export-init " + dir + "/e --steps 20").exit_code, 0);
  // PyTorch trains 10 steps from fsdp-train's initial weights, saves with DCP's Hugging Face writer
  // (model and flattened optimizer in one folder), and continues to step 20 itself.
  const auto py = fsdp_test::sh(python() + " " + std::string(FSDP_SOURCE_DIR) + "/tests/python/optimizer_interop.py save "
                                "--export-dir " + dir + "/e --steps 10 --out " + dir + "/p --continue-to 20", 600);
  ASSERT_EQ(py.exit_code, 0) << py.output;
  const json j = last_json_line(py.output);
  const auto resumed = train(dir, "resumed", "--nproc-per-node 2 --steps 20 --resume " + dir + "/p");
  ASSERT_EQ(resumed.run.exit_code, 0) << resumed.run.output;
  EXPECT_NE(resumed.run.output.find("resumed from " + dir + "/p at step 10"), std::string::npos) << resumed.run.output;
  expect_close(rank0_losses(resumed, 10, 20), losses_of(j, "continued_losses"), "fsdp-train resuming PyTorch's step 10");
  // (Fresh AdamW moments instead of the loaded ones move the losses by about 1e-2 within these 10
  // steps: optimizer_interop.py resume --model-only measures it on the other direction.)
  fsdp_test::sh("rm -rf " + dir);
}

}  // namespace

