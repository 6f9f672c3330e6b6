// The edges of "a loop correct in plain libtorch is correct under fsdp" (issue 24): the loops an
// outside review wrote, each exact against local training under every strategy or refused by a
// message that names the call and what to do instead. tests/worker/holes.cpp runs each loop on two
// ranks against a local model of the global batch.
#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;

const char* kStrategies[] = {"full_shard", "shard_grad_op", "no_shard", "hybrid_shard"};

std::string flags_for(const std::string& strategy) {
  return "--strategy " + strategy + (strategy == "hybrid_shard" ? " --shard-size 2" : "");
}
int world_for(const std::string& strategy) { return strategy == "hybrid_shard" ? 4 : 2; }

// Every rank's parameters equal local training's (within fp32 rounding), and nothing was thrown.
void expect_exact(const std::string& hole, const std::string& extra = "") {
  for (const std::string strategy : kStrategies) {
    const auto ranks = fsdp_test::expect_ranks("holes", world_for(strategy), flags_for(strategy) + " --case " + hole + extra);
    ASSERT_EQ(ranks.size(), static_cast<size_t>(world_for(strategy))) << hole << " " << strategy;
    for (const auto& j : ranks) {
      EXPECT_EQ(j["error"], "") << hole << " " << strategy << ": " << j.dump();
      EXPECT_LE(j.value("max_param_diff", 1.0), 2e-5) << hole << " " << strategy << ": " << j.dump();
    }
  }
}

// 1. A second backward on a forward still alive: two towers of one forward, two forwards.
TEST(Holes, SecondTowerBackwardedAfterTheFirst) { expect_exact("two_towers"); }
TEST(Holes, TwoForwardsBackwardedOneAfterTheOther) { expect_exact("two_forwards"); }
// 2. An Embedding with max_norm writes its weight in forward: the writes reach the shards.
TEST(Holes, InPlaceWritesToParametersInForwardReachTheShards) { expect_exact("max_norm"); }
// 2'. ... and under mixed precision, where they cannot be exact, they are refused by name.
TEST(Holes, InPlaceWritesUnderMixedPrecisionAreRefused) {
  const auto ranks = fsdp_test::expect_ranks("holes", 2, "--strategy full_shard --case max_norm --mixed-precision bf16");
  for (const auto& j : ranks) {
    EXPECT_NE(j["error"].get<std::string>().find("in place"), std::string::npos) << j.dump();
    EXPECT_NE(j["error"].get<std::string>().find("mixed precision"), std::string::npos) << j.dump();
  }
}
// 3. torch::autograd::grad with respect to parameters: refused by name; the wrapper stays usable.
TEST(Holes, GradOfParametersIsRefusedByName) {
  for (const std::string strategy : kStrategies) {
    const auto ranks = fsdp_test::expect_ranks("holes", world_for(strategy), flags_for(strategy) + " --case grad_of_params");
    for (const auto& j : ranks) {
      EXPECT_NE(j["error"].get<std::string>().find("torch::autograd::grad"), std::string::npos) << strategy << " " << j.dump();
      EXPECT_NE(j["error"].get<std::string>().find("backward()"), std::string::npos) << strategy << " " << j.dump();
      EXPECT_EQ(j["after"], "") << strategy << " " << j.dump();
    }
  }
}
// 4. requires_grad turned on after wrapping (progressive unfreezing).
TEST(Holes, ParametersUnfrozenAfterWrappingTrainExactly) { expect_exact("unfreeze"); }
// 5. A wrapped teacher called inside a wrapped student's forward.
TEST(Holes, NestedRootsTrainExactly) { expect_exact("nested_roots"); }
// 7. An exception in backward or forward: the next steps train exactly.
TEST(Holes, TrainingContinuesAfterAnExceptionInBackward) { expect_exact("backward_throws"); }
TEST(Holes, TrainingContinuesAfterAnExceptionInForward) { expect_exact("forward_throws"); }
// 8. A kernel that reads weights by raw pointer, inside an unshard() scope.
TEST(Holes, RawPointerKernelInsideUnshardIsExact) { expect_exact("raw_pointer"); }
// 6. Frozen units in the gradient path are freed as backward passes them: a trainable first layer
// before 6 frozen blocks holds at most 2 blocks gathered (the one computing and the prefetched
// next), by fsdp's counters and by the live tensor bytes the process holds.
TEST(Holes, FrozenBlocksAreFreedAsBackwardPassesThem) {
  const auto ranks = fsdp_test::expect_ranks("holes", 2, "--strategy full_shard --case frozen_blocks");
  for (const auto& j : ranks) {
    EXPECT_LE(j["gathered_blocks_peak"].get<double>(), 2.01) << j.dump();
    // The live bytes' peak in backward above its start: the gathered blocks, the trainable layers'
    // gradients and their reduction (about one block each), and activations' gradients (small).
    EXPECT_LE(j["backward_live_peak_blocks"].get<double>(), 4.5) << j.dump();
  }
}

// 9. Clipping or stepping with unreduced no_sync gradients: refused; the synchronized loop is exact.
TEST(Holes, ClipAndStepAfterNoSyncAreRefused) {
  for (const std::string strategy : kStrategies) {
    const auto ranks = fsdp_test::expect_ranks("holes", world_for(strategy), flags_for(strategy) + " --case no_sync_clip");
    for (const auto& j : ranks) {
      const std::string what = strategy + " " + j.dump();
      EXPECT_NE(j.value("clip_during_no_sync", "").find("no_sync"), std::string::npos) << what;
      EXPECT_NE(j.value("step_during_no_sync", "").find("no_sync"), std::string::npos) << what;
      EXPECT_NE(j.value("fused_adamw_during_no_sync", "").find("no_sync"), std::string::npos) << what;
      EXPECT_NE(j.value("fused_sgd_during_no_sync", "").find("no_sync"), std::string::npos) << what;
      EXPECT_EQ(j["error"], "") << what;
      EXPECT_LE(j.value("max_param_diff", 1.0), 2e-5) << what;
    }
  }
}

}  // namespace
