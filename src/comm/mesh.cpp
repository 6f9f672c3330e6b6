#include "comm/collective_mismatch.h"
#include "comm/mesh_state.h"
#include "fsdp/launch.h"

#include <signal.h>

#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace fsdp {
namespace {

const char* kLaunchHelp =
    "Launch with torchrun (torchrun --nproc-per-node N --no-python ./program ...), or let the "
    "program spawn its own ranks with --nproc-per-node N.";

int env_int(const char* name, bool required, int fallback, int min_value) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') {
    if (!required) return fallback;
    throw std::invalid_argument(std::string("fsdp: environment variable ") + name +
                                " is not set. " + kLaunchHelp);
  }
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(raw, &end, 10);
  if (errno != 0 || end == raw || *end != '\0' || v < min_value || v > (1L << 30)) {
    throw std::invalid_argument(std::string("fsdp: environment variable ") + name + "='" + raw +
                                "' is not an integer >= " + std::to_string(min_value) + ". " +
                                kLaunchHelp);
  }
  return static_cast<int>(v);
}

// c10's exceptions carry a stack trace after their first line: the message is the first line.
std::string first_line(const std::string& what) { return what.substr(0, what.find('\n')); }

}  // namespace

MeshOptions MeshOptions::from_environment() {
  MeshOptions o;
  auto seconds = [](const char* name, std::chrono::milliseconds fallback, bool zero_allowed = false) {
    const char* raw = std::getenv(name);
    if (raw == nullptr || *raw == '\0') return fallback;
    char* end = nullptr;
    const double s = std::strtod(raw, &end);
    if (end == raw || *end != '\0' || !(s > 0 || (zero_allowed && s == 0)) || s > 1e7) {
      throw std::invalid_argument(std::string("fsdp: environment variable ") + name + "='" + raw + "' is not a " +
                                  (zero_allowed ? "number of seconds >= 0" : "positive number of seconds"));
    }
    return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
  };
  o.init_timeout = seconds("FSDP_INIT_TIMEOUT_S", o.init_timeout);
  o.collective_timeout = seconds("FSDP_COLLECTIVE_TIMEOUT_S", o.collective_timeout);
  o.compare_collectives_after = seconds("FSDP_COMPARE_COLLECTIVES_AFTER_S", o.compare_collectives_after, true);
  return o;
}

LaunchEnv LaunchEnv::from_environment() {
  LaunchEnv e;
  e.world_size = env_int("WORLD_SIZE", true, 1, 1);
  e.rank = env_int("RANK", true, 0, 0);
  if (e.rank >= e.world_size) {
    throw std::invalid_argument("fsdp: RANK=" + std::to_string(e.rank) + " is not below WORLD_SIZE=" +
                                std::to_string(e.world_size) + ". " + kLaunchHelp);
  }
  e.local_world_size = env_int("LOCAL_WORLD_SIZE", false, e.world_size, 1);
  e.local_rank = env_int("LOCAL_RANK", false, e.rank % e.local_world_size, 0);
  if (e.local_rank >= e.local_world_size) {
    throw std::invalid_argument("fsdp: LOCAL_RANK=" + std::to_string(e.local_rank) +
                                " is not below LOCAL_WORLD_SIZE=" + std::to_string(e.local_world_size) +
                                ": LOCAL_RANK is this process's index on its node (0 to LOCAL_WORLD_SIZE - 1). Set both "
                                "from your launcher (torchrun and fsdp's own launcher do), or leave them unset. " +
                                kLaunchHelp);
  }
  if (e.world_size % e.local_world_size != 0) {
    throw std::invalid_argument("fsdp: WORLD_SIZE=" + std::to_string(e.world_size) +
                                " is not a multiple of LOCAL_WORLD_SIZE=" +
                                std::to_string(e.local_world_size) + " (ranks per node): every node runs the same "
                                "number of ranks. Set LOCAL_WORLD_SIZE to the ranks each node runs (it must divide "
                                "WORLD_SIZE), or leave it unset for one node. " + kLaunchHelp);
  }
  const bool multi = e.world_size > 1;
  const char* addr = std::getenv("MASTER_ADDR");
  if (addr != nullptr && *addr != '\0') {
    e.master_addr = addr;
  } else if (multi) {
    throw std::invalid_argument(std::string("fsdp: environment variable MASTER_ADDR is not set. ") + kLaunchHelp);
  }
  e.master_port = env_int("MASTER_PORT", multi, 29500, 1);
  if (e.master_port > 65535) {
    throw std::invalid_argument("fsdp: MASTER_PORT=" + std::to_string(e.master_port) +
                                " is not a TCP port (1..65535)");
  }
  return e;
}

