// Initialization: sync_module_states (paper §3.1: ranks that start from different weights must be
// made equal before training).
#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;

std::vector<json> run_worker(const std::string& mode, int world, const std::string& flags) {
  const std::string out = fsdp_test::temp_prefix(mode);
  auto run = fsdp_test::sh(fsdp_test::worker() + " " + mode + " --nproc-per-node " + std::to_string(world) + " " + flags +
                           " --out " + out);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  std::vector<json> ranks;
  if (run.exit_code != 0) return ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(fsdp_test::read_json(out + "." + std::to_string(r) + ".json"));
    std::remove((out + "." + std::to_string(r) + ".json").c_str());
  }
  return ranks;
}

// Ranks seeded differently: with sync_module_states every rank holds rank 0's weights and trains
// like local training from them; without it (the control) they do not.
TEST(SyncModuleStates, DifferentlySeededRanksStartEqual) {
  const int world = 3;
  const auto synced = run_worker("sync", world, "--sync-module-states 1");
  ASSERT_EQ(synced.size(), static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(synced[static_cast<size_t>(r)]["initial_diff"].get<double>(), 0.0) << "rank " << r;
    EXPECT_LE(synced[static_cast<size_t>(r)]["max_param_diff"].get<double>(), 1e-5) << "rank " << r;
  }
  const auto unsynced = run_worker("sync", world, "--sync-module-states 0");
  ASSERT_EQ(unsynced.size(), static_cast<size_t>(world));
  EXPECT_GT(unsynced[1]["initial_diff"].get<double>(), 1e-3) << "the control must start apart";
}

}  // namespace
