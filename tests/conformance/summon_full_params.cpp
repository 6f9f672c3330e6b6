// summon_full_params() and unshard() at their edges, as PyTorch FSDP1's test_fsdp_unshard_params,
// test_fsdp_use_orig_params and FSDP2's test_fully_shard_* and DeepSpeed's GatheredParameters tests
// use them: writeback on and off, a one-element parameter, between a forward and its backward,
// inside forward and inside backward, rank0_only, names inside and outside, a change made on some
// ranks only, the memory a scope gathers, and unshard() of a root that holds no parameters.
#include <set>

#include "conformance.h"
#include "fsdp/process_memory.h"
#include "live_bytes.h"

namespace conformance {
namespace summon_full_params {  // its own names: scenario files reuse Mlp, Block, Net (unity builds)
namespace {

// A unit (inner) and the root (head), as the peer's Sequential(FSDP(Linear(5, 5)), Linear(5, 3)).
struct TwoLayerImpl : torch::nn::Module {
  explicit TwoLayerImpl(int64_t in = 5, int64_t hidden = 5) {
    inner = register_module("inner", torch::nn::Linear(in, hidden));
    head = register_module("head", torch::nn::Linear(hidden, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(inner(x))); }
  torch::nn::Linear inner{nullptr}, head{nullptr};
};
TORCH_MODULE(TwoLayer);

const auto kSgd = torch::optim::SGDOptions(0.1).momentum(0.9);

// fp32: one process and W ranks sum the same products in another order (1e-5). bf16: the units
// compute in bf16 (8 bits of mantissa, a relative 4e-3 per rounding) against fp32 local training,
// a few steps of it: 2e-2, as the regressions' bf16 scenario.
double tolerance(const Variant& v) { return v.mixed_precision() ? 2e-2 : 1e-5; }

// One SGD step of the wrapped model on this rank's rows and of the local model on the whole batch,
// their losses compared. `in` columns in, `out` columns out.
template <typename Wrapped, typename Local>
void train_step(Ctx& c, Wrapped& model, torch::optim::Optimizer& optim, Local& local, torch::optim::Optimizer& local_optim,
                int step, double tol, int64_t in = 5, int64_t out = 3) {
  const auto x = randn(1000 + step, {8, in});
  const auto y = randn(2000 + step, {8, out});
  optim.zero_grad();
  auto loss = torch::mse_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
  loss.backward();
  optim.step();
  local_optim.zero_grad();
  auto local_loss = torch::mse_loss(local->forward(x), y);
  local_loss.backward();
  local_optim.step();
  c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                local_loss.item().toDouble(), tol);
}

// Every parameter of two states equal (bit for bit by default).
void expect_same_state(Ctx& c, const std::string& what, const std::map<std::string, torch::Tensor>& got,
                       const std::map<std::string, torch::Tensor>& want, double tol = 0.0) {
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    if (it == got.end()) {
      c.fail(what + ": " + name + " is missing");
      continue;
    }
    expect_same_tensor(c, what + ": " + name, it->second, w, tol);
  }
}

// The writeback cases of test_unshard_params_writeback, on a model trained for two steps first
// (momentum buffers exist), then trained on: writeback = false leaves every shard as it was (the
// zeros written inside are gone); writeback = true keeps a change made on every rank (the
// parameters halved, as in local training).
void writeback_cases(Ctx& c, bool bf16) {
  for_each(c, every_strategy(c, bf16), [&](const Variant& v) {
    torch::manual_seed(3);
    TwoLayer mine;
    torch::manual_seed(3);
    TwoLayer local;
    fsdp::fully_shard(*mine->inner);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    const double tol = tolerance(v);
    int step = 0;
    for (; step < 2; ++step) train_step(c, model, optim, local, local_optim, step, tol);

    const auto before = whole_state(model, *mine);
    {
      auto full = model.summon_full_params({/*writeback=*/false});
      torch::NoGradGuard no_grad;
      for (auto& p : mine->parameters()) p.zero_();
      for (const auto& [name, t] : state_of(*mine)) {
        c.expect(t.abs().max().item().toDouble() == 0.0, "inside the writeback = false scope " + name + " reads zeros");
      }
    }
    expect_same_state(c, "after a writeback = false scope that zeroed every parameter", whole_state(model, *mine),
                      before);
    train_step(c, model, optim, local, local_optim, step++, tol);

    {
      auto full = model.summon_full_params();  // writeback = true
      torch::NoGradGuard no_grad;
      for (auto& p : mine->parameters()) p.mul_(0.5);
    }
    {
      torch::NoGradGuard no_grad;
      for (auto& p : local->parameters()) p.mul_(0.5);
    }
    expect_same_model(c, model, *mine, *local, tol);
    for (; step < 6; ++step) train_step(c, model, optim, local, local_optim, step, tol);
    expect_same_model(c, model, *mine, *local, tol);
  });
}

}  // namespace

CONFORMANCE_CASE(SummonFullParams, WritebackFalseDiscardsChanges, 4,
                 "#79 #87: FSDP1 test_fsdp_unshard_params test_unshard_params_writeback, "
                 "TestUnshardParamsNoShard test_unshard_params_writeback_no_shard") {
  writeback_cases(c, /*bf16=*/true);
}

CONFORMANCE_CASE(SummonFullParams, WritebackAtWorldSizeOne, 1,
                 "#87: FSDP1 test_fsdp_unshard_params TestUnshardParamsNoShard (world size 1)") {
  writeback_cases(c, /*bf16=*/false);
}

namespace {
// y = 3x through a one-element weight: at W = 4 ranks 1 to 3 hold only padding.
torch::nn::Linear one_element() { return torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false)); }
}  // namespace