Mesh::Mesh(std::unique_ptr<detail::MeshState> state) : state_(std::move(state)) {}
Mesh::~Mesh() = default;

int Mesh::rank() const { return state_->env.rank; }
int Mesh::world_size() const { return state_->env.world_size; }
const LaunchEnv& Mesh::env() const { return state_->env; }
const c10::intrusive_ptr<c10d::Backend>& Mesh::world() const { return state_->world; }
std::string Mesh::network() const {
  return state_->simulated ? "nothing (a simulated rank)" : state_->gloo_interface.describe();
}
bool Mesh::is_simulated() const { return state_->simulated; }

std::shared_ptr<Mesh> Mesh::simulated(int world_size, int rank, int local_world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("fsdp: a simulated rank " + std::to_string(rank) + " of " + std::to_string(world_size) +
                                " ranks: the rank must be in [0, world size)");
  }
  if (local_world_size < 1 || world_size % local_world_size != 0) {
    throw std::invalid_argument("fsdp: a simulated job of " + std::to_string(world_size) + " ranks with " +
                                std::to_string(local_world_size) + " per node: the ranks per node must divide the world size");
  }
  auto state = std::make_unique<detail::MeshState>();
  state->env.world_size = world_size;
  state->env.rank = rank;
  state->env.local_world_size = local_world_size;
  state->env.local_rank = rank % local_world_size;
  state->simulated = true;
  state->store = c10::make_intrusive<c10d::HashStore>();
  state->world = state->make_group("world", rank, world_size, c10::DeviceType::CPU);
  return std::shared_ptr<Mesh>(new Mesh(std::move(state)));
}

std::shared_ptr<Mesh> Mesh::single_process() {
  auto state = std::make_unique<detail::MeshState>();
  state->store = c10::make_intrusive<c10d::HashStore>();
  // Alone: nothing to reach, whatever GLOO_SOCKET_IFNAME says.
  state->gloo_interface.address = "127.0.0.1";
  state->gloo_interface.reason = "a single process";
  state->world = state->make_group("world", 0, 1, c10::DeviceType::CPU);
  return std::shared_ptr<Mesh>(new Mesh(std::move(state)));
}

// A peer that dies closes its sockets; the next write to one raises SIGPIPE, whose default action
// kills this rank silently instead of letting the collective fail with an error that says what
// happened. Ignore it (unless the program installed a handler of its own), as network libraries do.
void ignore_sigpipe() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ignore, nullptr);
  }
}

