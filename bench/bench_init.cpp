// fsdp-bench-init: time and peak memory of the three ways to build and shard a model (paper §3.1,
// which gave no numbers), for several model sizes, side by side in one run:
//   deferred        fsdp::deferred_init (meta tensors, recorded initialization), then FSDP replays
//                   it unit by unit straight into the flat buffers and keeps the shards
//   build, shard    build the model normally, move it whole to the device, then shard it
//                   (libtorch has no default-device context, so a model whose code is unchanged is
//                   built on the CPU; on a CPU-only machine there is nothing to move)
//   CPU, stream     build it on the CPU, then FSDP moves it to the device unit by unit, sharding
//                   each unit as it arrives (Options::init_device); on a machine without a GPU
//                   the device is the CPU and this is the row above, so it is left out
// Every rank runs every path (same seed) for --repeats rounds; the table shows rank 0's median
// wall time and its peak CPU tensor memory (libtorch's allocator) and, with --device cuda, the
// CUDA allocator's peak.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <thread>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "fsdp/deferred_init.h"
#include "fsdp/fsdp.h"
#include "fsdp/launch.h"
#include "models/gpt.h"
#include "src/memory/device.h"
#include "src/memory/host_memory.h"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Result {
  std::vector<double> seconds;
  int64_t host_peak = 0, device_peak = 0, shard_bytes = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> sizes{"default", "medium", "large"};
  int repeats = 3;
  std::string device_name = "cpu";
  int nproc = 2;
  CLI::App app{"fsdp-bench-init: time and peak memory of deferred init, build-then-shard and CPU streaming"};
  app.add_option("--nproc-per-node", nproc, "ranks (each builds and shards)");
  app.add_option("--models", sizes, "GPT presets (plus 'large': 16 layers, d_model 1024, 201 M parameters)");
  app.add_option("--repeats", repeats, "rounds per path");
  app.add_option("--device", device_name, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  CLI11_PARSE(app, argc, argv);
  try {
    if (auto code = fsdp::maybe_launch_local(argc, argv)) return *code;
    if (std::getenv("RANK") == nullptr && std::getenv("WORLD_SIZE") == nullptr) {
      std::vector<std::string> a{"/proc/self/exe"};
      for (int i = 1; i < argc; ++i) a.emplace_back(argv[i]);
      return fsdp::launch_local(nproc, a);  // spawn the ranks (default 2)
    }
    const auto env = fsdp::LaunchEnv::from_environment();
    torch::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / env.local_world_size));
    auto mesh = fsdp::Mesh::create(env);
    const bool cuda = device_name == "cuda";
    const torch::Device device = cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank))
                                      : torch::Device(torch::kCPU);
    if (cuda) c10::impl::getDeviceGuardImpl(torch::kCUDA)->setDevice(device);
    std::vector<std::string> paths{"deferred", "build, shard"};
    if (cuda) paths.push_back("CPU, stream");

    if (mesh->rank() == 0) {
      std::cout << "W = " << mesh->world_size() << ", device " << device_name << ", median of " << repeats
                << " rounds, rank 0\n\n| model | parameters | path | build + shard (s) | peak CPU tensors (MB) |"
                << (cuda ? " peak CUDA allocated (MB) |" : "") << " shards kept (MB) |\n|---|---|---|---|---|"
                << (cuda ? "---|" : "") << "---|" << std::endl;
    }
    for (const auto& size : sizes) {
      models::GPTConfig cfg = size == "large" ? models::GPTConfig{256, 128, 16, 16, 1024} : models::GPTConfig::preset(size);
      std::vector<Result> results(paths.size());
      for (int round = 0; round < repeats; ++round) {
        for (size_t p = 0; p < paths.size(); ++p) {
          std::vector<at::Tensor> sync{torch::zeros({1})};
          mesh->world()->allreduce(sync)->wait();  // start each path together
          fsdp::Options opts;
          opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
          if (cuda) fsdp::reset_device_peaks(device);
          torch::manual_seed(1);
          const auto t0 = std::chrono::steady_clock::now();
          int64_t host_peak = 0, shards = 0;
          {
            fsdp::HostMemoryPeak peak;
            std::shared_ptr<models::GPTImpl> model;
            if (paths[p] == "deferred") {
              model = fsdp::deferred_init([&] { return models::GPT(cfg); }).ptr();
              if (cuda) opts.init_device = device;
            } else if (paths[p] == "build, shard") {
              model = models::GPT(cfg).ptr();
              if (cuda) model->to(device);
            } else {
              model = models::GPT(cfg).ptr();
              opts.init_device = device;
            }
            fsdp::FullyShardedDataParallel<models::GPTImpl> sharded(model, mesh, opts);
            if (cuda) torch::cuda::synchronize();
            host_peak = peak.peak_bytes();
            for (const auto& u : sharded.units()) shards += u.shard_numel * u.element_size;
          }
          results[p].seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
          results[p].host_peak = std::max(results[p].host_peak, host_peak);
          results[p].shard_bytes = shards;
          if (cuda) results[p].device_peak = std::max(results[p].device_peak, fsdp::device_memory_stats(device).allocated_peak);
        }
      }
      if (mesh->rank() == 0) {
        for (size_t p = 0; p < paths.size(); ++p) {
          char row[256];
          std::snprintf(row, sizeof(row), "| %s | %.1f M | %s | %.2f | %.1f |", size.c_str(), cfg.num_parameters() / 1e6,
                        paths[p].c_str(), median(results[p].seconds), results[p].host_peak / 1e6);
          std::cout << row;
          if (cuda) std::printf(" %.1f |", results[p].device_peak / 1e6);
          std::printf(" %.1f |\n", results[p].shard_bytes / 1e6);
          std::cout.flush();
        }
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-bench-init: error: " << e.what() << std::endl;
    return 1;
  }
}
