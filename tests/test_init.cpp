// Initialization (paper §3.1): deferred initialization equals normal construction plus sharding,
// bit for bit, within a memory bound; sync_module_states makes differently seeded ranks equal.
#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;


// Ranks seeded differently: with sync_module_states every rank holds rank 0's weights and trains
// like local training from them; without it (the control) they do not.
TEST(SyncModuleStates, DifferentlySeededRanksStartEqual) {
  const int world = 3;
  const auto synced = fsdp_test::expect_ranks("sync", world, "--sync-module-states 1");
  ASSERT_EQ(synced.size(), static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(synced[static_cast<size_t>(r)]["initial_diff"].get<double>(), 0.0) << "rank " << r;
    EXPECT_LE(synced[static_cast<size_t>(r)]["max_param_diff"].get<double>(), 1e-5) << "rank " << r;
  }
  const auto unsynced = fsdp_test::expect_ranks("sync", world, "--sync-module-states 0");
  ASSERT_EQ(unsynced.size(), static_cast<size_t>(world));
  EXPECT_GT(unsynced[1]["initial_diff"].get<double>(), 1e-3) << "the control must start apart";
}

// The 8-block GPT and a model initialized the libtorch way (kaiming defaults of Conv2d and Linear,
// xavier_normal_ and kaiming_normal_ calls, a padding row zeroed through a view, torch::randn,
// BatchNorm buffers): built with deferred_init and sharded, every shard and buffer equals the
// normal construction's bit for bit, the random number generator continues from the same state
// afterwards, and two training steps (GPT) keep the two models bitwise equal.
TEST(DeferredInit, EqualsNormalConstructionBitForBit) {
  for (const std::string model : {"gpt", "zoo"}) {
    for (int world : {2, 3}) {
      const auto ranks = fsdp_test::expect_ranks("deferred", world, "--model " + model);
      ASSERT_EQ(ranks.size(), static_cast<size_t>(world));
      for (const auto& j : ranks) {
        const std::string what = model + " W=" + std::to_string(world) + " " + j.dump();
        EXPECT_TRUE(j["was_deferred"].get<bool>()) << "every parameter must be unallocated before sharding; " << what;
        EXPECT_TRUE(j["bitwise_equal"].get<bool>()) << what;
        EXPECT_TRUE(j["rng_continues_equal"].get<bool>()) << what;
        EXPECT_TRUE(j["trains_equal"].get<bool>()) << "two SGD steps after materialization; " << what;
        const std::string refusal = j["refusal"];
        EXPECT_NE(refusal.find("aten::sum"), std::string::npos) << "a constructor reading a deferred value is refused, "
                                                                   "naming the operator: " << refusal;
      }
    }
  }
}

// Peak CPU tensor memory while building and sharding the 8-block GPT (libtorch's allocator,
// measured): deferred stays within the largest unit plus this rank's shards, plus 256 KiB for the
// generator states recorded for units not materialized yet (about 5 KB per random op); normal
// construction holds the whole model plus the shards.
TEST(DeferredInit, PeakMemoryStaysWithinLargestUnitPlusShards) {
  const auto ranks = fsdp_test::expect_ranks("deferred", 2, "--model gpt");
  ASSERT_EQ(ranks.size(), 2u);
  for (const auto& j : ranks) {
    const int64_t bound = j["largest_unit_bytes"].get<int64_t>() + j["shard_bytes"].get<int64_t>() + 256 * 1024;
    EXPECT_LE(j["deferred_peak_bytes"].get<int64_t>(), bound) << j.dump();
    EXPECT_LT(j["deferred_peak_bytes"].get<int64_t>(), j["normal_peak_bytes"].get<int64_t>() * 6 / 10) << j.dump();
  }
}

}  // namespace
