// fsdp-bench: step time of every sharding strategy (--suite strategies) or of every overlap
// setting (--suite overlap: prefetch modes, rate limiter) against local training, measured side
// by side in one run on the same machine, model, data and global batch; or (--suite builds
// --baseline OTHER/fsdp-train) this build against another one, full sharding at W = 2, to catch
// a regression; or (--suite detection [--baseline OTHER/fsdp-train]) the two ways fsdp knows
// when a unit runs (--unit-detection dispatch_key | record_function) at W = 1 and 2 against local
// training, with the operator calls that entered fsdp per step. Each configuration is a run of
// build/bin/fsdp-train (the local baseline with --local); the step times after warm-up come from
// its --metrics-jsonl output, and the table reports medians and their ratio to local training,
// with the communication time the compute thread was exposed to (waiting on a collective).
// Configurations are interleaved over --repeats rounds so machine noise hits all of them alike.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

namespace {

struct Config {
  std::string label, strategy;
  int world = 1, shard_size = 0;
  bool local = false;
  std::string extra;   // more fsdp-train flags
  std::string binary;  // another build's fsdp-train (--suite builds); empty: this build's
};

std::string self_dir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  std::string s(buf, n > 0 ? static_cast<size_t>(n) : 0);
  return s.substr(0, s.rfind('/'));
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "default";
  int steps = 12, warmup = 4, repeats = 3;
  int64_t batch = 16;
  std::string out_md, suite = "strategies", baseline;
  CLI::App app{"fsdp-bench: step-time ratios of every strategy or overlap setting against local training"};
  app.add_option("--suite", suite,
                 "strategies: every sharding strategy; overlap: prefetch modes and the rate limiter; "
                 "builds: this build against --baseline")
      ->check(CLI::IsMember({"strategies", "overlap", "builds", "detection"}));
  app.add_option("--baseline", baseline, "--suite builds: the other build's fsdp-train; --suite detection: an "
                                         "earlier build to add as a row at W = 1 and 2");
  app.add_option("--model", model, "GPT preset");
  app.add_option("--steps", steps, "steps per run (including warm-up)");
  app.add_option("--warmup", warmup, "steps dropped from each run");
  app.add_option("--repeats", repeats, "rounds over all configurations");
  app.add_option("--global-batch-size", batch, "sequences per step");
  app.add_option("--markdown", out_md, "also write the table to this file");
  CLI11_PARSE(app, argc, argv);

  std::vector<Config> configs{{"local", "full_shard", 1, 0, true, ""}};
  if (suite == "builds") {
    if (baseline.empty()) {
      std::cerr << "fsdp-bench: --suite builds needs --baseline PATH (another build's fsdp-train)" << std::endl;
      return 2;
    }
    // The ratio column is then this build against the baseline (row 0).
    configs = {{"baseline build", "full_shard", 2, 0, false, "", baseline}, {"this build", "full_shard", 2, 0, false, ""}};
  } else if (suite == "detection") {
    for (int w : {1, 2}) {
      if (!baseline.empty()) configs.push_back({"earlier build (--baseline)", "full_shard", w, 0, false, "", baseline});
      configs.push_back({"record_function", "full_shard", w, 0, false, "--unit-detection record_function"});
      configs.push_back({"dispatch_key (default)", "full_shard", w, 0, false, "--unit-detection dispatch_key"});
    }
  } else if (suite == "strategies") {
    for (int w : {1, 2, 4}) {
      for (std::string s : {"full_shard", "shard_grad_op", "no_shard"}) configs.push_back({s, s, w, 0, false, ""});
    }
    configs.push_back({"hybrid_shard", "hybrid_shard", 4, 2, false, ""});
    configs.push_back({"hybrid_shard_zero2", "hybrid_shard_zero2", 4, 2, false, ""});
  } else {
    for (int w : {2, 4}) {
      configs.push_back({"no prefetch", "full_shard", w, 0, false, "--backward-prefetch none --no-forward-prefetch"});
      configs.push_back({"backward_post", "full_shard", w, 0, false, "--backward-prefetch backward_post --no-forward-prefetch"});
      configs.push_back({"backward_pre", "full_shard", w, 0, false, "--backward-prefetch backward_pre --no-forward-prefetch"});
      configs.push_back({"backward_pre + forward prefetch (default)", "full_shard", w, 0, false,
                         "--backward-prefetch backward_pre --forward-prefetch"});
      configs.push_back({"backward_pre, rate limiter off", "full_shard", w, 0, false,
                         "--backward-prefetch backward_pre --limit-all-gathers 0"});
    }
  }