CONFORMANCE_CASE(SummonFullParams, OneElementParameterWrittenBack, 4,
                 "#82: FSDP1 test_fsdp_unshard_params test_unshard_singleton_param_writeback") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    auto mine = one_element();
    auto local = one_element();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    {
      auto full = model.summon_full_params();
      c.expect(mine->weight.numel() == 1, "inside the scope the weight has its one element");
      torch::NoGradGuard no_grad;
      mine->weight.fill_(5.0);
    }
    {
      auto full = model.summon_full_params({/*writeback=*/false});
      c.expect(mine->weight.numel() == 1 && mine->weight.item().toDouble() == 5.0,
               "every rank reads back the 5.0 written before (rank " + std::to_string(c.rank) + ")");
    }
    {
      auto full = model.summon_full_params({/*writeback=*/false, /*rank0_only=*/true});
      if (c.rank == 0) c.expect(mine->weight.item().toDouble() == 5.0, "rank 0 alone reads 5.0");
    }
    {
      torch::NoGradGuard no_grad;
      local->weight.fill_(5.0);
    }
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD optim(model.parameters(), sgd);
    torch::optim::SGD local_optim(local->parameters(), sgd);
    for (int step = 0; step < 4; ++step) {
      const auto x = randn(300 + step, {8, 1});
      const auto y = 3 * x;
      optim.zero_grad();
      auto loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                    local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

namespace {
const std::vector<std::string> kBetweenPasses{"summon_full_params", "outside forward and backward"};
}  // namespace

CONFORMANCE_CASE(SummonFullParams, BetweenForwardAndBackwardIsRefused, 4,
                 "#83 #120: FSDP1 test_fsdp_unshard_params test_unshard_params_respects_reshard, "
                 "test_fsdp_use_orig_params test_summon_between_two_forwards") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(4);
    TwoLayer mine;
    torch::manual_seed(4);
    TwoLayer local;
    fsdp::fully_shard(*mine->inner);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    const double tol = tolerance(v);
    for (int step = 0; step < 3; ++step) {
      const auto x = randn(400 + step, {8, 5}), x2 = randn(450 + step, {8, 5});
      const auto y = randn(500 + step, {8, 3});
      optim.zero_grad();
      torch::Tensor loss;
      if (step == 1) {
        // test_summon_between_two_forwards: forward, summon, forward, backward of the sum.
        auto first = torch::mse_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
        c.expect_refused("summon_full_params between two forwards", [&] { model.summon_full_params(); },
                         kBetweenPasses);
        loss = first + torch::mse_loss(model(my_rows(c, x2)).to(torch::kFloat), my_rows(c, y));
      } else {
        loss = torch::mse_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
        c.expect_refused("summon_full_params between a forward and its backward",
                         [&] { model.summon_full_params({/*writeback=*/false}); }, kBetweenPasses);
        c.expect_refused("summon_full_params(rank0_only) between a forward and its backward",
                         [&] { model.summon_full_params({/*writeback=*/false, /*rank0_only=*/true}); }, kBetweenPasses);
      }
      loss.backward();
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), y);
      if (step == 1) local_loss = local_loss + torch::mse_loss(local->forward(x2), y);
      local_loss.backward();
      // After backward, before the step: a summon works, shows the parameters not yet stepped, and
      // leaves them (and the step that follows) as they were.
      if (step == 2) {
        std::map<std::string, torch::Tensor> before_step;
        c.expect_ok("summon_full_params after backward", [&] { before_step = whole_state(model, *mine); });
        expect_same_state(c, "summoned after backward", before_step, state_of(*local), tol);
      }
      optim.step();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                    local_loss.item().toDouble(), tol);
      // An evaluation forward without a graph leaves the model at rest: a summon may follow.
      {
        torch::NoGradGuard no_grad;
        model(my_rows(c, x));
      }
      c.expect_ok("summon_full_params after a forward under NoGradGuard", [&] { model.summon_full_params(); });
    }
    expect_same_model(c, model, *mine, *local, tol);
  });
}

