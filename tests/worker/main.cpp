// fsdp-test-worker: one rank of a multi-process test (see worker.h); MODE picks the file that runs.
#include <fstream>
#include <iostream>
#include <map>

#include "fsdp/launch.h"
#include "worker.h"

namespace worker {
namespace {

const std::map<std::string, Mode>& modes() {
  static const std::map<std::string, Mode> table = {
      {"parity", run_parity},       {"accounting", run_accounting}, {"structure", run_structure},
      {"overlap", run_overlap},     {"dynamic", run_dynamic},       {"precision", run_precision},
      {"scaler", run_scaler},       {"sync", run_sync},             {"deferred", run_deferred},
      {"fuzz", run_fuzz},           {"fault", run_fault},           {"misuse", run_misuse},
      {"summon", run_summon},       {"checkpoint", run_checkpoint},
      {"recompute", run_recompute}, {"holes", run_holes},
      {"checkpoint_hostile", run_checkpoint_hostile}, {"checkpoint_ignored", run_checkpoint_ignored},
      {"wire", run_wire},           {"phases", run_phases},
      {"tensor_parallel", run_tensor_parallel},
  };
  return table;
}

int run(const Args& a) {
  torch::set_num_threads(1);
  const auto mode = modes().find(a.mode);
  if (mode == modes().end()) throw std::invalid_argument("unknown mode '" + a.mode + "'");
  if (a.device == "cuda") {
    if (!torch::cuda::is_available()) throw std::invalid_argument("--device cuda: no CUDA device visible");
    const auto env = fsdp::LaunchEnv::from_environment();
    g_device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank % torch::cuda::device_count()));
    c10::impl::getDeviceGuardImpl(torch::kCUDA)->setDevice(g_device);
  } else if (a.device != "cpu") {
    throw std::invalid_argument("--device must be cpu or cuda");
  }
  auto mesh = fsdp::Mesh::create(fsdp::LaunchEnv::from_environment());
  const json result = mode->second(mesh, a);
  if (!result.is_null()) std::ofstream(a.out + "." + std::to_string(mesh->rank()) + ".json") << result.dump(1, ' ', false, json::error_handler_t::replace) << "\n";
  return 0;
}

}  // namespace
}  // namespace worker

int main(int argc, char** argv) {
  try {
    if (auto code = fsdp::maybe_launch_local(&argc, &argv)) return *code;  // a rank goes on, forked
    return worker::run(worker::parse(argc, argv));
  } catch (const c10::Error& e) {
    // One write per line: ranks share the terminal.
    std::cerr << (std::string("fsdp-test-worker: error: ") + e.what_without_backtrace() + "\n") << std::flush;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << (std::string("fsdp-test-worker: error: ") + e.what() + "\n") << std::flush;
    return 1;
  }
}