  const std::string train = self_dir() + "/fsdp-train";
  const std::string tmp = "/tmp/fsdp-bench-" + std::to_string(::getpid());
  std::map<size_t, std::vector<double>> step_ms;  // config -> post-warm-up step times, all rounds
  std::map<size_t, std::vector<double>> round_ms;  // config -> the median of each round
  std::map<size_t, double> comm_mb;
  std::map<size_t, std::vector<double>> exposed_ms;
  std::map<size_t, std::pair<double, double>> ops;  // config -> operator calls into fsdp per step (in passes, at rest)
  // config -> per phase (forward, backward, clip, optimizer, rest, exposed in forward, exposed in
  // backward): the post-warm-up values of every round
  const std::vector<std::string> kPhaseCols = {"forward", "backward", "clip", "optimizer", "rest", "exposed fwd", "exposed bwd"};
  std::map<size_t, std::vector<std::vector<double>>> phase_ms;
  for (int round = 0; round < repeats; ++round) {
    for (size_t i = 0; i < configs.size(); ++i) {
      const Config& c = configs[i];
      const std::string jsonl = tmp + ".jsonl";
      std::remove(jsonl.c_str());
      std::string cmd = (c.binary.empty() ? train : c.binary) + " --model " + model + " --steps " + std::to_string(steps) + " --global-batch-size " +
                        std::to_string(batch) + " --log-every 1000000 --metrics-jsonl " + jsonl;
      cmd += c.local ? " --local" : " --nproc-per-node " + std::to_string(c.world) + " --strategy " + c.strategy;
      if (c.shard_size) cmd += " --shard-size " + std::to_string(c.shard_size);
      if (!c.extra.empty()) cmd += " " + c.extra;
      // This build's fsdp-train keeps nothing at the end (another build's may not know the flags).
      if (c.binary.empty()) cmd += " --run-dir none --sample-tokens 0";
      cmd += " > " + tmp + ".log 2>&1";
      if (std::system(cmd.c_str()) != 0) {
        std::cerr << "fsdp-bench: run failed: " << cmd << " (see " << tmp << ".log)" << std::endl;
        return 1;
      }
      std::ifstream in(jsonl);
      std::string line;
      std::vector<double> this_round;
      while (std::getline(in, line)) {
        auto j = nlohmann::json::parse(line);
        if (j["rank"] != 0 || j["step"].get<int>() < warmup) continue;
        step_ms[i].push_back(j["step_ms"].get<double>());
        this_round.push_back(j["step_ms"].get<double>());
        if (j.contains("exposed_comm_ms")) exposed_ms[i].push_back(j["exposed_comm_ms"].get<double>());
        if (j.contains("phases")) {
          const auto& ph = j["phases"];
          auto exposed = [&](const char* p) {
            return ph[p]["exposed_all_gather_ms"].get<double>() + ph[p]["exposed_reduce_ms"].get<double>() +
                   ph[p]["rate_limiter_wait_ms"].get<double>();
          };
          const std::vector<double> v = {ph["forward"]["ms"].get<double>(), ph["backward"]["ms"].get<double>(),
                                         ph["clip"]["ms"].get<double>(),    ph["optimizer"]["ms"].get<double>(),
                                         ph["rest_ms"].get<double>(),       exposed("forward"), exposed("backward")};
          auto& cols = phase_ms[i];
          cols.resize(v.size());
          for (size_t k = 0; k < v.size(); ++k) cols[k].push_back(v[k]);
        }
        if (j.contains("operator_calls_into_fsdp")) {
          ops[i] = {j["operator_calls_into_fsdp"]["in_passes"].get<double>(), j["operator_calls_into_fsdp"]["at_rest"].get<double>()};
        }
        const auto& cb = j["comm_bytes"];
        comm_mb[i] = (cb["all_gather"].get<double>() + cb["reduce_scatter"].get<double>() +
                      cb["all_reduce"].get<double>()) / 1e6;
      }
      round_ms[i].push_back(median(this_round));
      std::cerr << "round " << round + 1 << "/" << repeats << " " << c.label << " W=" << c.world << " done" << std::endl;
    }
  }
  std::remove((tmp + ".jsonl").c_str());
  std::remove((tmp + ".log").c_str());