CONFORMANCE_CASE(SummonFullParams, InsideForwardOrBackwardIsRefused, 4,
                 "#88: FSDP1 test_fsdp_unshard_params test_unshard_params_from_forward_raises, "
                 "test_unshard_params_from_backward_raises") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(5);
    TwoLayer mine;
    torch::manual_seed(5);
    TwoLayer local;
    fsdp::fully_shard(*mine->inner);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    for (int step = 0; step < 3; ++step) {
      const auto x = randn(600 + step, {8, 5});
      const auto y = randn(700 + step, {8, 3});
      optim.zero_grad();
      int hooks_ran = 0;
      auto out = model.forward_with([&] {
        c.expect_refused("summon_full_params at the start of forward", [&] { model.summon_full_params(); },
                         kBetweenPasses);
        auto h = torch::relu(mine->inner(my_rows(c, x)));
        c.expect_refused("summon_full_params in forward, between two units",
                         [&] { model.summon_full_params({/*writeback=*/false}); }, kBetweenPasses);
        // Backward reaches h's hook after the head's backward, before inner's.
        h.register_hook([&](torch::Tensor g) {
          ++hooks_ran;
          c.expect_refused("summon_full_params in a backward hook between two units",
                           [&] { model.summon_full_params({/*writeback=*/false}); }, kBetweenPasses);
          return g;
        });
        return mine->head(h);
      });
      // The output's hook runs first in backward, before any unit's.
      out.register_hook([&](torch::Tensor g) {
        ++hooks_ran;
        c.expect_refused("summon_full_params in a backward hook before any unit's backward",
                         [&] { model.summon_full_params(); }, kBetweenPasses);
        return g;
      });
      auto loss = torch::mse_loss(out, my_rows(c, y));
      loss.backward();
      c.expect(hooks_ran == 2, "both backward hooks ran");
      optim.step();
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), y);
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                    local_loss.item().toDouble(), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

