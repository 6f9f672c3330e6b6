// What fsdp puts on the wire per iteration, counted (PyTorch FSDP1's test_fsdp_comm and FSDP2's
// test_fully_shard_comm and test_fully_shard_training): all-gathers, reduce-scatters and
// all-reduces per iteration from Metrics::comm against the paper's schedule for every strategy,
// with no_sync micro-batches before a synchronized one; pipeline-style micro-batches inside one
// explicit unshard(); and an explicit unshard of one unit while the user's own collective runs in
// forward. Every loop is also trained against plain libtorch on the whole batch.
#include <sstream>

#include "conformance.h"

namespace conformance {
namespace communication_counts {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl() { fc = register_module("fc", torch::nn::Linear(8, 8)); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(fc(x)) + x; }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

// Three blocks and the root: N = 4 units.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    inp = register_module("inp", torch::nn::Linear(6, 8));
    b0 = register_module("b0", Block());
    b1 = register_module("b1", Block());
    b2 = register_module("b2", Block());
    head = register_module("head", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(b2(b1(b0(inp(x))))); }
  torch::nn::Linear inp{nullptr}, head{nullptr};
  Block b0{nullptr}, b1{nullptr}, b2{nullptr};
};
TORCH_MODULE(Net);

bool reshards_after_forward(fsdp::ShardingStrategy s) {
  return s == fsdp::ShardingStrategy::FULL_SHARD || s == fsdp::ShardingStrategy::HYBRID_SHARD;
}

struct Calls {
  int64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0;
  bool operator==(const Calls& o) const {
    return all_gather == o.all_gather && reduce_scatter == o.reduce_scatter && all_reduce == o.all_reduce;
  }
  std::string text() const {
    std::ostringstream s;
    s << all_gather << " all-gathers, " << reduce_scatter << " reduce-scatters, " << all_reduce << " all-reduces";
    return s.str();
  }
};

Calls calls_of(const fsdp::Metrics& m) {
  return {m.comm.all_gather_calls, m.comm.reduce_scatter_calls, m.comm.all_reduce_calls};
}

void expect_calls(Ctx& c, const std::string& what, const Calls& got, const Calls& want) {
  c.expect(got == want, what + ": " + got.text() + ", expected " + want.text());
}

fsdp::Options blocks_as_units(const Variant& v) {
  fsdp::Options o = v.options;
  o.auto_wrap_policy = fsdp::module_type_policy<BlockImpl>();
  return o;
}

}  // namespace

// --- the schedule, with and without no_sync ------------------------------------------------------