  const double local = median(step_ms[0]);
  std::ostringstream table;
  if (suite == "detection") {
    // Each round's median against the local run of the same round: the spread is over rounds.
    table << "| configuration | W | median step (ms) | ratio to local | per-round ratio (min-max) | operator calls "
             "into fsdp per step (in passes / at rest) |\n|---|---|---|---|---|---|\n";
    for (size_t i = 0; i < configs.size(); ++i) {
      std::vector<double> ratios;
      for (int r = 0; r < repeats; ++r) ratios.push_back(round_ms[i][static_cast<size_t>(r)] / round_ms[0][static_cast<size_t>(r)]);
      std::sort(ratios.begin(), ratios.end());
      char count[64] = "—";
      if (ops.count(i)) std::snprintf(count, sizeof(count), "%.0f / %.0f", ops[i].first, ops[i].second);
      char row[256];
      std::snprintf(row, sizeof(row), "| %s | %d | %.2f | %.3f | %.3f-%.3f | %s |\n", configs[i].label.c_str(),
                    configs[i].world, median(step_ms[i]), median(step_ms[i]) / local, ratios.front(), ratios.back(), count);
      table << row;
    }
    std::cout << "suite detection, model " << model << ", global batch " << batch << ", " << repeats << " rounds x "
              << (steps - warmup) << " timed steps each (medians)\n" << table.str();
    if (!out_md.empty()) std::ofstream(out_md) << table.str();
    return 0;
  }
  table << "| configuration | W | F | median step (ms) | ratio to " << configs[0].label
        << " | exposed comm (ms) | comm per rank per step (MB) |\n";
  table << "|---|---|---|---|---|---|---|\n";
  for (size_t i = 0; i < configs.size(); ++i) {
    const Config& c = configs[i];
    const int F = c.local ? 1 : c.strategy == "no_shard" ? 1 : c.shard_size ? c.shard_size : c.world;
    char row[256];
    char exposed[32] = "—";
    if (!c.local) std::snprintf(exposed, sizeof(exposed), "%.1f", median(exposed_ms[i]));
    std::snprintf(row, sizeof(row), "| %s | %d | %d | %.1f | %.2f | %s | %.2f |\n", c.label.c_str(), c.world, F,
                  median(step_ms[i]), median(step_ms[i]) / local, exposed, comm_mb[i]);
    table << row;
  }
  std::cout << "suite " << suite << ", model " << model << ", global batch " << batch << ", " << repeats << " rounds x "
            << (steps - warmup) << " timed steps each (medians)\n" << table.str();
  // Where each configuration's step goes (the JSONL's phases). Means over every timed step, not
  // medians: the phases and the rest then add up to the mean step, which per-column medians do not.
  auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return v.empty() ? 0.0 : sum / v.size();
  };
  std::ostringstream phases;
  phases << "\nWhere the step goes: means over every timed step (forward + backward + clip + optimizer + rest = step; "
            "the exposed columns are inside forward and backward)\n| configuration | W | step (ms) |";
  for (const auto& c : kPhaseCols) phases << " " << c << " (ms) |";
  phases << "\n|---|---|---|";
  for (size_t k = 0; k < kPhaseCols.size(); ++k) phases << "---|";
  phases << "\n";
  for (size_t i = 0; i < configs.size(); ++i) {
    if (!phase_ms.count(i)) continue;
    char cell[32];
    std::snprintf(cell, sizeof(cell), " %.1f |", mean(step_ms[i]));
    phases << "| " << configs[i].label << " | " << configs[i].world << " |" << cell;
    for (const auto& col : phase_ms[i]) {
      std::snprintf(cell, sizeof(cell), " %.1f |", mean(col));
      phases << cell;
    }
    phases << "\n";
  }
  std::cout << phases.str();
  table << phases.str();
  if (suite == "builds") {
    // Per round: this build's median over the baseline's, measured back to back.
    std::vector<double> ratios;
    for (int r = 0; r < repeats; ++r) ratios.push_back(round_ms[1][static_cast<size_t>(r)] / round_ms[0][static_cast<size_t>(r)]);
    std::sort(ratios.begin(), ratios.end());
    char line[160];
    std::snprintf(line, sizeof(line), "\nthis build / baseline, per round: median %.3f, min %.3f, max %.3f (%d rounds)\n",
                  median(ratios), ratios.front(), ratios.back(), repeats);
    table << line;
    std::cout << line;
  }
  if (!out_md.empty()) std::ofstream(out_md) << table.str();
  return 0;
}
