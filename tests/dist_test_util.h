// Helpers for tests that run several ranks of build/bin/fsdp-test-worker.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace fsdp_test {

inline std::string bin_dir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  std::string self(buf, n > 0 ? static_cast<size_t>(n) : 0);
  return self.substr(0, self.rfind('/'));
}

inline std::string worker() { return bin_dir() + "/fsdp-test-worker"; }
// fsdp-train as the tests run it: without the end of the main job (the run folder with its
// checkpoint and model, the text sample), so that a test keeps only what it asks for and a big
// model is not saved after every case. ctest -R MainJobEndsWithSomethingToKeep runs the default.
inline std::string fsdp_train() { return bin_dir() + "/fsdp-train --run-dir none --sample-tokens 0"; }

inline std::string temp_prefix(const std::string& name) {
  return "/tmp/fsdp-test-" + std::to_string(::getpid()) + "-" + name;
}

// A new, empty scratch folder for one test (under /tmp, named after the test process).
inline std::string fresh_dir(const std::string& name);
// A checkpoint folder's step-N/ ("dir/step-00000010").
inline std::string step_dir(const std::string& dir, int step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "/step-%08d", step);
  return dir + buf;
}
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Run {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
};

// Runs a shell command line (under a hard timeout so a hang fails the test instead of CI),
// capturing stdout and stderr together.
inline Run sh(const std::string& cmd, int timeout_s = 300) {
  const std::string log = temp_prefix("sh") + "-" + std::to_string(std::rand()) + ".log";
  const auto t0 = std::chrono::steady_clock::now();
  const std::string full = "timeout -s KILL " + std::to_string(timeout_s) + " bash -c '" + cmd + "' > " + log + " 2>&1";
  const int status = std::system(full.c_str());
  Run r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  r.output = ss.str();
  std::remove(log.c_str());
  return r;
}

inline std::string fresh_dir(const std::string& name) {
  const std::string d = temp_prefix(name);
  sh("rm -rf " + d + " && mkdir -p " + d);
  return d;
}

// One JSON object per line (fsdp-train's --metrics-jsonl); none if the file is missing.
inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("missing result file " + path);
  return nlohmann::json::parse(in);
}

// Runs `fsdp-test-worker MODE` on `world` local ranks and reads each rank's result file.
struct RankResults {
  Run run;
  std::vector<nlohmann::json> ranks;  // empty when the run failed
};
inline RankResults run_ranks(const std::string& mode, int world, const std::string& flags) {
  const std::string out = temp_prefix(mode);
  RankResults r;
  r.run = sh(worker() + " " + mode + " --nproc-per-node " + std::to_string(world) + " " + flags + " --out " + out);
  if (r.run.exit_code != 0) return r;
  for (int i = 0; i < world; ++i) {
    const std::string path = out + "." + std::to_string(i) + ".json";
    r.ranks.push_back(read_json(path));
    std::remove(path.c_str());
  }
  return r;
}

// run_ranks for a test that needs the run to succeed: a failure is reported with its output.
inline std::vector<nlohmann::json> expect_ranks(const std::string& mode, int world, const std::string& flags) {
  auto r = run_ranks(mode, world, flags);
  EXPECT_EQ(r.run.exit_code, 0) << r.run.output;
  return r.ranks;
}

// Rank 0's per-step losses (and the last step's record) of fsdp-train run as a user runs it.
struct MainJob {
  std::vector<double> losses;
  nlohmann::json last;
};
inline MainJob main_job(const std::string& args, int steps, int timeout_s = 300) {
  const std::string metrics = temp_prefix("main-job") + ".jsonl";
  std::remove(metrics.c_str());
  const auto run = sh(fsdp_train() + " --steps " + std::to_string(steps) +
                                     " --log-every 1000 --metrics-jsonl " + metrics + " " + args,
                                 timeout_s);
  EXPECT_EQ(run.exit_code, 0) << args << "\n" << run.output;
  MainJob out{std::vector<double>(steps, -1.0), {}};
  for (const auto& j : read_jsonl(metrics)) {
    if (j.contains("event") || j["rank"] != 0) continue;  // event rows (restarted, state_hash) carry no step
    out.losses.at(j["step"].get<size_t>()) = j["loss"].get<double>();
    out.last = j;
  }
  std::remove(metrics.c_str());
  return out;
}

inline void expect_same_losses(const std::vector<double>& got, const std::vector<double>& want, double rel,
                        const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t s = 0; s < got.size(); ++s) {
    EXPECT_GT(want[s], 0.0) << what << " step " << s;
    EXPECT_NEAR(got[s], want[s], rel * std::abs(want[s])) << what << " step " << s;
  }
}

// fsdp-train's JSONL: the rows of one event ("replica_left", "restarted", ...).
inline std::vector<nlohmann::json> events(const std::vector<nlohmann::json>& rows, const std::string& name) {
  std::vector<nlohmann::json> out;
  for (const auto& r : rows) {
    if (r.value("event", "") == name) out.push_back(r);
  }
  return out;
}

// Rank `rank`'s loss per step (the last row of a step wins: a restarted run repeats steps).
inline std::map<int, double> step_losses(const std::vector<nlohmann::json>& rows, int rank = 0) {
  std::map<int, double> out;
  for (const auto& r : rows) {
    if (!r.contains("event") && r["rank"] == rank && r.contains("loss")) out[r["step"].get<int>()] = r["loss"].get<double>();
  }
  return out;
}

// fsdp-train's final state hash of each rank (its shards and its optimizer state).
inline std::map<int, nlohmann::json> hashes(const std::vector<nlohmann::json>& rows) {
  std::map<int, nlohmann::json> out;
  for (const auto& e : events(rows, "state_hash")) out[e["rank"].get<int>()] = e;
  return out;
}

inline void expect_same_step_losses(const std::map<int, double>& got, const std::map<int, double>& want, int steps) {
  for (int s = 0; s < steps; ++s) {
    ASSERT_TRUE(got.count(s)) << "no loss for step " << s;
    ASSERT_TRUE(want.count(s)) << "no loss for step " << s << " in the run compared with";
    EXPECT_NEAR(got.at(s), want.at(s), 1e-5 * std::abs(want.at(s))) << "step " << s;
  }
}

}  // namespace fsdp_test
