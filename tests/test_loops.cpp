// Equal to local training under every loop a user writes (issue: loop-shape independence), and
// clear errors where a loop leaves the supported path.
//
// The loop fuzzer (tests/worker/fuzz.cpp) draws sequences of zero_grad / forward (one or two
// losses, NoGradGuard, InferenceMode, never backwarded, throwing) / backward (of the sum, with
// retain_graph, of each loss apart, with a hook that throws) / no_sync / clip / step (refused after
// no_sync) / autograd::grad of the parameters (refused) / freezing and unfreezing / unshard()
// calls, on models whose forward returns one of seven C++ types, with SGD, Adam or AdamW, an
// embedding that writes its weight in forward, a frozen block and a nested wrapped teacher, and
// compares losses, gradients and parameters with local training (fp32) or the replayed casts of
// mixed precision (bf16, also held against the same loop in fp32) after every call. Here: fixed
// seeds for every strategy and both ways of knowing when a unit runs (360 sequences), then named
// sequences for each loop the issues list. scripts/fuzz runs it over more seeds.
#include <gtest/gtest.h>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;

struct Config {
  std::string strategy;
  int world;
  int shard_size;
  std::string precision;
  std::string extra = "";  // record_function detection, forward prefetch
  int seeds = 20;
};
std::string name_of(const Config& c) {
  std::string extra;
  if (c.extra.find("record_function") != std::string::npos) extra += "_record_function";
  if (c.extra.find("forward-prefetch") != std::string::npos) extra += "_forward_prefetch";
  if (c.extra.find("--hpz") != std::string::npos) extra += "_hpz";
  return c.strategy + "_W" + std::to_string(c.world) + (c.shard_size ? "_F" + std::to_string(c.shard_size) : "") +
         "_" + c.precision + extra;
}
// A failure names its configuration, not the struct's bytes.
void PrintTo(const Config& c, std::ostream* os) { *os << name_of(c) << " (" << c.seeds << " seeds)"; }
std::string flags_of(const Config& c) {
  return "--strategy " + c.strategy + (c.shard_size ? " --shard-size " + std::to_string(c.shard_size) : "") +
         " --mixed-precision " + c.precision + (c.extra.empty() ? "" : " " + c.extra);
}

// Every rank's failures (each with its seed, its sequence and the first difference).
void expect_no_failures(const fsdp_test::RankResults& r, const std::string& what) {
  ASSERT_EQ(r.run.exit_code, 0) << what << "\n" << r.run.output;
  for (const auto& rank : r.ranks) {
    for (const auto& f : rank["failures"]) {
      ADD_FAILURE() << what << " rank " << rank["rank"] << " seed " << f["seed"] << " (replay: fsdp-test-worker fuzz "
                    << "--seeds " << f["seed"] << ":" << f["seed"].get<int>() + 1 << " ...):\n  " << f["failure"].get<std::string>();
    }
  }
}

class Fuzz : public testing::TestWithParam<Config> {};

TEST_P(Fuzz, FixedSeedsMatchTheReference) {
  const auto& c = GetParam();
  const auto r = fsdp_test::run_ranks("fuzz", c.world, flags_of(c) + " --seeds 0:" + std::to_string(c.seeds));
  expect_no_failures(r, name_of(c));
}

const Config kConfigs[] = {
    {"full_shard", 2, 0, "none"},        {"full_shard", 3, 0, "bf16"},        {"shard_grad_op", 2, 0, "bf16"},
    {"shard_grad_op", 3, 0, "none"},     {"no_shard", 2, 0, "none"},          {"no_shard", 3, 0, "bf16"},
    {"hybrid_shard", 4, 2, "none"},      {"hybrid_shard", 4, 2, "bf16"},      {"hybrid_shard_zero2", 4, 2, "none"},
    {"hybrid_shard_zero2", 4, 2, "bf16"}, {"full_shard", 2, 0, "bf16"},       {"full_shard", 3, 0, "none"},
    {"shard_grad_op", 2, 0, "none"},     {"shard_grad_op", 3, 0, "bf16"},     {"no_shard", 2, 0, "bf16"},
    {"no_shard", 3, 0, "none"},
    {"full_shard", 2, 0, "none", "--unit-detection record_function", 10},
    {"hybrid_shard", 4, 2, "bf16", "--unit-detection record_function", 10},
    {"full_shard", 3, 0, "none", "--forward-prefetch 1", 10},
    {"shard_grad_op", 2, 0, "bf16", "--forward-prefetch 1", 10},
    // hpZ (issue 26): backward gathers the secondary shards forward kept, within pairs of ranks.
    {"full_shard", 4, 0, "none", "--hpz 2", 10},
    {"full_shard", 4, 0, "bf16", "--hpz 2", 10}};
