// The conformance suite's tests: one gtest test per scenario of fsdp-conformance (conformance.h),
// registered from its --list. A scenario fails with what differed from local training, or what was
// not refused, on which ranks and under which configuration.
//
// The scenarios that run in one go (all those selected, of one world size) share one launch of
// ranks: starting four processes that each load libtorch and meet costs about 2.5 CPU-seconds, more
// than most scenarios do. ctest runs one source file's scenarios per test:
//   test_conformance --file activation_checkpoint      (ctest -R conformance.activation_checkpoint)
//   test_conformance --gtest_filter=Suite.Name          one scenario on its own ranks
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;

// What a scenario's run left: every rank's result, or why there is none.
struct Outcome {
  std::vector<json> ranks;
  std::string not_run;  // empty when every rank wrote its result
};
std::map<std::string, Outcome>& outcomes() {
  static std::map<std::string, Outcome> done;
  return done;
}
std::map<std::string, int>& worlds() {
  static std::map<std::string, int> w;
  return w;
}

// Runs, on one launch of `world` ranks, every selected scenario of that world size that has not
// run yet (this one among them), in gtest's order, and records each one's outcome.
void run_together(int world) {
  std::vector<std::string> names;
  const auto& unit = *testing::UnitTest::GetInstance();
  for (int s = 0; s < unit.total_test_suite_count(); ++s) {
    const auto& suite = *unit.GetTestSuite(s);
    for (int t = 0; t < suite.total_test_count(); ++t) {
      const auto& info = *suite.GetTestInfo(t);
      const std::string full = std::string(info.test_suite_name()) + "." + info.name();
      if (info.should_run() && worlds()[full] == world && !outcomes().count(full)) names.push_back(full);
    }
  }
  std::string list;
  for (const auto& n : names) list += (list.empty() ? "" : ",") + n;
  // A collective that waits for a rank that failed gives up after a minute, not five.
  const std::string out = fsdp_test::temp_prefix("conformance");
  const int timeout_s = 300 + 60 * static_cast<int>(names.size());
  const auto run = fsdp_test::sh("FSDP_COLLECTIVE_TIMEOUT_S=60 FSDP_LAUNCHER_GRACE_S=10 " + fsdp_test::bin_dir() +
                                     "/fsdp-conformance --case " + list + " --nproc-per-node " +
                                     std::to_string(world) + " --out " + out,
                                 timeout_s);
  std::string ended_in;  // the scenario the run ended in, when it ended early
  for (const auto& name : names) {
    Outcome o;
    for (int r = 0; r < world; ++r) {
      const std::string path = out + "." + name + "." + std::to_string(r) + ".json";
      if (FILE* f = std::fopen(path.c_str(), "r")) {
        std::fclose(f);
        o.ranks.push_back(fsdp_test::read_json(path));
        std::remove(path.c_str());
      }
    }
    if (!ended_in.empty()) {
      o.not_run = "did not run: the ranks' run ended in " + ended_in + " (see its failure)";
    } else if (static_cast<int>(o.ranks.size()) < world) {
      ended_in = name;
      o.not_run = "the ranks' run ended in this scenario (exit code " + std::to_string(run.exit_code) +
                  (run.seconds >= timeout_s - 1 ? ", stopped after " + std::to_string(timeout_s) + " s" : "") +
                  "; only " + std::to_string(o.ranks.size()) + " of " + std::to_string(world) +
                  " ranks wrote a result):\n" + run.output;
    } else if (run.exit_code != 0 && name == names.back()) {
      o.not_run = "every rank finished this, the run's last scenario, but the run then failed (exit code " +
                  std::to_string(run.exit_code) + "):\n" + run.output;
    }
    outcomes()[name] = std::move(o);
  }
}

class Scenario : public testing::Test {
 public:
  Scenario(std::string name, int world) : name_(std::move(name)), world_(world) {}
  void TestBody() override {
    if (!outcomes().count(name_)) run_together(world_);
    const Outcome& o = outcomes().at(name_);
    if (!o.not_run.empty()) ADD_FAILURE() << o.not_run;
    if (o.ranks.empty()) return;
    // The same failure on several ranks is reported once, with the ranks that saw it.
    std::map<std::string, std::set<int>> failures;
    for (const auto& rank : o.ranks) {
      for (const auto& f : rank["failures"]) failures[f.get<std::string>()].insert(rank["rank"].get<int>());
    }
    for (const auto& [what, ranks] : failures) {
      std::ostringstream who;
      for (int k : ranks) who << (who.tellp() > 0 ? "," : "") << k;
      ADD_FAILURE() << "rank " << who.str() << ": " << what;
    }
    if (!o.ranks[0]["figures"].empty()) {
      RecordProperty("figures", o.ranks[0]["figures"].dump());
      std::cout << "figures (rank 0): " << o.ranks[0]["figures"].dump() << "\n";
    }
  }

 private:
  std::string name_;
  int world_;
};

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  std::string file;  // --file STEM: only the scenarios of tests/conformance/STEM.cpp
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--file") == 0 && i + 1 < argc) {
      file = argv[++i];
    } else {
      std::fprintf(stderr, "test_conformance: unknown argument %s (use --file STEM and gtest's flags)\n", argv[i]);
      return 2;
    }
  }
  const std::string list = fsdp_test::bin_dir() + "/fsdp-conformance --list";
  FILE* p = ::popen(list.c_str(), "r");
  if (!p) {
    std::fprintf(stderr, "test_conformance: cannot run %s\n", list.c_str());
    return 1;
  }
  char line[512];
  int n = 0;
  while (std::fgets(line, sizeof(line), p)) {
    std::istringstream in(line);
    std::string full, stem;
    int world = 0;
    if (!(in >> full >> world >> stem)) continue;
    if (!file.empty() && stem != file) continue;
    const auto dot = full.find('.');
    const std::string suite = full.substr(0, dot), name = full.substr(dot + 1);
    worlds()[full] = world;
    testing::RegisterTest(suite.c_str(), name.c_str(), nullptr, nullptr, __FILE__, __LINE__,
                          [full, world]() -> testing::Test* { return new Scenario(full, world); });
    ++n;
  }
  if (::pclose(p) != 0 || n == 0) {
    std::fprintf(stderr, "test_conformance: %s listed no scenarios%s\n", list.c_str(),
                 file.empty() ? "" : (" of " + file + ".cpp").c_str());
    return 1;
  }
  return RUN_ALL_TESTS();
}
