// fsdp-train's losses, bit for bit, against values recorded with an earlier build (tests/golden/
// train_losses.json): a change that only moves code must not move a single bit of the math, for
// any strategy, with or without prefetch or mixed precision.
//
// The values depend on the floating-point kernels, so the runs pin them: one thread per rank, and
// libtorch's and MKL's and oneDNN's CPU dispatch fixed to AVX2-level code paths that every x86-64
// machine of this project's kind has. Record new values only for a change that is meant to change
// the math, with the same command the test runs, and say why in the commit.
//
// One run is not pinned fully by that: the written-out attention (--attention reference) gave, with
// the same build, a loss 1 float32 ulp apart at step 1 on two machines of this kind (2026-11-30 and
// 2026-12-01; an Intel Xeon with AVX-512 gives the second). Such a case records each machine's
// sequence ("also_recorded"), and a run must equal one of them bit for bit.
#include <gtest/gtest.h>

#include <fstream>

#include "dist_test_util.h"

namespace {

using json = nlohmann::json;

const char* kPinnedKernels = "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 ";

json golden() {
  std::ifstream in(std::string(FSDP_SOURCE_DIR) + "/tests/golden/train_losses.json");
  return json::parse(in);
}

std::vector<std::string> names() {
  std::vector<std::string> out;
  const json all = golden();
  for (const auto& item : all.items()) out.push_back(item.key());
  return out;
}

class Golden : public testing::TestWithParam<std::string> {};

TEST_P(Golden, LossesAreBitwiseThoseRecorded) {
  const json expected = golden()[GetParam()];
  const std::string metrics = fsdp_test::temp_prefix("golden-" + GetParam()) + ".jsonl";
  std::remove(metrics.c_str());
  const std::string cmd = std::string(kPinnedKernels) + fsdp_test::fsdp_train() +
                          " --threads 1 --model tiny --steps 4 --global-batch-size 12 --log-every 100 --data " +
                          FSDP_SOURCE_DIR + "/tests/data/corpus.txt " + expected["args"].get<std::string>() +
                          " --metrics-jsonl " + metrics;
  auto run = fsdp_test::sh(cmd);
  ASSERT_EQ(run.exit_code, 0) << cmd << "\n" << run.output;
  std::vector<double> losses(4, 0.0);
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const json j = json::parse(line);
    if (j["rank"] == 0) losses.at(j["step"].get<size_t>()) = j["loss"].get<double>();
  }
  std::remove(metrics.c_str());
  // Exact: the JSON holds each double's shortest round-trip text on both sides.
  std::vector<std::vector<double>> recorded{expected["losses"].get<std::vector<double>>()};
  if (expected.contains("also_recorded")) {
    for (const auto& other : expected["also_recorded"]) recorded.push_back(other.get<std::vector<double>>());
  }
  for (const auto& want : recorded) {
    if (want == losses) return;
  }
  const auto& want = recorded.front();
  ASSERT_EQ(want.size(), losses.size());
  for (size_t s = 0; s < want.size(); ++s) {
    EXPECT_EQ(losses[s], want[s]) << GetParam() << " step " << s << ": " << cmd;
  }
  ADD_FAILURE() << GetParam() << ": equal to none of the " << recorded.size() << " recorded sequences";
}

INSTANTIATE_TEST_SUITE_P(TrainingRuns, Golden, testing::ValuesIn(names()),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