INSTANTIATE_TEST_SUITE_P(Strategies, Fuzz, testing::ValuesIn(kConfigs),
                         [](const testing::TestParamInfo<Config>& i) { return name_of(i.param); });

// A named loop, run as an explicit call sequence on the GPT (seed 0: forward returns a Tensor)
// and on the uneven net with a std::pair result (seed 1), for the strategies that differ most.
void run_sequence(const std::string& sequence) {
  for (const Config& c : {Config{"full_shard", 2, 0, "none"}, Config{"shard_grad_op", 3, 0, "none"},
                          Config{"no_shard", 2, 0, "bf16"}, Config{"hybrid_shard", 4, 2, "none"}}) {
    const auto r = fsdp_test::run_ranks("fuzz", c.world, flags_of(c) + " --seeds 0:2 --sequence " + sequence);
    expect_no_failures(r, sequence + " under " + name_of(c));
  }
}

TEST(Loops, ZeroGradBetweenForwardAndBackward) { run_sequence("Z,F,Z,B,S,F,Z0,B,S"); }
TEST(Loops, ZeroGradBeforeForwardAndAfterStep) { run_sequence("Z,F,B,S,Z0,F,B,S,Z"); }
TEST(Loops, EvalForwardWithAndWithoutNoGradBetweenSteps) { run_sequence("Z,F,B,S,E,G,Z,F,B,S"); }
TEST(Loops, ForwardNeverBackwardedThenStep) { run_sequence("Z,F,B,G,S,Z,F,B,S"); }
TEST(Loops, TwoForwardsThenOneBackward) { run_sequence("Z,F,F,B,S,Z,F,G,F,B,S"); }
TEST(Loops, BackwardTwiceWithRetainGraph) { run_sequence("Z,F,R,B,S,Z,F,R,E,B,S"); }
TEST(Loops, NoSyncMicroBatchesThenSynchronized) { run_sequence("Z,N,N,F,B,C,S"); }
TEST(Loops, ZeroGradAfterNoSyncDiscardsIt) { run_sequence("Z,F,B,N,Z,F,B,S,N,Z0,F,B,S"); }
// Issue 24's loops, named: two losses of one forward backwarded apart, two forwards backwarded
// apart, InferenceMode, exceptions in forward and backward, unfreezing, clip after no_sync
// (refused), autograd::grad of the parameters (refused), an unshard() step.
TEST(Loops, LossesBackwardedApart) { run_sequence("Z,A,P,S,Z,F,F,P,S,Z,A,F,P,S"); }
TEST(Loops, InferenceModeForwardsBetweenSteps) { run_sequence("Z,F,B,S,I,I,Z,F,I,B,S"); }
TEST(Loops, TrainingContinuesAfterExceptions) { run_sequence("Z,F,B,S,X,Z,F,Y,Z,F,B,S,X,F,B,S"); }
TEST(Loops, UnfreezingAndFreezing) { run_sequence("Z,F,B,S,T,Z,F,B,S,T,Z,F,B,S"); }
TEST(Loops, ClipAfterNoSyncIsRefusedThenTheSynchronizedLoopIsExact) { run_sequence("Z,N,C,N,F,B,C,S"); }
TEST(Loops, GradOfParametersIsRefusedAndTrainingGoesOn) { run_sequence("Z,F,Q,Z,F,B,S"); }
TEST(Loops, UnshardScopeStep) { run_sequence("Z,U,S,Z,U,C,S"); }