CONFORMANCE_CASE(CommunicationCounts, CollectiveCallsPerIterationFollowThePaper, 4,
                 "#175, #219: FSDP1 test_fsdp_comm test_communication [use_no_sync, SHARD_GRAD_OP/FULL_SHARD]; FSDP2 "
                 "test_fully_shard_training test_gradient_accumulation (comm counts per micro-batch, FSDP and HSDP)") {
  // The nested model (blocks as units) under every strategy; the flat one (the root the only
  // unit) under the two PyTorch's test runs.
  std::vector<Variant> variants = every_strategy(c);
  for (const char* s : {"full_shard", "shard_grad_op"}) {
    Variant v = strategy(c, s);
    v.name += ", the root the only unit";
    variants.push_back(v);
  }
  for_each(c, variants, [&](const Variant& v) {
    const bool flat = v.name.find("only unit") != std::string::npos;
    torch::manual_seed(0);
    Net mine;
    torch::manual_seed(0);
    Net local;
    fsdp::FullyShardedDataParallel model(mine, c.mesh, flat ? v.options : blocks_as_units(v));
    const int64_t N = static_cast<int64_t>(model.units().size());
    c.expect(N == (flat ? 1 : 4), flat ? "the root is the only unit" : "three blocks and the root are the units");
    const int F = model.shard_size(), R = c.world / F;
    const bool raf = reshards_after_forward(v.options.strategy);
    // The paper's schedule (§3.2, §3.3): with F > 1 every unit is gathered for its forward, and
    // again for its backward when it was resharded after forward (all but the root, which stays
    // gathered until after backward); each unit's gradients are reduce-scattered within its shard
    // group, then all-reduced across the R replicas (R > 1). No_sync backwards reduce nothing.
    // Under shard_grad_op fsdp reshards at the end of every backward, a no_sync one too, so each
    // micro-batch gathers its N units again (PyTorch FSDP1 keeps them gathered from a no_sync
    // backward to the next forward: 0 all-gathers there; more traffic here, the same result).
    const int64_t ag_forward = F > 1 ? N : 0;
    const int64_t ag_backward = F > 1 && raf ? N - 1 : 0;
    const Calls synced{ag_forward + ag_backward, F > 1 ? N : 0, R > 1 ? N : 0};
    const Calls accumulating{ag_forward + ag_backward, 0, 0};
    c.figure("units", static_cast<double>(N));

    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto micro = [&](int step, int k) {
      const auto x = randn(100 + 10 * step + k, {8, 6}), y = randn(200 + 10 * step + k, {8, 3});
      auto loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, y)) / 3;
      loss.backward();
      auto local_loss = torch::mse_loss(local->forward(x), y) / 3;
      local_loss.backward();
      return std::make_pair(global_mean(c, loss.item().toDouble()), local_loss.item().toDouble());
    };
    for (int step = 0; step < 3; ++step) {
      const std::string at = "step " + std::to_string(step);
      optim.zero_grad();
      local_optim.zero_grad();
      // Step 1 accumulates two micro-batches under no_sync before its synchronized one.
      const int accumulated = step == 1 ? 2 : 0;
      for (int k = 0; k < accumulated; ++k) {
        model.reset_step();
        auto guard = model.no_sync();
        const auto [l, ll] = micro(step, k);
        c.expect_near(at + " micro-batch " + std::to_string(k) + " loss", l, ll, 1e-5);
        expect_calls(c, at + ", micro-batch " + std::to_string(k) + " under no_sync", calls_of(model.metrics()), accumulating);
        c.expect(model.metrics().comm.reduce_scatter == 0 && model.metrics().comm.all_reduce == 0,
                 at + ": no gradient bytes move under no_sync");
      }
      model.reset_step();
      const auto [l, ll] = micro(step, 2);
      c.expect_near(at + " synchronized micro-batch loss", l, ll, 1e-5);
      optim.step();
      local_optim.step();
      expect_calls(c, at + (accumulated ? ", the synchronized micro-batch after no_sync" : ""), calls_of(model.metrics()),
                   synced);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

// --- pipeline-style micro-batches inside one unshard() -------------------------------------------

CONFORMANCE_CASE(CommunicationCounts, MicroBatchesInsideOneUnshardGatherEachUnitOnce, 4,
                 "#221: FSDP2 test_fully_shard_training test_1f1b_microbatching (all units unsharded once up "
                 "front, only the last micro-batch reduces gradients)") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(0);
    Net mine;
    torch::manual_seed(0);
    Net local;
    fsdp::FullyShardedDataParallel model(mine, c.mesh, blocks_as_units(v));
    const int64_t N = static_cast<int64_t>(model.units().size());
    const int F = model.shard_size(), R = c.world / F;
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      const std::string at = "step " + std::to_string(step);
      optim.zero_grad();
      local_optim.zero_grad();
      model.reset_step();
      double loss_sum = 0, local_sum = 0;
      {
        auto whole = model.unshard();
        for (int k = 0; k < 3; ++k) {
          const auto x = randn(100 + 10 * step + k, {8, 6}), y = randn(200 + 10 * step + k, {8, 3});
          auto run = [&] {
            auto loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, y)) / 3;
            loss.backward();
            loss_sum += global_mean(c, loss.item().toDouble());
          };
          if (k < 2) {
            auto guard = model.no_sync();
            run();
          } else {
            run();
          }
          auto local_loss = torch::mse_loss(local->forward(x), y) / 3;
          local_loss.backward();
          local_sum += local_loss.item().toDouble();
        }
      }
      optim.step();
      local_optim.step();
      c.expect_near(at + " loss", loss_sum, local_sum, 1e-5);
      // Each unit gathered once, when the scope began; reduced once, for the last micro-batch.
      expect_calls(c, at + ", three micro-batches inside one unshard()", calls_of(model.metrics()),
                   {F > 1 ? N : 0, F > 1 ? N : 0, R > 1 ? N : 0});
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

