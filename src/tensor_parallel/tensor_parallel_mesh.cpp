// The 2-D mesh (include/fsdp/tensor_parallel.h): W = DP x TP ranks, TP groups of consecutive
// ranks (one host's), a data-parallel sub-mesh per place in the TP group, on which fsdp runs as it
// runs on any mesh. Nothing in the engine knows there is a second dimension: its mesh is the DP one.
#include "fsdp/tensor_parallel.h"

#include "comm/mesh_state.h"

#include <atomic>
#include <map>
#include <mutex>
#include <stdexcept>

namespace fsdp {
namespace {
// TensorParallels made in this process: a second one (a second model, a test) names its groups
// apart from the first's, whose store keys would otherwise be reused. Every rank makes them in the
// same order (create is collective), so the names agree.
std::atomic<int> g_created{0};
}  // namespace

struct TensorParallel::State {
  std::shared_ptr<Mesh> world, dp;
  int size = 1, rank = 0;
  TensorParallelOptions options;
  std::string prefix;  // of its groups' names: "" for the first TensorParallel of the process
  mutable std::mutex mutex;
  mutable std::map<int, c10::intrusive_ptr<c10d::Backend>> groups;  // device type -> TP group
};

TensorParallel::~TensorParallel() = default;

std::shared_ptr<TensorParallel> TensorParallel::create(const std::shared_ptr<Mesh>& world, int size,
                                                       const TensorParallelOptions& options) {
  if (!world) throw std::invalid_argument("fsdp::TensorParallel::create: the world mesh is null");
  if (options.sequence_dim < 0) {
    throw std::invalid_argument("fsdp::TensorParallel::create: sequence_dim must be a dimension (>= 0) of the "
                                "activations, got " + std::to_string(options.sequence_dim));
  }
  const LaunchEnv& env = world->env();
  const int W = env.world_size, local = env.local_world_size;
  if (size < 1 || W % size != 0) {
    throw std::invalid_argument("fsdp: tensor parallelism of " + std::to_string(size) + " ranks on a world of " +
                                std::to_string(W) + ": the TP size must divide the world size (--tp N with N | W)");
  }
  if (W > local && local % size != 0) {
    throw std::invalid_argument("fsdp: tensor parallelism of " + std::to_string(size) + " ranks with " +
                                std::to_string(local) + " ranks per host: a TP group must lie inside one host "
                                "(its activations cross it twice per layer and pass); pick a TP size that divides "
                                "the ranks per host");
  }
  std::shared_ptr<TensorParallel> tp(new TensorParallel());
  tp->state_ = std::make_unique<State>();
  State& s = *tp->state_;
  s.world = world;
  s.size = size;
  s.options = options;
  s.rank = env.rank % size;
  const int made = g_created.fetch_add(1);
  if (made > 0) s.prefix = "tp" + std::to_string(made) + ":";
  const int dp_rank = env.rank / size, dp_size = W / size;
  // Per host: `local / size` DP ranks (one when TP spans the host); a one-host job keeps its
  // ranks on that host (hybrid strategies then see one node of dp_size ranks).
  const int dp_local = W > local ? local / size : dp_size;
  auto& state = detail::MeshState::of(*world);
  if (size == 1) {
    s.dp = world;
  } else {
    // Every rank builds both of its groups in the same order: the TP group of its DP place, then
    // the DP sub-mesh of its TP place.
    s.groups[static_cast<int>(c10::DeviceType::CPU)] =
        state.make_group(s.prefix + "tp/" + std::to_string(dp_rank), s.rank, size, c10::DeviceType::CPU);
    s.dp = state.sub_mesh(s.prefix + "dp/" + std::to_string(s.rank), dp_rank, dp_size, std::max(1, dp_local));
  }
  return tp;
}

int TensorParallel::size() const { return state_->size; }
int TensorParallel::rank() const { return state_->rank; }
bool TensorParallel::sequence_parallel() const { return state_->options.sequence_parallel; }
int64_t TensorParallel::sequence_dim() const { return state_->options.sequence_dim; }
const std::shared_ptr<Mesh>& TensorParallel::data_parallel() const { return state_->dp; }
const std::shared_ptr<Mesh>& TensorParallel::world() const { return state_->world; }

const c10::intrusive_ptr<c10d::Backend>& TensorParallel::group(c10::DeviceType device) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto& g = state_->groups[static_cast<int>(device)];
  if (!g) {
    // Built on first use by a layer on this device: every TP rank runs the same layers in the same
    // order, so they all get here together.
    const int dp_rank = state_->world->rank() / state_->size;
    g = detail::MeshState::of(*state_->world)
            .make_group(state_->prefix + "tp/" + std::to_string(dp_rank) + "/" + c10::DeviceTypeName(device), state_->rank, state_->size,
                        device);
  }
  return g;
}

}  // namespace fsdp