std::shared_ptr<Mesh> Mesh::create(const LaunchEnv& env, MeshOptions options) {
  if (env.world_size == 1) {
    auto mesh = single_process();
    mesh->state_->options = options;
    return mesh;
  }
  ignore_sigpipe();
  detail::explain_collective_mismatch_on_terminate(env.rank);
  auto state = std::make_unique<detail::MeshState>();
  state->env = env;
  state->options = options;
  // Before the rendezvous: a wrong GLOO_SOCKET_IFNAME or an unroutable MASTER_ADDR is this rank's
  // own error, reported at once rather than as a peer that never arrived.
  state->gloo_interface = detail::choose_gloo_interface(env);
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  // Rank 0 hosts the store, unless fsdp's local launcher already does (fsdp/launch.h).
  const char* hosted = std::getenv(kStoreHostedEnv);
  so.isServer = env.rank == 0 && !(hosted && std::string(hosted) == "1");
  so.numWorkers = env.world_size;
  // Rank 0 does not wait inside the store's constructor: the launch keys below name who is missing.
  so.waitWorkers = false;
  so.timeout = options.init_timeout;
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  const std::string secs = std::to_string(options.init_timeout.count() / 1000);
  try {
    state->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const std::exception& e) {
    throw std::runtime_error(
        "fsdp: rank " + std::to_string(env.rank) + " could not rendezvous at " + where + " within " +
        secs + " s: " + (env.rank == 0 ? std::string("rank 0 could not host the store (is the port in use?)")
                                       : "rank 0 (the store host) is not reachable") +
        ". Start all WORLD_SIZE ranks with the same MASTER_ADDR and MASTER_PORT, and check that "
        "the port is free. (" + e.what() + ")");
  }
  // Every rank states the world size it was launched with; a mismatch is reported by every rank
  // that can see it, before any process group waits for ranks that will never come. Ranks that
  // never arrive are named, with their node (a host that never joined shows as all its ranks).
  const std::string mine = std::to_string(env.world_size);
  state->store->set("fsdp/launch/" + std::to_string(env.rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r) keys.push_back("fsdp/launch/" + std::to_string(r));
  try {
    state->store->wait(keys, options.init_timeout);
  } catch (const std::exception& e) {
    std::string missing;
    int count = 0;
    try {
      for (int r = 0; r < env.world_size; ++r) {
        if (state->store->check({keys[r]})) continue;
        missing += (missing.empty() ? "" : ", ") + std::to_string(r) + " (node " +
                   std::to_string(r / env.local_world_size) + ")";
        ++count;
      }
    } catch (const std::exception&) {
      throw std::runtime_error("fsdp: rank " + std::to_string(env.rank) + " lost the store at " + where +
                               " while waiting for the other ranks: rank 0 exited. (" + first_line(e.what()) + ")");
    }
    throw std::runtime_error("fsdp: " + std::to_string(count) + " of " + mine + " ranks never arrived at " + where +
                             " within " + secs + " s: rank" + (count > 1 ? "s " : " ") + missing +
                             ". Start every rank (NODE_RANK = rank / LOCAL_WORLD_SIZE names its host), and check "
                             "that each host reaches MASTER_ADDR. (" + first_line(e.what()) + ")");
  }
  for (int r = 0; r < env.world_size; ++r) {
    const std::vector<uint8_t> theirs = state->store->get(keys[r]);
    const std::string s(theirs.begin(), theirs.end());
    if (s != mine) {
      throw std::runtime_error("fsdp: world size mismatch: this rank (" + std::to_string(env.rank) +
                               ") has WORLD_SIZE=" + mine + " but rank " + std::to_string(r) +
                               " has WORLD_SIZE=" + s + ". Launch every rank with the same WORLD_SIZE.");
    }
  }
  state->world = state->make_group("world", env.rank, env.world_size, c10::DeviceType::CPU);
  return std::shared_ptr<Mesh>(new Mesh(std::move(state)));
}

namespace detail {

std::shared_ptr<Mesh> MeshState::sub_mesh(const std::string& name, int rank, int size, int local_world_size) {
  auto sub = std::make_unique<MeshState>();
  sub->env = env;
  sub->env.rank = rank;
  sub->env.world_size = size;
  sub->env.local_world_size = local_world_size;
  sub->env.local_rank = rank % local_world_size;
  sub->options = options;
  sub->gloo_interface = gloo_interface;
  sub->simulated = simulated;
  sub->device_rank = device_rank >= 0 ? device_rank : env.local_rank;
  sub->host_processes = processes_per_host();
  sub->store = c10::make_intrusive<c10d::PrefixStore>("fsdp/sub/" + name, store);
  sub->world = sub->make_group("world", rank, size, c10::DeviceType::CPU);
  return std::shared_ptr<Mesh>(new Mesh(std::move(sub)));
}

std::shared_ptr<Mesh> MeshState::over_store(c10::intrusive_ptr<c10d::Store> store, const LaunchEnv& env,
                                            MeshOptions options, int host_processes) {
  ignore_sigpipe();
  explain_collective_mismatch_on_terminate(env.rank);
  auto state = std::make_unique<MeshState>();
  state->env = env;
  state->options = options;
  state->gloo_interface = choose_gloo_interface(env);
  state->host_processes = host_processes;
  state->store = std::move(store);
  state->world = state->make_group("world", env.rank, env.world_size, c10::DeviceType::CPU);
  return std::shared_ptr<Mesh>(new Mesh(std::move(state)));
}

const ShardGroups& MeshState::groups_for(int shard_size, c10::DeviceType device) {
  const auto key = std::make_pair(shard_size, static_cast<int>(device));
  auto it = groups.find(key);
  if (it != groups.end()) return it->second;
  const int W = env.world_size;
  TORCH_INTERNAL_ASSERT(shard_size >= 1 && W % shard_size == 0, "fsdp: unvalidated sharding factor ", shard_size);
  ShardGroups g;
  const int replica = env.rank / shard_size;  // which shard group (node) this rank is in
  const int shard_rank = env.rank % shard_size;
  const bool cuda = device == c10::DeviceType::CUDA;
  const std::string tag = (cuda ? "nccl/F" : "F") + std::to_string(shard_size);
  GroupPtr all = world;
  if (cuda) {
    if (!nccl_world) nccl_world = make_group("world", env.rank, W, device);
    all = nccl_world;
  }
  g.shard = shard_size == W ? all
                            : make_group(tag + "/shard/" + std::to_string(replica), shard_rank, shard_size, device);
  g.replicate = shard_size == 1 ? all
                                : make_group(tag + "/replicate/" + std::to_string(shard_rank), replica,
                                             W / shard_size, device);
  return groups.emplace(key, std::move(g)).first->second;
}

const GroupPtr& MeshState::consecutive_group(int size, c10::DeviceType device) {
  const auto key = std::make_pair(size, static_cast<int>(device));
  auto it = secondary_groups.find(key);
  if (it != secondary_groups.end()) return it->second;
  TORCH_INTERNAL_ASSERT(size >= 1 && env.world_size % size == 0, "fsdp: unvalidated group size ", size);
  const std::string tag = std::string(device == c10::DeviceType::CUDA ? "nccl/" : "") + "hpz" + std::to_string(size) +
                          "/" + std::to_string(env.rank / size);
  return secondary_groups.emplace(key, make_group(tag, env.rank % size, size, device)).first->second;
}

std::shared_ptr<RingReduceScatter> MeshState::ring_for(const GroupPtr& group) {
  auto& ring = rings[group.get()];
  if (!ring) ring = std::make_shared<RingReduceScatter>(group);
  return ring;
}

std::shared_ptr<ReplicaAllReduceOrder> MeshState::replica_order_for(const GroupPtr& group) {
  auto& order = replica_orders[group.get()];
  if (!order) order = std::make_shared<ReplicaAllReduceOrder>();
  return order;
}

void MeshState::check_same_on_all_ranks(const std::string& what, uint64_t fingerprint, const std::string& describe) {
  if (env.world_size == 1) return;
  const std::string key = "fsdp/check/" + std::to_string(checks++) + "/";
  store->set(key + std::to_string(env.rank), std::vector<uint8_t>(describe.begin(), describe.end()));
  // All-gather the fingerprints so every rank learns whether any rank differs.
  auto mine = at::full({1}, static_cast<int64_t>(fingerprint), at::kLong);
  auto all = at::empty({env.world_size}, at::kLong);
  world->_allgather_base(all, mine)->wait();
  int bad = -1;
  for (int r = 0; r < env.world_size; ++r) {
    if (all[r].item<int64_t>() != all[0].item<int64_t>()) { bad = r; break; }
  }
  if (bad < 0) return;
  auto text = store->get(key + "0");
  const std::string ref(text.begin(), text.end());
  // The difference shown is this rank's from rank 0's; on a rank that agrees with rank 0 (rank 0
  // itself), the first differing rank's, so that every rank's message says what differs.
  std::string other = describe, who = "this rank";
  if (describe == ref) {
    auto t = store->get(key + std::to_string(bad));
    other.assign(t.begin(), t.end());
    who = "rank " + std::to_string(bad);
  }
  std::string diff = "";
  if (other != ref) {
    std::istringstream a(other), b(ref);
    std::string la, lb;
    int line = 0;
    while (true) {
      bool ga = static_cast<bool>(std::getline(a, la)), gb = static_cast<bool>(std::getline(b, lb));
      ++line;
      if (!ga && !gb) break;
      if (!ga || !gb || la != lb) {
        diff = " First difference (item " + std::to_string(line) + "): " + who + " has '" +
               (ga ? la : "<nothing>") + "', rank 0 has '" + (gb ? lb : "<nothing>") + "'.";
        break;
      }
    }
  }
  throw std::runtime_error("fsdp: " + what + " differs across ranks (rank " + std::to_string(bad) +
                           " differs from rank 0; this is rank " + std::to_string(env.rank) + ")." + diff +
                           " Every rank must build the same model with the same options.");
}

}  // namespace detail
}  // namespace fsdp