namespace {

// PyTorch's ReduceModel, made exact: three "reduce modules" compute y_i = relu(x W_i) and the user
// all-reduces each one's batch mean (detached: a constant of the graph, as PyTorch's all-reduce is
// not differentiable) asynchronously; three MLPs, each a unit, consume y_i minus that global mean.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    up = register_module("up", torch::nn::Linear(8, 16));
    down = register_module("down", torch::nn::Linear(16, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return down(torch::relu(up(x))); }
  torch::nn::Linear up{nullptr}, down{nullptr};
};
TORCH_MODULE(Mlp);

struct ReduceModelImpl : torch::nn::Module {
  ReduceModelImpl() {
    for (int i = 0; i < 3; ++i) {
      reduce.push_back(register_parameter("reduce" + std::to_string(i), torch::randn({8, 8}) * 0.3));
      mlps.push_back(register_module("mlp" + std::to_string(i), Mlp()));
    }
  }
  // `global_mean(y)`: the mean of y's rows over the global batch (an all-reduce under fsdp, the
  // plain mean in local training); it returns a function that waits for it.
  template <typename GlobalMean>
  torch::Tensor run(const torch::Tensor& x, GlobalMean&& global_mean) {
    std::vector<torch::Tensor> ys;
    std::vector<std::function<torch::Tensor()>> means;
    for (int i = 0; i < 3; ++i) {
      ys.push_back(torch::relu(x.matmul(reduce[i])));
      means.push_back(global_mean(ys.back()));
    }
    torch::Tensor out;
    for (int i = 0; i < 3; ++i) {
      auto z = mlps[i]->forward(ys[i] - means[i]());
      out = out.defined() ? out + z : z;
    }
    return out;
  }
  std::vector<torch::Tensor> reduce;
  std::vector<Mlp> mlps;
};
TORCH_MODULE(ReduceModel);

}  // namespace

CONFORMANCE_CASE(CommunicationCounts, UnshardOneUnitWhileTheUsersOwnCollectiveRuns, 4,
                 "#176, #290: FSDP1 test_fsdp_comm TestExplicitUnshard test_unshard_async; FSDP2 "
                 "test_fully_shard_comm test_unshard_async (explicit unshard overlapped with the user's async "
                 "all-reduce in forward)") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    // PyTorch's test trains with Adam; SGD with momentum keeps the comparison exact (Adam's
    // division by the root of its second moment turns rounding of near-zero gradients into steps).
    torch::manual_seed(42);
    ReduceModel mine;
    torch::manual_seed(42);
    ReduceModel local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<MlpImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    const auto units = model.units();
    c.expect(units.size() == 4, "the three MLPs and the root are the units");
    int64_t mlp1_bytes = 0, n = 0;
    for (const auto& u : units) {
      if (u.name == "mlp1") mlp1_bytes = u.padded_numel * u.element_size;
      ++n;
    }
    const int F = model.shard_size(), R = c.world / F;
    const bool raf = reshards_after_forward(v.options.strategy);
    torch::optim::SGD optim(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD local_optim(local->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto user_mean = [&](const torch::Tensor& y) -> std::function<torch::Tensor()> {
      auto m = y.detach().mean(0).clone();
      std::vector<at::Tensor> t{m};
      auto work = c.mesh->world()->allreduce(t);  // issued now, waited for when the MLP needs it
      return [work, m, W = c.world]() {
        work->wait();
        return m / W;
      };
    };
    auto local_mean = [](const torch::Tensor& y) -> std::function<torch::Tensor()> {
      auto m = y.detach().mean(0);
      return [m] { return m; };
    };
    for (int step = 0; step < 10; ++step) {
      const std::string at = "step " + std::to_string(step);
      const auto x = randn(100 + step, {8, 8}), y = randn(200 + step, {8, 8});
      optim.zero_grad();
      model.reset_step();
      double loss_value = 0;
      {
        auto gathered = model.unshard({"mlp1"});
        // Only mlp1 is gathered; the other units stay sharded until forward reaches them.
        if (F > 1) {
          c.expect(model.metrics().memory.unsharded_current == mlp1_bytes,
                   at + ": only mlp1 is gathered after unshard({\"mlp1\"}) (" +
                       std::to_string(model.metrics().memory.unsharded_current) + " bytes, mlp1 has " +
                       std::to_string(mlp1_bytes) + ")");
        }
        auto loss = torch::mse_loss(model.forward_with([&] { return mine->run(my_rows(c, x), user_mean); }), my_rows(c, y));
        loss.backward();
        loss_value = loss.item().toDouble();
      }
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->run(x, local_mean), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near(at + " loss", global_mean(c, loss_value), local_loss.item().toDouble(), 1e-5);
      // mlp1 gathered once by unshard(), the others as the schedule has them; every unit reduced once.
      const int64_t others = n - 1;
      const Calls want{F > 1 ? 1 + others + (raf ? others - 1 : 0) : 0, F > 1 ? n : 0, R > 1 ? n : 0};
      expect_calls(c, at, calls_of(model.metrics()), want);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

}  // namespace communication_counts
}  // namespace conformance
