// fsdp-test-worker fault --fault kill|exit|throw|branch|skip|skip-paired|skip-clip|swap-models --fault-rank R --fault-at forward|backward|step|between
//                        [--fault-step S] [--strategy S]
//   Trains a 4-block GPT-like stack; at step S (default 2) rank R: is killed with SIGKILL at the
//   given point of the iteration (inside forward, inside backward, inside the optimizer step, or
//   between steps), or (exit) ends with code 5 while the others abort in an all-reduce, or throws from its forward (user code failing), or runs its blocks in another
//   order, or skips one (control flow that differs across ranks; skip-paired: with every unit it
//   gathers of one size, so that the skipped unit's all-gather pairs with the next one's), or skips
//   clip_grad_norm_ that the others call, or trains the second of two wrapped models first; or (outlive) every rank waits 300 s
//   for the test to kill its launcher. The surviving ranks must each end with an error
//   that names what failed, within the collective timeout; the test drivers time them.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "worker.h"

namespace worker {
namespace {

struct StackImpl : torch::nn::Module {
  StackImpl() {
    emb = register_module("emb", torch::nn::Embedding(256, 32));
    for (int i = 0; i < 4; ++i) blocks.push_back(register_module("block" + std::to_string(i), torch::nn::Linear(32, 32)));
    head = register_module("head", torch::nn::Linear(32, 256));
  }
  // `between(i)` runs before block i; `order` is the block order.
  torch::Tensor forward(const torch::Tensor& x, const std::vector<int>& order, const std::function<void(int, torch::Tensor&)>& between) {
    auto h = emb(x);
    for (int i : order) {
      between(i, h);
      h = torch::tanh(blocks[static_cast<size_t>(i)](h));
    }
    return head(h);
  }
  torch::nn::Embedding emb{nullptr};
  std::vector<torch::nn::Linear> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Stack);

}  // namespace

json run_fault(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const int rank = mesh->rank();
  if (a.fault == "outlive") {
    // Every rank waits far longer than a test: what ends it is its launcher's death.
    // One write: the ranks share the launcher's stderr, and the test reads each line.
    std::cerr << ("rank " + std::to_string(rank) + ": pid " + std::to_string(::getpid()) + " waiting\n") << std::flush;
    std::this_thread::sleep_for(std::chrono::seconds(300));
    return json();
  }
  if (a.fault == "exit") {
    // Rank R ends its program with code 5 while the others wait in an all-reduce, which they do
    // not guard (a user's quick program would not): its error aborts them (SIGABRT), usually
    // before rank R's exit is complete (its static destructors take a moment).
    if (rank == a.fault_rank) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      std::cerr << "rank " << rank << ": exits with code 5" << std::endl;
      std::exit(5);
    }
    std::vector<at::Tensor> t{torch::ones({4})};
    try {
      mesh->world()->allreduce(t)->wait();
    } catch (...) {
      std::abort();
    }
    return json();
  }
  const int64_t per = kGlobalBatch / mesh->world_size();
  fsdp::Options opts = options_from(a);
  opts.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
  // skip-paired: the head stays in the root unit, so the units a rank gathers are all the same
  // size and a skipped one's all-gather pairs with the next one's instead of failing on its size.
  if (a.fault == "skip-paired") {
    opts.auto_wrap_policy = [](const std::string& fqn, const torch::nn::Module&, int64_t) {
      return fqn.rfind("block", 0) == 0;
    };
  }
  torch::manual_seed(0);
  Stack model;
  fsdp::FullyShardedDataParallel sharded(model, mesh, opts);
  torch::optim::AdamW optim(sharded.parameters(), torch::optim::AdamWOptions(1e-3));
  const bool mine = rank == a.fault_rank;
  auto say = [&](const std::string& what) { std::cerr << "rank " << rank << ": " << what << std::endl; };
  if (a.fault == "swap-models") {
    // Two wrapped models of one architecture, trained one after the other each step; at step S
    // rank R trains the second first. Every collective pairs with one of the same size.
    Stack second;
    fsdp::FullyShardedDataParallel sharded2(second, mesh, opts);
    torch::optim::AdamW optim2(sharded2.parameters(), torch::optim::AdamWOptions(1e-3));
    for (int step = 0; step < 6; ++step) {
      auto [x, y] = corpus().batch(step, kGlobalBatch, 16, 3, rank * per, rank * per + per);
      std::vector<std::pair<Stack*, decltype(&sharded)>> order{{&model, &sharded}, {&second, &sharded2}};
      if (mine && step == a.fault_step) std::swap(order[0], order[1]);
      for (auto& [m, w] : order) {
        auto logits = w->forward_with([&, m = m] { return (*m)->forward(x, {0, 1, 2, 3}, [](int, torch::Tensor&) {}); });
        models::lm_loss(logits, y).backward();
      }
      optim.step();
      optim2.step();
      optim.zero_grad();
      optim2.zero_grad();
    }
    return json{{"rank", rank}, {"completed", true}};
  }
  for (int step = 0; step < 6; ++step) {
    const bool now = mine && step == a.fault_step;
    if (now && a.fault == "kill" && a.fault_at == "between") {
      say("killed between steps");
      ::raise(SIGKILL);
    }

    auto [x, y] = corpus().batch(step, kGlobalBatch, 16, 3, rank * per, rank * per + per);
    optim.zero_grad();
    std::vector<int> order{0, 1, 2, 3};
    if (now && a.fault == "branch") order = {3, 2, 1, 0};  // this rank's control flow differs
    if (now && (a.fault == "skip" || a.fault == "skip-paired")) order = {0, 1, 3};  // a unit this rank alone skips
    auto logits = sharded.forward_with([&] {
      return model->forward(x, order, [&](int i, torch::Tensor& h) {
        if (!now || i != 2) return;
        if (a.fault == "kill" && a.fault_at == "forward") {
          say("killed in forward");
          ::raise(SIGKILL);
        }
        if (a.fault == "throw") throw std::runtime_error("user code failed in forward on rank " + std::to_string(rank));
        if (a.fault == "kill" && a.fault_at == "backward") {
          h.register_hook([&](const torch::Tensor&) {
            say("killed in backward");
            ::raise(SIGKILL);
          });
        }
      });
    });
    auto loss = models::lm_loss(logits, y);
    loss.backward();
    // skip-clip: every rank clips (an all-reduce of the norm) but rank R at step S.
    if (a.fault == "skip-clip" && !now) sharded.clip_grad_norm_(1.0);
    if (now && a.fault == "kill" && a.fault_at == "step") {
      optim.step([&] {
        say("killed in the optimizer step");
        ::raise(SIGKILL);
        return torch::Tensor();
      });
    } else {
      optim.step();
    }
  }
  return json{{"rank", rank}, {"completed", true}};
}

}  // namespace worker