CONFORMANCE_CASE(SummonFullParams, Rank0OnlyWithWritebackIsRefused, 4,
                 "#89: FSDP1 test_fsdp_unshard_params test_rank0_only_with_writeback_raises") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(6);
    TwoLayer mine;
    torch::manual_seed(6);
    TwoLayer local;
    fsdp::fully_shard(*mine->inner);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    train_step(c, model, optim, local, local_optim, 0, 1e-5);
    std::map<std::string, std::vector<int64_t>> shard_shapes;
    for (const auto& [name, p] : model.named_parameters()) shard_shapes[name] = p.sizes().vec();
    c.expect_refused("summon_full_params(writeback, rank0_only)",
                     [&] { model.summon_full_params({/*writeback=*/true, /*rank0_only=*/true}); },
                     {"summon_full_params", "rank0_only", "writeback", "writeback = false"});
    // The refusal left nothing behind: rank0_only without writeback works, rank 0 sees the whole
    // parameters and the others keep their shards.
    {
      auto full = model.summon_full_params({/*writeback=*/false, /*rank0_only=*/true});
      if (c.rank == 0) {
        expect_same_state(c, "rank 0's whole parameters", state_of(*mine), state_of(*local), 1e-5);
      } else {
        for (const auto& [name, p] : model.named_parameters()) {
          c.expect(p.sizes().vec() == shard_shapes[name], name + " keeps its shard's shape on rank " + std::to_string(c.rank));
        }
      }
    }
    for (int step = 1; step < 4; ++step) train_step(c, model, optim, local, local_optim, step, 1e-5);
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

namespace {

// A model with buffers (a BatchNorm in eval mode reads its running statistics; a registered
// scale), three units: inner, norm and the root (head).
struct NormNetImpl : torch::nn::Module {
  NormNetImpl() {
    inner = register_module("inner", torch::nn::Linear(6, 6));
    norm = register_module("norm", torch::nn::BatchNorm1d(6));
    head = register_module("head", torch::nn::Linear(6, 2));
    scale = register_buffer("scale", torch::linspace(0.5, 1.5, 6));
    torch::NoGradGuard no_grad;
    norm->running_mean.copy_(torch::linspace(-0.2, 0.3, 6));
    norm->running_var.copy_(torch::linspace(0.8, 1.3, 6));
    norm->eval();
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(norm(inner(x))) * scale); }
  torch::nn::Linear inner{nullptr}, head{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(NormNet);

std::vector<std::string> names_of(const std::vector<std::pair<std::string, torch::Tensor>>& named) {
  std::vector<std::string> out;
  for (const auto& kv : named) out.push_back(kv.first);
  return out;
}
std::vector<std::string> names_of(const torch::OrderedDict<std::string, torch::Tensor>& named) {
  std::vector<std::string> out;
  for (const auto& kv : named) out.push_back(kv.key());
  return out;
}

// Each parameter of the wrapped model holds either its whole value or, as fsdp.h documents for a
// parameter at rest with F > 1, this rank's 1-D slice of its unit's flat parameter (the unit's
// parameters flattened in UnitInfo::fqns order, padded to a multiple of F, cut into F equal parts,
// part shard_rank = rank % F): checked against `want` (the local model's values).
void expect_whole_or_my_slice(Ctx& c, const std::string& when, fsdp::FullyShardedDataParallelBase& model,
                              const std::map<std::string, torch::Tensor>& want, double tol) {
  std::map<std::string, torch::Tensor> mine;
  for (const auto& [name, p] : model.named_parameters()) mine[name] = p.detach().to(torch::kFloat);
  const int64_t shard_rank = c.rank % model.shard_size();
  for (const auto& u : model.units()) {
    std::vector<torch::Tensor> parts;
    for (const auto& fqn : u.fqns) parts.push_back(want.at(fqn).flatten());
    parts.push_back(torch::zeros({u.padded_numel - u.numel}));
    const auto flat = torch::cat(parts);
    const int64_t s0 = shard_rank * u.shard_numel, s1 = s0 + u.shard_numel;
    int64_t offset = 0;
    for (const auto& fqn : u.fqns) {
      const auto& w = want.at(fqn);
      const auto& got = mine.at(fqn);
      if (got.sizes() == w.sizes()) {
        expect_same_tensor(c, when + ": " + fqn + " (whole)", got, w, tol);
      } else {
        const int64_t b = std::max(offset, s0), e = std::max(b, std::min(offset + w.numel(), s1));
        c.expect(got.dim() == 1 && got.numel() == e - b,
                 when + ": " + fqn + " holds neither its whole value nor this rank's slice of " +
                     std::to_string(e - b) + " elements (" + std::to_string(got.numel()) + ")");
        if (got.dim() == 1 && got.numel() == e - b) expect_same_tensor(c, when + ": " + fqn + " (this rank's slice)", got, flat.narrow(0, b, e - b), tol);
      }
      offset += w.numel();
    }
  }
}

}  // namespace

// fp32 only: under mixed precision buffers are cast to buffer_dtype by design (options.h), and a
// parameter gathered for a pending backward holds the compute dtype's copy.
CONFORMANCE_CASE(SummonFullParams, NamedParametersAndBuffersMatchTheUnwrappedModel, 4,
                 "#85 #121 #125: FSDP1 test_fsdp_unshard_params test_named_parameters_and_buffers, "
                 "test_fsdp_use_orig_params test_access_params_after_forward, test_named_parameters_in_forward") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(7);
    NormNet mine;
    torch::manual_seed(7);
    NormNet local;
    fsdp::fully_shard(*mine->inner);
    fsdp::fully_shard(*mine->norm);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    const auto local_names = names_of(local->named_parameters());
    const auto local_buffers = names_of(local->named_buffers());

