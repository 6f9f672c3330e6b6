// A user's own live loop (fsdp/live_manager.h) with the slips an outside review made on purpose,
// for test_fault_tolerance.cpp: the public headers only, as a user's program sees fsdp. Like
// examples/live_loop.cpp (2 ranks per replica group, an MLP, Adam), plus:
//   --states a,b          the names it registers (default "data")
//   --states-rank R       only rank R registers --states; the others register "data"
//   --unused-on-group G   a `side` layer runs in the forward of group G only (others: no gradient)
//   --extra-shape-rank R  rank R passes its extra tensor to should_commit with another shape
//   --skip-commit R@S     rank R starts step S+1 without calling should_commit for step S
//   --unseeded            each rank builds its model from a seed of its own
//   --no-finish           never calls finish()
//   --int-extra           passes an integer extra tensor to should_commit
//   --double-commit       calls should_commit twice in step 2
// Prints "digest rank R: X" at the end of every rank that trained to the end.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

#include <torch/torch.h>

#include "fsdp/fsdp.h"
#include "fsdp/launch.h"
#include "fsdp/live_manager.h"

struct ProbeImpl : torch::nn::Module {
  ProbeImpl() {
    in = register_module("in", torch::nn::Linear(16, 32));
    side = register_module("side", torch::nn::Linear(32, 32));
    out = register_module("out", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_side) {
    auto h = torch::relu(in(x));
    if (use_side) h = h + side(h);
    return out(h);
  }
  torch::nn::Linear in{nullptr}, side{nullptr}, out{nullptr};
};
TORCH_MODULE(Probe);

int main(int argc, char** argv) {
  if (auto code = fsdp::launch_live_local(argc, argv)) return *code;
  int64_t steps = 12, unused_on = -1, extra_rank = -1, skip_rank = -1, skip_step = -1, states_rank = -1;
  bool unseeded = false, finish = true, int_extra = false, double_commit = false;
  std::string schedule, states = "data";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const std::string v = i + 1 < argc ? argv[i + 1] : "";
    if (a == "--steps") steps = std::atoll(v.c_str());
    if (a == "--schedule") schedule = v;
    if (a == "--states") states = v;
    if (a == "--states-rank") states_rank = std::atoll(v.c_str());
    if (a == "--unused-on-group") unused_on = std::atoll(v.c_str());
    if (a == "--extra-shape-rank") extra_rank = std::atoll(v.c_str());
    if (a == "--skip-commit") std::sscanf(v.c_str(), "%lld@%lld", reinterpret_cast<long long*>(&skip_rank),
                                          reinterpret_cast<long long*>(&skip_step));
    if (a == "--unseeded") unseeded = true;
    if (a == "--no-finish") finish = false;
    if (a == "--int-extra") int_extra = true;
    if (a == "--double-commit") double_commit = true;
  }
  try {
    const fsdp::LaunchEnv env = fsdp::LaunchEnv::from_environment();
    fsdp::LiveOptions options = fsdp::LiveOptions::from_environment();
    options.ranks_per_replica = 2;
    options.total_steps = steps;
    options.schedule = schedule;
    auto live = fsdp::LiveManager::connect(env, options);
    torch::manual_seed(unseeded ? 100 + env.rank : 0);
    Probe model;
    fsdp::Options fsdp_options;
    fsdp_options.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
    fsdp::FullyShardedDataParallel sharded(model, live->replica_mesh(), fsdp_options);
    torch::optim::Adam optimizer(sharded.parameters(), torch::optim::AdamOptions(1e-2));
    live->track(sharded, optimizer);
    int64_t position = 0;  // a data loader's position
    std::stringstream names(states_rank < 0 || states_rank == env.rank ? states : std::string("data"));
    for (std::string name; std::getline(names, name, ',');) {
      live->register_state(name, [&] { return std::to_string(position); },
                           [&](const std::string& s) { position = std::atoll(s.c_str()); });
    }
    const auto& mesh = live->replica_mesh();
    while (auto step = live->start_step()) {
      const auto& members = live->round().members;
      const int64_t groups = static_cast<int64_t>(members.size());
      const int64_t at = std::find(members.begin(), members.end(), live->replica()) - members.begin();
      const int64_t rows = 16 / (groups * mesh->world_size());
      torch::manual_seed(1000 + position);
      const auto x = torch::randn({16, 16});
      const auto mine = x.slice(0, (at * mesh->world_size() + mesh->rank()) * rows,
                                (at * mesh->world_size() + mesh->rank() + 1) * rows);
      optimizer.zero_grad();
      auto loss = sharded.forward(mine, live->replica() == unused_on).pow(2).mean();
      loss.backward();
      if (env.rank == skip_rank && *step == skip_step) continue;  // the slip: no should_commit
      auto extra = env.rank == extra_rank ? loss.detach().reshape({1}).repeat({2}) : loss.detach().reshape({1});
      if (int_extra) extra = extra.to(torch::kLong);
      if (!live->should_commit({extra})) continue;
      if (double_commit && *step == 2) (void)live->should_commit({extra});
      optimizer.step();
      ++position;
    }
    if (finish) live->finish();
    std::printf("digest rank %d: %s\n", env.rank, fsdp::state_digest(sharded.parameters(), optimizer).c_str());
    return 0;
  } catch (const fsdp::LeftOutOfJob& e) {
    std::fprintf(stderr, "live_probe: %s\n", e.what());
    return fsdp::kLeftOutExitCode;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "live_probe: error: %s\n", e.what());
    return 1;
  }
}
