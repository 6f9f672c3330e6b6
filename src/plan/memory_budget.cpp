// The per-rank memory budget (Options::memory_budget): resolving it on this machine, and the text
// of a refusal, which tries the other ways to shard the same model and says which would fit.
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>

#include "memory/device.h"
#include "fsdp/plan.h"
#include "comm/mesh_info.h"
#include "comm/mesh_state.h"
#include "precision/precision.h"

#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace fsdp {
namespace {

int64_t mem_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  // Without /proc/meminfo: the physical memory.
  return static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGE_SIZE);
}

// What the data limit (RLIMIT_DATA: private writable memory, `prlimit --data`) leaves this process
// beyond what it has mapped already (VmData); -1 without a limit.
int64_t data_limit_left() {
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_DATA, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return -1;
  std::ifstream in("/proc/self/status");
  std::string line;
  int64_t vm_data = 0;
  while (std::getline(in, line)) {
    if (line.rfind("VmData:", 0) == 0) vm_data = std::stoll(line.substr(7)) * 1024;
  }
  return std::max<int64_t>(0, static_cast<int64_t>(rl.rlim_cur) - vm_data);
}


int64_t read_int(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return -1;
  try {
    return std::stoll(text);
  } catch (const std::exception&) {
    return -1;
  }
}

// What the memory cgroup this process runs in (v1 or v2) leaves, shared by the local ranks when
// they all run in it (a container's limit) or this rank's alone (a cgroup per rank); -1 without a
// limit.
int64_t cgroup_left(int local_world_size) {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    // "4:memory:/path" (v1) or "0::/path" (v2)
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    std::string dir, limit_file, usage_file;
    if (controllers == "memory") {
      dir = "/sys/fs/cgroup/memory" + path;
      limit_file = "/memory.limit_in_bytes";
      usage_file = "/memory.usage_in_bytes";
    } else if (controllers.empty() && line.rfind("0::", 0) == 0) {
      dir = "/sys/fs/cgroup" + path;
      limit_file = "/memory.max";
      usage_file = "/memory.current";
    } else {
      continue;
    }
    const int64_t limit = read_int(dir + limit_file), usage = read_int(dir + usage_file);
    // v1 reports "no limit" as a huge number.
    if (limit <= 0 || usage < 0 || limit >= (int64_t{1} << 60)) continue;
    std::ifstream procs(dir + "/cgroup.procs");
    int processes = 0;
    for (std::string pid; procs >> pid;) ++processes;
    const int sharing = processes >= local_world_size ? local_world_size : 1;
    return std::max<int64_t>(0, limit - usage) / sharing;
  }
  return -1;
}

}  // namespace

int64_t memory_budget_bytes(const Options& options, c10::Device device, int local_world_size) {
  const int64_t set = options.memory_budget.max_bytes_per_rank;
  if (set == MemoryBudget::kOff) return 0;
  if (set > 0) return set;
  if (set != MemoryBudget::kAuto) {
    throw std::invalid_argument("fsdp: memory_budget.max_bytes_per_rank must be positive, kAuto (-1) or kOff (0), got " +
                                std::to_string(set));
  }
#ifdef USE_C10D_NCCL
  if (device.is_cuda()) {
    size_t free_bytes = 0, total_bytes = 0;
    c10::cuda::CUDAGuard guard(device.index());
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) return static_cast<int64_t>(total_bytes);
    return 0;  // cannot tell: no check
  }
#endif
  (void)device;
  int64_t budget = mem_available_bytes() / std::max(1, local_world_size);
  for (const int64_t limited : {data_limit_left(), cgroup_left(local_world_size)}) {
    if (limited >= 0) budget = std::min(budget, std::max<int64_t>(limited, 1));  // 0 left still checks
  }
  return budget;
}

