// The conformance suite: PyTorch FSDP1's and FSDP2's and DeepSpeed ZeRO's own test scenarios
// (docs/conformance.md maps every one of them), written as a libtorch user writes them: through
// the public headers only (include/fsdp/), each scenario a loop run under fsdp and the same loop
// in plain libtorch on the whole batch (the oracle), or a misuse that must be refused by a message
// that names the call and what to do.
//
// fsdp-conformance is one rank of such a scenario:
//   fsdp-conformance --list                        every scenario: "Suite.Name world_size file" per line
//   fsdp-conformance --peers                       "Suite.Name<TAB>peer" per line: the map rows ("#117")
//                                                  and peer tests it ports (docs/conformance.md)
//   fsdp-conformance --case Suite.Name[,Suite.Other...] --nproc-per-node W --out PREFIX
// The ranks run the scenarios one after another in one process each (a process start and a
// rendezvous cost more than most scenarios), from the same fresh generator seed, agreeing on which
// scenario comes next before each. After each, every rank writes PREFIX.<Suite.Name>.<rank>.json:
// {"case", "rank", "failures": [...], "figures": {...}}; a scenario after which the ranks no longer
// agree ends the run there.
// tests/conformance/test_conformance.cpp makes one gtest test of each scenario; ctest runs one
// source file's scenarios per test (test_conformance --file STEM).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "fsdp/checkpoint.h"
#include "fsdp/fsdp.h"

namespace conformance {

using json = nlohmann::json;

// What one rank of a scenario sees and records.
struct Ctx {
  std::shared_ptr<fsdp::Mesh> mesh;
  int rank = 0, world = 1;
  std::string variant;  // the configuration running now ("full_shard F=4", ...), in every failure
  std::vector<std::string> failures;
  json figures = json::object();

  void fail(const std::string& what);
  void expect(bool ok, const std::string& what) {
    if (!ok) fail(what);
  }
  // |got - want| <= tol, else a failure naming `what`, both values and the tolerance.
  void expect_near(const std::string& what, double got, double want, double tol);
  // `fn` must throw, with a message holding every one of `says` (what was refused and what to do).
  void expect_refused(const std::string& what, const std::function<void()>& fn, const std::vector<std::string>& says);
  // `fn` must not throw; what it throws is a failure.
  void expect_ok(const std::string& what, const std::function<void()>& fn);
  // Records the largest value of figure `key` under this variant.
  void figure(const std::string& key, double value);
};

// One configuration a scenario runs under.
struct Variant {
  std::string name;  // "full_shard F=4", "hybrid_shard F=2 bf16"
  fsdp::Options options;
  bool mixed_precision() const { return options.mixed_precision.has_value(); }
};
// Every sharding strategy this world size can show: full_shard, shard_grad_op and no_shard, and at
// W = 4 hybrid_shard and hybrid_shard_zero2 with F = 2. With `bf16`, each again under bf16 mixed
// precision (param, reduce and buffer dtype).
std::vector<Variant> every_strategy(const Ctx& c, bool bf16 = false);
Variant strategy(const Ctx& c, const std::string& name);  // one of them by its strategy name

// Runs `body` once per variant, with c.variant set; an exception escaping it is a failure of that
// variant (the scenario goes on with the next), and every rank agrees before the next variant so
// that one rank's failure cannot leave the others waiting in a collective.
void for_each(Ctx& c, const std::vector<Variant>& variants, const std::function<void(const Variant&)>& body);

// Rows [r * B/W, (r+1) * B/W) of a global batch: this rank's part.
torch::Tensor my_rows(const Ctx& c, const torch::Tensor& global);
// The mean over ranks of a per-rank value (each rank's loss is the mean over its rows).
double global_mean(const Ctx& c, double local);
// Seeded inputs: a [rows, cols...] normal tensor from generator `seed` (the same on every rank).
torch::Tensor randn(uint64_t seed, at::IntArrayRef sizes);
torch::Tensor randint(uint64_t seed, int64_t high, at::IntArrayRef sizes);

// Every parameter (and buffer, with `buffers`) of a module by name, detached copies (a tied weight
// under each of its names).
std::map<std::string, torch::Tensor> state_of(torch::nn::Module& m, bool buffers = true);
// Every parameter and buffer of `mine` (the module `wrapped` wraps) whole, on every rank, as
// summon_full_params(writeback = false) shows them.
std::map<std::string, torch::Tensor> whole_state(fsdp::FullyShardedDataParallelBase& wrapped, torch::nn::Module& mine,
                                                 bool buffers = true);
// Largest |wrapped - local| over every parameter (and buffer, with `buffers`) of the local model;
// fails when a name is missing, a shape or dtype differs, or the difference passes `tol`. Records
// figure "max_param_diff".
double expect_same_model(Ctx& c, fsdp::FullyShardedDataParallelBase& wrapped, torch::nn::Module& mine,
                         torch::nn::Module& local, double tol, bool buffers = true);
// The same, for one tensor of each side.
void expect_same_tensor(Ctx& c, const std::string& what, const torch::Tensor& got, const torch::Tensor& want, double tol);

// Unique parameters (a tied weight once, under its first name), as fsdp's parameters() lists them.
std::vector<torch::Tensor> unique_parameters(torch::nn::Module& m);

// The scenario registry.
using CaseFn = std::function<void(Ctx&)>;
struct Case {
  std::string suite, name;
  int world = 4;
  std::string peer;  // the peer test(s) it ports
  CaseFn fn;
  std::string file;  // the source file's stem ("activation_checkpoint"): ctest runs a file's scenarios together
  std::string full_name() const { return suite + "." + name; }
};
int register_case(Case c);
const std::vector<Case>& cases();

}  // namespace conformance

// CONFORMANCE_CASE(Suite, Name, W, "peer test") { ... c is the Ctx ... }
#define CONFORMANCE_CASE(Suite, Name, World, Peer)                                                         \
  static void Suite##_##Name(::conformance::Ctx& c);                                                      \
  [[maybe_unused]] static const int Suite##_##Name##_registered =                                         \
      ::conformance::register_case({#Suite, #Name, World, Peer, Suite##_##Name, __FILE__});                         \
  static void Suite##_##Name([[maybe_unused]] ::conformance::Ctx& c)
