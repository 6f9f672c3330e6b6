// fsdp-conformance: one rank of a conformance scenario (conformance.h).
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
                                     " (use --list, --peers, or --case Suite.Name --nproc-per-node W --out PREFIX)");
  }
  auto cases = conformance::cases();
  std::sort(cases.begin(), cases.end(), [](const auto& a, const auto& b) { return a.full_name() < b.full_name(); });
  if (list) {
    for (const auto& c : cases) std::cout << c.full_name() << " " << c.world << "\n";
    return 0;
  }
  if (peers) {  // what docs/conformance.md is made from (scripts/conformance_table)
    for (const auto& c : cases) std::cout << c.full_name() << "\t" << c.peer << "\n";
    return 0;
  }
  auto it = std::find_if(cases.begin(), cases.end(), [&](const auto& c) { return c.full_name() == which; });
  if (it == cases.end()) throw std::invalid_argument("fsdp-conformance: no scenario '" + which + "' (see --list)");
  torch::set_num_threads(1);
  conformance::Ctx c;
  c.mesh = fsdp::Mesh::create(fsdp::LaunchEnv::from_environment());
  c.rank = c.mesh->rank();
  c.world = c.mesh->world_size();
  if (c.world != it->world) {
    throw std::invalid_argument("fsdp-conformance: " + which + " runs on " + std::to_string(it->world) + " ranks, not " +
                                std::to_string(c.world));
  }
  c.expect_ok("the scenario", [&] { it->fn(c); });
  conformance::json result{{"case", which}, {"rank", c.rank}, {"failures", c.failures}, {"figures", c.figures}};
  std::ofstream(out + "." + std::to_string(c.rank) + ".json")
      << result.dump(1, ' ', false, conformance::json::error_handler_t::replace) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (auto code = fsdp::maybe_launch_local(argc, argv)) return *code;
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::cerr << (std::string("fsdp-conformance: error: ") + e.what_without_backtrace() + "\n") << std::flush;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << (std::string("fsdp-conformance: error: ") + e.what() + "\n") << std::flush;
    return 1;
  }
}