// Issue 35: the two paths that silently regressed, as random loops. A Linear shared by the second
// and third blocks of the tied net (units of their own, neither the root), and a second wrapped
// model whose output is the first one's input (both trained), under the hybrid strategies at W = 4
// (where both went wrong) and full_shard; fp32, and bf16 for the tied net.
void run_features(const std::string& features, const std::vector<Config>& configs, const std::string& seeds) {
  for (const Config& c : configs) {
    const auto r = fsdp_test::run_ranks("fuzz", c.world, flags_of(c) + " --features " + features + " --seeds " + seeds);
    expect_no_failures(r, features + " under " + name_of(c));
  }
}
TEST(Loops, WeightSharedByTwoInnerUnits) {
  run_features("tied", {Config{"hybrid_shard", 4, 2, "none"}, Config{"hybrid_shard_zero2", 4, 2, "none"},
                        Config{"hybrid_shard", 4, 2, "bf16"}, Config{"full_shard", 4, 0, "none"}}, "0:6");
}
TEST(Loops, TwoWrappedModelsTrainedTogether) {
  run_features("uneven,two_roots", {Config{"hybrid_shard", 4, 2, "none"}, Config{"hybrid_shard_zero2", 4, 2, "none"},
                                    Config{"full_shard", 2, 0, "none"}, Config{"no_shard", 2, 0, "none"}}, "0:6");
  run_features("tied,two_roots", {Config{"hybrid_shard", 4, 2, "none"}}, "0:4");
}

// Every output type the forward may return (std::pair, a struct, std::map, torch::Dict, IValue,
// nested containers), through a whole training loop.
TEST(Loops, ForwardOutputsOfAnyType) {
  for (const Config& c : {Config{"full_shard", 2, 0, "none"}, Config{"no_shard", 2, 0, "none"}}) {
    const auto r = fsdp_test::run_ranks("fuzz", c.world, flags_of(c) + " --seeds 0:7 --sequence Z,F,B,S,Z,F,B,S");
    expect_no_failures(r, name_of(c));
  }
}