    // At rest: the original names in the original order; buffers whole and equal; parameters whole
    // or this rank's slice.
    c.expect(names_of(mine->named_parameters()) == local_names, "named_parameters() keeps the original names at rest");
    c.expect(names_of(model.named_parameters()) == local_names, "the wrapper's named_parameters() lists the same names");
    c.expect(names_of(mine->named_buffers()) == local_buffers, "named_buffers() keeps the original names");
    for (const auto& b : mine->named_buffers()) {
      expect_same_tensor(c, "buffer " + b.key() + " at rest", b.value(), local->named_buffers()[b.key()], 0.0);
    }
    expect_whole_or_my_slice(c, "at rest", model, state_of(*local, false), 0.0);

    // Inside summon_full_params: every parameter whole, equal, a leaf that requires grad.
    {
      auto full = model.summon_full_params({/*writeback=*/false});
      c.expect(names_of(mine->named_parameters()) == local_names, "the names inside summon_full_params");
      for (const auto& p : mine->named_parameters()) {
        expect_same_tensor(c, "inside summon_full_params: " + p.key(), p.value(), local->named_parameters()[p.key()], 0.0);
        c.expect(p.value().requires_grad() && p.value().is_leaf(), p.key() + " is a leaf that requires grad inside summon_full_params");
      }
      for (const auto& b : mine->named_buffers()) {
        expect_same_tensor(c, "inside summon_full_params: buffer " + b.key(), b.value(), local->named_buffers()[b.key()], 0.0);
      }
    }

    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    for (int step = 0; step < 3; ++step) {
      const auto x = randn(800 + step, {8, 6});
      const auto y = randn(900 + step, {8, 2});
      optim.zero_grad();
      // test_named_parameters_in_forward: an L2 penalty over named_parameters() inside forward;
      // each parameter, once an operator has reached it, is whole under its original name.
      auto out = model.forward_with([&] {
        auto o = mine->forward(my_rows(c, x));
        auto penalty = torch::zeros({});
        for (const auto& p : mine->named_parameters()) {
          penalty = penalty + p.value().pow(2).sum();
          c.expect(p.value().sizes() == local->named_parameters()[p.key()].sizes(),
                   p.key() + " is whole inside forward once an operator reached it");
        }
        return std::make_pair(o, penalty);
      });
      auto loss = torch::mse_loss(out.first, my_rows(c, y)) + 1e-2 * out.second;
      local_optim.zero_grad();
      auto local_penalty = torch::zeros({});
      for (const auto& p : local->named_parameters()) local_penalty = local_penalty + p.value().pow(2).sum();
      auto local_loss = torch::mse_loss(local->forward(x), y) + 1e-2 * local_penalty;
      // test_access_params_after_forward: between the forward and its backward each parameter
      // reads its whole value or this rank's slice, equal to local training's.
      expect_whole_or_my_slice(c, "between forward and backward at step " + std::to_string(step), model,
                               state_of(*local, false), 1e-6);
      loss.backward();
      optim.step();
      local_loss.backward();
      local_optim.step();
      c.expect_near("loss at step " + std::to_string(step), global_mean(c, loss.item().toDouble()),
                    local_loss.item().toDouble(), 1e-5);
      expect_whole_or_my_slice(c, "after the step " + std::to_string(step), model, state_of(*local, false), 1e-5);
    }
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

CONFORMANCE_CASE(SummonFullParams, ChangeMadeOnSomeRanksIsRefused, 4,
                 "#314: DeepSpeed test_zero_context TestGatheredParametersAllRanksErrorOnModification") {
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(8);
    TwoLayer mine;
    torch::manual_seed(8);
    TwoLayer local;
    fsdp::fully_shard(*mine->inner);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    const double tol = tolerance(v);
    train_step(c, model, optim, local, local_optim, 0, tol);
    const auto before = whole_state(model, *mine);
    // Rank 0 alone changes one element of the root's head and one of the inner unit (a weight
    // loaded on one rank only): with writeback, each rank would keep what it wrote into its own
    // shard (replicas apart under no_sync and the hybrid strategies, a half-applied change under
    // full sharding). fsdp compares the ranks' whole parameters when the scope ends, discards the
    // change on every rank and refuses the next call.
    {
      auto full = model.summon_full_params();
      torch::NoGradGuard no_grad;
      if (c.rank == 0) {
        mine->head->weight[0][0].add_(1.0);
        mine->inner->bias[4].add_(1.0);
      }
    }
    c.expect_refused("the forward after a summon_full_params scope that changed parameters on rank 0 only",
                     [&] { model(my_rows(c, randn(1, {8, 5}))); },
                     {"summon_full_params", "differ", "every rank"});
    expect_same_state(c, "after the refused change", whole_state(model, *mine), before);
    // The same change made on every rank is kept.
    {
      auto full = model.summon_full_params();
      torch::NoGradGuard no_grad;
      mine->head->weight[0][0].add_(1.0);
    }
    {
      torch::NoGradGuard no_grad;
      local->head->weight[0][0].add_(1.0);
    }
    for (int step = 1; step < 4; ++step) train_step(c, model, optim, local, local_optim, step, tol);
    expect_same_model(c, model, *mine, *local, tol);
  });
}

