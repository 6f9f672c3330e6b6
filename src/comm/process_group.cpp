// How the mesh's process groups are built (Gloo for CPU tensors, NCCL for CUDA ones, stand-ins for
// a simulated mesh), each CPU group with the log of what this rank issued on it (collective_log.h).
#include <stdexcept>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "comm/mesh_state.h"
#include "comm/simulated_backend.h"

namespace fsdp::detail {

GroupPtr MeshState::make_group(const std::string& name, int group_rank, int group_size, c10::DeviceType device) {
  return make_group_on(store, name, group_rank, group_size, device);
}

GroupPtr MeshState::make_group_on(const c10::intrusive_ptr<c10d::Store>& on, const std::string& name, int group_rank,
                                  int group_size, c10::DeviceType device) {
  GroupPtr group = build_group(on, name, group_rank, group_size, device);
  // A CPU group's waits block the calling thread, so a long one can compare the ranks' logs. (A
  // CUDA group's waits return at once; NCCL's own watchdog and flight recorder cover it.)
  if (device == c10::DeviceType::CPU && !simulated) {
    logs[group.get()] = std::make_shared<CollectiveLog>(c10::make_intrusive<c10d::PrefixStore>("fsdp/log/" + name, on),
                                                        name, group_rank, group_size, env.rank,
                                                        options.compare_collectives_after);
    logs[group.get()]->set_group(group);
  }
  return group;
}

std::shared_ptr<CollectiveLog> MeshState::log_for(const GroupPtr& group) const {
  const auto it = logs.find(group.get());
  return it == logs.end() ? nullptr : it->second;
}

GroupPtr MeshState::build_group(const c10::intrusive_ptr<c10d::Store>& on, const std::string& name, int group_rank,
                                int group_size, c10::DeviceType device) {
  if (simulated) return c10::make_intrusive<SimulatedBackend>(group_rank, group_size);
  if (device == c10::DeviceType::CUDA) {
#ifdef USE_C10D_NCCL
    if (c10::cuda::device_count() == 0) {
      throw std::runtime_error("fsdp: parameters are CUDA tensors but no GPU is visible on rank " +
                               std::to_string(env.rank) + "; move the model to the CPU or run where GPUs are");
    }
    const int local = device_rank >= 0 ? device_rank : env.local_rank;
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(local % c10::cuda::device_count()));
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = options.collective_timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>("fsdp/nccl/" + name, on), group_rank, group_size, opts);
#else
    throw std::runtime_error("fsdp: this build has no NCCL (libtorch without CUDA); CUDA parameters need a CUDA build");
#endif
  }
  auto opts = c10d::ProcessGroupGloo::Options::create(options.collective_timeout);
  opts->devices = gloo_interface.make_devices();
  opts->threads = kGlooThreadsPerGroup;
  try {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("fsdp/pg/" + name, on), group_rank, group_size, opts);
  } catch (const std::exception& e) {
    throw std::runtime_error("fsdp: could not build process group '" + name + "' on rank " +
                             std::to_string(env.rank) + ": a peer rank did not arrive or exited. (" +
                             e.what() + ")");
  }
}

}  // namespace fsdp::detail