// Stepping outside the supported path: each case says what happened and what to do instead.
TEST(Misuse, ClearErrorsInsteadOfWrongResults) {
  for (const std::string strategy : {"full_shard", "shard_grad_op"}) {
    const auto ranks = fsdp_test::expect_ranks("misuse", 2, "--strategy " + strategy);
    ASSERT_EQ(ranks.size(), 2u);
    for (const auto& j : ranks) {
      const std::string what = strategy + " " + j.dump();
      EXPECT_NE(j["direct_call"].get<std::string>().find("outside the root's forward"), std::string::npos) << what;
      EXPECT_NE(j["direct_call"].get<std::string>().find("summon_full_params"), std::string::npos) << what;
      EXPECT_EQ(j["wrapped_call"], "") << what;
      EXPECT_LT(j["shard_numel"].get<int64_t>(), j["full_numel"].get<int64_t>()) << "outside forward: the shard; " << what;
      EXPECT_NE(j["to_after_wrap"].get<std::string>().find("no longer holds this rank's shard"), std::string::npos) << what;
      EXPECT_NE(j["set_data_after_wrap"].get<std::string>().find("'ln_f.weight'"), std::string::npos) << what;
      EXPECT_NE(j["step_before_backward"].get<std::string>().find("while it is gathered for a backward"), std::string::npos) << what;
      EXPECT_EQ(j["backward_after_refusal"], "") << what;
      EXPECT_EQ(j["step_after_backward"], "") << what;
      // Optimizers that read the gathered parameter before writing it fail in ATen (the gradient is
      // a shard): the error says why, and what to do.
      for (const auto& [name, r] : j["step_before_backward_reads_first"].items()) {
        const std::string e = r["before_backward"];
        EXPECT_NE(e.find("while it is gathered for a backward"), std::string::npos) << name << ": " << what;
        EXPECT_NE(e.find("Run backward first"), std::string::npos) << name << ": " << what;
        EXPECT_EQ(r["backward_after"], "") << name << ": " << what;
        EXPECT_EQ(r["after_backward"], "") << name << ": " << what;
      }
      EXPECT_EQ(j["step_before_backward_reads_first"].size(), 5u) << what;
      // The tied embedding/head once in the wrapper's list, twice in libtorch's.
      EXPECT_EQ(j["unique_parameters"].get<int>() + 1, j["libtorch_parameters"].get<int>()) << what;
      EXPECT_EQ(j["named_first"], "tok_emb.weight") << what;
      // Options::ignored_modules.
      EXPECT_NE(j["ignored_not_in_model"].get<std::string>().find("not a module of the wrapped model"), std::string::npos) << what;
      EXPECT_NE(j["ignored_marked"].get<std::string>().find("both marked with fully_shard()"), std::string::npos) << what;
      EXPECT_FALSE(j["ignored_in_a_unit"].get<bool>()) << what;
      EXPECT_TRUE(j["ignored_kept_own_value"].get<bool>()) << "sync_module_states leaves ignored parameters alone; " << what;
      EXPECT_EQ(j["synced_value"].get<double>(), 1.0) << "rank 0's values for the others; " << what;
      EXPECT_TRUE(j["ignored_grad_whole"].get<bool>()) << what;
      EXPECT_EQ(j["ignored_listed"].get<int>(), j["unique_parameters"].get<int>()) << "still in parameters(); " << what;
      EXPECT_NE(j["ignored_checkpoint"].get<std::string>().find("ignored parameter 'pos_emb.weight' is replicated"),
                std::string::npos) << what;
      EXPECT_NE(j["ignored_checkpoint"].get<std::string>().find("rank 1 holds another value than rank 0"),
                std::string::npos) << what;
      EXPECT_TRUE(j["ignored_replicated_saved"].get<bool>()) << "equal on every rank, it is saved; " << what;
      // Tensor parallelism: plans that cannot apply, and a split model fsdp would train wrong.
      EXPECT_NE(j["tp_rule_matches_nothing"].get<std::string>().find("matches no parameter"), std::string::npos) << what;
      EXPECT_NE(j["tp_not_divisible"].get<std::string>().find("does not divide it"), std::string::npos) << what;
      EXPECT_NE(j["tp_twice"].get<std::string>().find("split already"), std::string::npos) << what;
      EXPECT_NE(j["tp_without_option"].get<std::string>().find("Options::tensor_parallel is not set"), std::string::npos) << what;
      EXPECT_NE(j["tp_over_world"].get<std::string>().find("wrap the model over tensor_parallel->data_parallel()"),
                std::string::npos) << what;
      EXPECT_NE(j["tp_sharded_state_dict"].get<std::string>().find("use full_state_dict"), std::string::npos) << what;
      EXPECT_EQ(j["tp_local_rows"].get<int64_t>() * 2, j["tp_whole_rows"].get<int64_t>() * 32) << what;
    }
  }
}

// summon_full_params: whole parameters equal to local training's on every rank, the master dtype,
// rank0_only, and weight surgery written back into the shards.
TEST(SummonFullParams, WholeParametersAndWriteback) {
  struct Case {
    std::string flags;
    int world;
  };
  for (const Case& c : {Case{"--strategy full_shard", 2}, Case{"--strategy shard_grad_op", 3},
                        Case{"--strategy hybrid_shard --shard-size 2", 4}, Case{"--strategy full_shard --mixed-precision bf16", 2}}) {
    const auto ranks = fsdp_test::expect_ranks("summon", c.world, c.flags);
    ASSERT_EQ(ranks.size(), static_cast<size_t>(c.world)) << c.flags;
    for (const auto& j : ranks) {
      const std::string what = c.flags + " " + j.dump();
      EXPECT_LE(j["full_diff"].get<double>(), 1e-5) << what;
      EXPECT_GE(j["full_diff"].get<double>(), 0.0) << "every parameter whole on every rank; " << what;
      EXPECT_EQ(j["slice_diff"].get<double>(), 0.0) << what;
      EXPECT_EQ(j["dtypes"], json::array({"fp32"})) << what;
      EXPECT_EQ(j["rank0_only_whole"].get<bool>(), j["rank"].get<int>() == 0) << what;
      EXPECT_LE(j["after_surgery_shard_diff"].get<double>(), 1e-5) << what;
      EXPECT_NE(j["forward_inside"].get<std::string>().find("inside summon_full_params"), std::string::npos) << what;
    }
  }
}

}  // namespace
