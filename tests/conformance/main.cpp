// fsdp-conformance: one rank of a run of conformance scenarios (conformance.h).
#include <algorithm>
#include <fstream>
#include <iostream>

#include "conformance.h"
#include "fsdp/launch.h"

namespace {

int run(int argc, char** argv) {
  std::string which, out = "/tmp/fsdp-conformance";
  bool list = false, peers = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--list") list = true;
    else if (a == "--peers") peers = true;
    else if (a == "--case" && i + 1 < argc) which = argv[++i];
    else if (a == "--out" && i + 1 < argc) out = argv[++i];
    else throw std::invalid_argument("fsdp-conformance: unknown argument " + a +
                                     " (use --list, --peers, or --case Suite.Name[,Suite.Name...] --nproc-per-node W --out PREFIX)");
  }
  auto cases = conformance::cases();
  std::sort(cases.begin(), cases.end(), [](const auto& a, const auto& b) { return a.full_name() < b.full_name(); });
  if (list) {
    for (const auto& c : cases) std::cout << c.full_name() << " " << c.world << " " << c.file << "\n";
    return 0;
  }
  if (peers) {  // what docs/conformance.md is made from (scripts/conformance_table)
    for (const auto& c : cases) std::cout << c.full_name() << "\t" << c.peer << "\n";
    return 0;
  }
  std::vector<const conformance::Case*> chosen;
  for (size_t at = 0; at <= which.size();) {
    const size_t comma = std::min(which.find(',', at), which.size());
    const std::string name = which.substr(at, comma - at);
    at = comma + 1;
    auto it = std::find_if(cases.begin(), cases.end(), [&](const auto& c) { return c.full_name() == name; });
    if (it == cases.end()) throw std::invalid_argument("fsdp-conformance: no scenario '" + name + "' (see --list)");
    chosen.push_back(&*it);
  }
  torch::set_num_threads(1);
  auto mesh = fsdp::Mesh::create(fsdp::LaunchEnv::from_environment());
  for (size_t i = 0; i < chosen.size(); ++i) {
    const auto& scenario = *chosen[i];
    if (mesh->world_size() != scenario.world) {
      throw std::invalid_argument("fsdp-conformance: " + scenario.full_name() + " runs on " +
                                  std::to_string(scenario.world) + " ranks, not " + std::to_string(mesh->world_size()));
    }
    // The ranks agree on which scenario comes next: one whose ranks went different ways (a rank
    // that threw in the middle of a collective the others finished) must not pair its leftover
    // collectives with the next scenario's. The max of (i, -i) over ranks is (i, -i) only when
    // every rank is at i.
    std::vector<at::Tensor> at_case{torch::tensor({double(i), -double(i)}, torch::kDouble)};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    mesh->world()->allreduce(at_case, max)->wait();
    if (i > 0 && (at_case[0][0].item<double>() != double(i) || at_case[0][1].item<double>() != -double(i))) {
      throw std::runtime_error("fsdp-conformance: the ranks no longer agree on the scenario after " +
                               chosen[i - 1]->full_name() + ": the scenarios after it did not run");
    }
    // Each scenario starts from the generator a fresh process has, as if it ran alone.
    torch::manual_seed(c10::default_rng_seed_val);
    conformance::Ctx c;
    c.mesh = mesh;
    c.rank = mesh->rank();
    c.world = mesh->world_size();
    c.expect_ok("the scenario", [&] { scenario.fn(c); });
    conformance::json result{
        {"case", scenario.full_name()}, {"rank", c.rank}, {"failures", c.failures}, {"figures", c.figures}};
    std::ofstream(out + "." + scenario.full_name() + "." + std::to_string(c.rank) + ".json")
        << result.dump(1, ' ', false, conformance::json::error_handler_t::replace) << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (auto code = fsdp::maybe_launch_local(&argc, &argv)) return *code;  // a rank goes on, forked
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::cerr << (std::string("fsdp-conformance: error: ") + e.what_without_backtrace() + "\n") << std::flush;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << (std::string("fsdp-conformance: error: ") + e.what() + "\n") << std::flush;
    return 1;
  }
}
