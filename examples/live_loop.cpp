// A training loop of our own that survives a lost replica group (fsdp/live_manager.h): an MLP
// learns a fixed random linear map; each replica group of 2 ranks shards it with fsdp, and the
// groups average their gradients once per step in rounds the coordinator decides. The data stream
// is ours too: its position is a random generator's state, which a joining group takes from a
// live one (register_state), as a real loader's position would be.
//
//   live_loop --nproc-per-node 4 --max-restarts 2 --kill-group-at 8
//       group 1 kills itself after the backward of step 8; group 0 trains on; the launcher starts
//       group 1's ranks again and they join with group 0's state
//   live_loop --nproc-per-node 4 --schedule out:1@8,in:1@T
//       the same membership, fixed in advance: the final digests are the same bits
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "fsdp/fsdp.h"
#include "fsdp/launch.h"
#include "fsdp/live_manager.h"

struct RegressorImpl : torch::nn::Module {
  RegressorImpl() {
    in = register_module("in", torch::nn::Linear(32, 64));
    hidden = register_module("hidden", torch::nn::Linear(64, 64));
    out = register_module("out", torch::nn::Linear(64, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out(torch::relu(hidden(torch::relu(in(x))))); }
  torch::nn::Linear in{nullptr}, hidden{nullptr}, out{nullptr};
};
TORCH_MODULE(Regressor);

// Our data stream: each step's global batch is drawn from a generator, so where the stream stands
// is the generator's state. A discarded step puts the state back: the redo sees the same batch.
class Stream {
 public:
  explicit Stream(uint64_t seed) : gen_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}
  torch::Tensor next(int64_t rows) {
    before_ = gen_.get_state();
    return torch::randn({rows, 32}, gen_);
  }
  void undo() { gen_.set_state(before_); }
  std::string save() const {
    const torch::Tensor s = gen_.get_state();
    return std::string(reinterpret_cast<const char*>(s.data_ptr<uint8_t>()), static_cast<size_t>(s.numel()));
  }
  void load(const std::string& bytes) {
    torch::Tensor s = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
    std::memcpy(s.data_ptr<uint8_t>(), bytes.data(), bytes.size());
    gen_.set_state(s);
  }

 private:
  at::Generator gen_;
  torch::Tensor before_;
};

int main(int argc, char** argv) {
  if (auto code = fsdp::launch_live_local(argc, argv)) return *code;  // the coordinator and launcher
  int64_t steps = 30, kill_at = -1;
  std::string schedule;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--steps") == 0) steps = std::atoll(argv[++i]);
    else if (std::strcmp(argv[i], "--schedule") == 0) schedule = argv[++i];
    else if (std::strcmp(argv[i], "--kill-group-at") == 0) kill_at = std::atoll(argv[++i]);
  }
  try {
    const fsdp::LaunchEnv env = fsdp::LaunchEnv::from_environment();
    fsdp::LiveOptions options = fsdp::LiveOptions::from_environment();
    options.ranks_per_replica = 2;
    options.total_steps = steps;
    options.schedule = schedule;
    auto live = fsdp::LiveManager::connect(env, options);

    torch::manual_seed(0);  // the same initial weights on every rank
    Regressor model;
    const auto target = torch::randn({32, 8});
    live->declare_identity({{"model", fsdp::parameters_identity(*model)}, {"optimizer", "Adam lr 0.01, clip 1"},
                            {"data", "stream seed 1, global batch 32"}});
    fsdp::Options fsdp_options;
    fsdp_options.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
    fsdp::FullyShardedDataParallel sharded(model, live->replica_mesh(), fsdp_options);
    torch::optim::Adam optimizer(sharded.parameters(), torch::optim::AdamOptions(1e-2));
    live->track(sharded, optimizer);
    Stream data(1);
    live->register_state("data", [&] { return data.save(); }, [&](const std::string& s) { data.load(s); });

    const auto& mesh = live->replica_mesh();
    const bool speaks = mesh->rank() == 0;
    const int64_t global_batch = 32;
    while (auto step = live->start_step()) {
      const fsdp::LiveRound& round = live->round();
      if (speaks && !round.left.empty()) std::printf("[group %d] group(s) left at step %lld\n", live->replica(), static_cast<long long>(*step));
      if (speaks && !round.joined.empty()) {
        std::printf("[group %d] group(s) joined at step %lld\n", live->replica(), static_cast<long long>(*step));
      }
      // This step's rows: the global batch split over the groups in the round, then the group's ranks.
      const auto x = data.next(global_batch);
      const int64_t groups = static_cast<int64_t>(round.members.size());
      const int64_t position = std::find(round.members.begin(), round.members.end(), live->replica()) - round.members.begin();
      const int64_t rows = global_batch / (groups * mesh->world_size());
      const auto mine = x.slice(0, (position * mesh->world_size() + mesh->rank()) * rows,
                                (position * mesh->world_size() + mesh->rank() + 1) * rows);
      optimizer.zero_grad();
      auto loss = torch::mse_loss(sharded.forward(mine), mine.matmul(target));
      loss.backward();
      if (*step == kill_at && live->replica() == 1 && !live->is_replacement()) {
        std::fprintf(stderr, "[group 1] rank %d kills itself after the backward of step %lld\n", env.rank,
                     static_cast<long long>(*step));
        std::fflush(nullptr);
        std::raise(SIGKILL);  // a lost host: no cleanup
      }
      std::vector<torch::Tensor> group_loss{loss.detach().reshape({1})};
      mesh->world()->allreduce(group_loss)->wait();
      group_loss[0].div_(mesh->world_size());
      if (!live->should_commit({group_loss[0]})) {
        data.undo();  // the redo trains on the same batch
        continue;
      }
      sharded.clip_grad_norm_(1.0);
      optimizer.step();
      if (speaks && live->replica() == round.members.front() && *step % 5 == 0) {
        std::printf("step %2lld loss %.5f\n", static_cast<long long>(*step), group_loss[0].item<double>());
      }
    }
    live->finish();
    std::printf("digest rank %d: %s\n", env.rank, fsdp::state_digest(sharded.parameters(), optimizer).c_str());
    return 0;
  } catch (const fsdp::LeftOutOfJob& e) {
    std::fprintf(stderr, "live_loop: %s\n", e.what());
    return fsdp::kLeftOutExitCode;  // the other groups train on; start this group again to rejoin
  } catch (const std::exception& e) {
    std::fprintf(stderr, "live_loop: error: %s\n", e.what());
    return 1;
  }
}
