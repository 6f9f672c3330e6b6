// The conformance suite's tests: one gtest test per scenario of fsdp-conformance (conformance.h),
// registered from its --list, each run on its own ranks. A scenario fails with what differed from
// local training, or what was not refused, on which ranks and under which configuration.
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;

class Scenario : public testing::Test {
 public:
  Scenario(std::string name, int world) : name_(std::move(name)), world_(world) {}
  void TestBody() override {
    // A collective that waits for a rank that failed gives up after a minute, not five.
    const std::string out = fsdp_test::temp_prefix("conformance");
    const auto run = fsdp_test::sh("FSDP_COLLECTIVE_TIMEOUT_S=60 FSDP_LAUNCHER_GRACE_S=10 " + fsdp_test::bin_dir() +
                                   "/fsdp-conformance --case " + name_ + " --nproc-per-node " + std::to_string(world_) +
                                   " --out " + out, 500);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    std::vector<json> ranks;
    for (int i = 0; i < world_; ++i) {
      const std::string path = out + "." + std::to_string(i) + ".json";
      ranks.push_back(fsdp_test::read_json(path));
      std::remove(path.c_str());
    }
    // The same failure on several ranks is reported once, with the ranks that saw it.
    std::map<std::string, std::set<int>> failures;
    for (const auto& rank : ranks) {
      for (const auto& f : rank["failures"]) failures[f.get<std::string>()].insert(rank["rank"].get<int>());
    }
    for (const auto& [what, ranks] : failures) {
      std::ostringstream who;
      for (int k : ranks) who << (who.tellp() > 0 ? "," : "") << k;
      ADD_FAILURE() << "rank " << who.str() << ": " << what;
    }
    if (!ranks[0]["figures"].empty()) {
      RecordProperty("figures", ranks[0]["figures"].dump());
      std::cout << "figures (rank 0): " << ranks[0]["figures"].dump() << "\n";
    }
  }

 private:
  std::string name_;
  int world_;
};

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
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
    std::string full;
    int world = 0;
    if (!(in >> full >> world)) continue;
    const auto dot = full.find('.');
    const std::string suite = full.substr(0, dot), name = full.substr(dot + 1);
    testing::RegisterTest(suite.c_str(), name.c_str(), nullptr, nullptr, __FILE__, __LINE__,
                          [full, world]() -> testing::Test* { return new Scenario(full, world); });
    ++n;
  }
  if (::pclose(p) != 0 || n == 0) {
    std::fprintf(stderr, "test_conformance: %s listed no scenarios\n", list.c_str());
    return 1;
  }
  return RUN_ALL_TESTS();
}