namespace {
// A model of 17 KB, so that a scope's bytes stand out of what the live count also sees
// (live_bytes.h).
constexpr int64_t kWide = 64;
using live::kNoise;
int64_t live_near(int64_t want) { return live::near(want); }
int64_t live_settled() { return live::settled(); }
}  // namespace

CONFORMANCE_CASE(SummonFullParams, GatheredMemoryFreedWhenTheScopeEnds, 4,
                 "#315: DeepSpeed test_zero_context TestZeroGatheredParametersFree; FSDP1 test_unshard_params_respects_reshard") {
  fsdp::install_host_allocator();
  for_each(c, every_strategy(c, /*bf16=*/true), [&](const Variant& v) {
    torch::manual_seed(9);
    TwoLayer mine(kWide, kWide);
    torch::manual_seed(9);
    TwoLayer local(kWide, kWide);
    fsdp::fully_shard(*mine->inner);
    fsdp::FullyShardedDataParallel model(mine, c.mesh, v.options);
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    const double tol = tolerance(v);
    train_step(c, model, optim, local, local_optim, 0, tol, kWide);
    int64_t whole_bytes = 0;  // the whole model in its master dtype (fp32)
    for (const auto& u : model.units()) whole_bytes += u.numel * u.element_size;
    const int F = model.shard_size();

    const int64_t base = live_settled();
    {
      auto full = model.summon_full_params();
      const int64_t held = fsdp::process_memory().live_tensor_bytes - base;
      c.figure("summon_full_params_bytes", static_cast<double>(held));
      if (F > 1) c.expect(held >= whole_bytes - kNoise, "summon_full_params holds the whole parameters (" + std::to_string(held) +
                                              " bytes above the shards, " + std::to_string(whole_bytes) + " whole)");
    }
    c.expect(std::abs(live_near(base) - base) <= kNoise,
             "the summon_full_params scope's memory is freed when it ends (" +
                 std::to_string(live_near(base) - base) + " bytes left)");
    c.expect(model.metrics().memory.unsharded_current == 0, "no unsharded buffer after summon_full_params");

    {
      auto whole = model.unshard();
      const int64_t counted = model.metrics().memory.unsharded_current;
      const int64_t held = live_near(base + counted) - base;
      c.figure("unshard_bytes", static_cast<double>(held));
      c.figure("unshard_counted_bytes", static_cast<double>(counted));
      c.expect(std::abs(held - counted) <= kNoise, "inside unshard() fsdp counts " + std::to_string(counted) +
                                    " unsharded bytes, the allocator holds " + std::to_string(held) + " more");
    }
    c.expect(std::abs(live_near(base) - base) <= kNoise,
             "the unshard() scope's memory is freed when it ends (" +
                 std::to_string(live_near(base) - base) + " bytes left)");
    c.expect(model.metrics().memory.unsharded_current == 0, "no unsharded buffer after unshard()");

    // A step inside unshard() (forward and backward; the optimizer after it): back to the same bytes.
    {
      auto whole = model.unshard();
      const auto x = randn(1001, {8, kWide});
      const auto y = randn(2001, {8, 3});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(my_rows(c, x)).to(torch::kFloat), my_rows(c, y));
      loss.backward();
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), y);
      local_loss.backward();
      c.expect_near("loss inside unshard()", global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), tol);
    }
    optim.step();
    local_optim.step();
    c.expect(std::abs(live_near(base) - base) <= kNoise,
             "after a step whose forward and backward ran inside unshard(), the same bytes as after a plain step (" +
                 std::to_string(live_near(base) - base) + " bytes more)");
    expect_same_model(c, model, *mine, *local, tol);
  });
}