std::string explain_over_budget(torch::nn::Module& model, const MemoryPlan& plan, const Options& options,
                                int local_world_size, int64_t budget) {
  std::ostringstream out;
  out << "fsdp: this configuration needs about " << format_bytes(plan.total()) << " per rank, over the budget of " << format_bytes(budget)
      << " per rank (Options::memory_budget; fsdp-train --max-memory-per-rank). The plan:\n\n"
      << format_plans({plan}) << "\n";
  // The same model, sharded other ways on the same ranks.
  struct Try {
    std::string what;
    Options o;
  };
  std::vector<Try> tries;
  const int W = plan.world_size;
  auto with = [&](ShardingStrategy s, bool bf16) {
    Options o = options;
    o.strategy = s;
    o.shard_size = 0;
    if (bf16) o.mixed_precision = MixedPrecision{};
    return o;
  };
  if (options.strategy != ShardingStrategy::FULL_SHARD) tries.push_back({"strategy full_shard (F = W)", with(ShardingStrategy::FULL_SHARD, false)});
  if (!options.mixed_precision) {
    Options o = options;
    o.mixed_precision = MixedPrecision{};
    tries.push_back({"bf16 mixed precision", o});
    if (options.strategy != ShardingStrategy::FULL_SHARD) tries.push_back({"full_shard with bf16 mixed precision", with(ShardingStrategy::FULL_SHARD, true)});
  }
  if (options.reshard_after_forward_to != 0) {
    Options o = options;
    o.reshard_after_forward_to = 0;  // hpZ's secondary shards are what it costs
    tries.insert(tries.begin(), {"without hpZ (reshard_after_forward_to = 0)", o});
  }
  bool any = false;
  for (const Try& t : tries) {
    MemoryPlan p = plan_memory(model, W, t.o, local_world_size);
    p.activations = plan.activations;
    if (p.total() <= budget) {
      out << "Would fit: " << t.what << " (" << format_bytes(p.total()) << " per rank).\n";
      any = true;
    }
  }
  // State shrinks with F; what does not shrink with F (gathered units, their gradients, the
  // activations) bounds how far more ranks can help.
  const int64_t fixed = plan.backward_peak();
  const int64_t state_per_rank = plan.sharded_params + plan.sharded_grads + plan.adam_state;
  if (fixed < budget && plan.shard_size > 0) {
    const double whole_state = static_cast<double>(state_per_rank) * plan.shard_size;
    const int F_needed = static_cast<int>(std::ceil(whole_state / static_cast<double>(budget - fixed)));
    if (F_needed > plan.shard_size) {
      out << "Would fit: sharding over at least " << F_needed << " ranks (F = " << F_needed << ", now " << plan.shard_size
          << "), e.g. full_shard on " << F_needed << " ranks or more.\n";
      any = true;
    }
  }
  MemoryPlan without = plan;
  without.activations = 0;
  without.head_activations = 0;
  if (plan.activations > 0 && without.total() < budget) {
    out << "Would fit: a smaller batch or sequence (the activations estimate is " << format_bytes(plan.activations)
        << "; the rest needs " << format_bytes(without.total()) << ").\n";
    any = true;
  }
  if (!any) out << "Nothing tried here fits: use more ranks, a smaller model, or a machine with more memory.\n";
  out << "To override the check, set the budget yourself (or switch it off with MemoryBudget::kOff / "
         "--max-memory-per-rank 0).";
  return out.str();
}

void check_memory_budget(torch::nn::Module& model, Mesh& mesh, const Options& options, c10::Device device) {
  const int local_world_size = mesh.env().local_world_size;
  // The host's memory is shared by all its processes (a tensor-parallel job's data-parallel mesh
  // counts only its own ranks per host).
  int64_t budget = memory_budget_bytes(options, device, detail::MeshState::of(mesh).processes_per_host());
  const int W = mesh.world_size();
  if (W > 1) {
    auto t = at::full({1}, budget, at::kLong);
    std::vector<at::Tensor> one{t};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MIN;
    wait_for(detail::MeshState::of(mesh).world->allreduce(one, opts), "agreement on the memory budget");
    budget = t.item<int64_t>();
  }
  if (budget <= 0) return;
  const MemoryPlan plan = plan_memory(model, W, options, local_world_size);
  if (plan.total() > budget) throw std::invalid_argument(explain_over_budget(model, plan, options, local_world_size, budget));
  enforce_device_budget(device, options.memory_budget.max_bytes_per_rank);
}

}  // namespace fsdp