namespace {
// Every parameter in an inner unit: the root unit holds none.
struct NoRootParamsImpl : torch::nn::Module {
  NoRootParamsImpl() {
    a = register_module("a", torch::nn::Linear(5, 7));
    b = register_module("b", torch::nn::Linear(7, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(NoRootParams);
}  // namespace

// fp32: unshard() holds the compute dtype's copy, compared bit for bit with the local model.
CONFORMANCE_CASE(SummonFullParams, UnshardOfARootWithoutParametersBeforeAnyForward, 4,
                 "#291 #292: FSDP2 test_fully_shard_comm test_unshard_no_param_group, test_unshard_without_lazy_init") {
  for_each(c, every_strategy(c), [&](const Variant& v) {
    torch::manual_seed(10);
    NoRootParams mine;
    torch::manual_seed(10);
    NoRootParams local;
    fsdp::Options o = v.options;
    o.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
    fsdp::FullyShardedDataParallel model(mine, c.mesh, o);
    c.expect(model.units().size() == 2, "a and b are the units; the root holds no parameters");
    for (const auto& u : model.units()) c.expect(!u.is_root, "no root unit (" + u.name + ")");
    torch::optim::SGD optim(model.parameters(), kSgd);
    torch::optim::SGD local_optim(local->parameters(), kSgd);
    {
      // Right after construction, before any forward: every parameter whole and equal.
      auto whole = model.unshard();
      expect_same_state(c, "inside unshard() before any forward", state_of(*mine), state_of(*local));
      // A training step inside it.
      const auto x = randn(1100, {8, 5});
      const auto y = randn(1200, {8, 3});
      optim.zero_grad();
      auto loss = torch::mse_loss(model(my_rows(c, x)), my_rows(c, y));
      loss.backward();
      local_optim.zero_grad();
      auto local_loss = torch::mse_loss(local->forward(x), y);
      local_loss.backward();
      c.expect_near("loss inside unshard()", global_mean(c, loss.item().toDouble()), local_loss.item().toDouble(), 1e-5);
    }
    optim.step();
    local_optim.step();
    c.expect_refused("unshard() of the root unit of a root without parameters", [&] { model.unshard({""}); },
                     {"unshard()", "not a unit", "'a', 'b'"});
    {
      auto b = model.unshard({"b"});
      c.expect(mine->b->weight.sizes() == local->b->weight.sizes(), "unshard({\"b\"}) gathers b");
    }
    for (int step = 1; step < 4; ++step) train_step(c, model, optim, local, local_optim, step, 1e-5);
    expect_same_model(c, model, *mine, *local, 1e-5);
  });
}

}  // namespace summon_full_params
}  // namespace conformance
