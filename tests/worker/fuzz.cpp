// fsdp-test-worker fuzz --strategy S [--shard-size F] [--mixed-precision none|bf16] --seeds A:B
//                       [--calls N] [--sequence CODES] [--unit-detection M] [--forward-prefetch 1] --out PREFIX
//   The loop fuzzer: for each seed in [A, B), draws a model (the tiny GPT or the uneven net, a
//   forward returning one of seven C++ types, an optimizer: SGD with momentum, Adam or AdamW, and
//   for the GPT in fp32 an embedding that renormalizes rows in forward, a frozen block, a nested
//   wrapped teacher) and a random sequence of the calls a training loop makes, runs it under fsdp
//   and under the reference (fuzz_models.h), and compares losses, this rank's part of every
//   gradient and every parameter after every call. Mixed-precision runs are also held against the
//   same loop in fp32 (an independent oracle) at a stated tolerance. Writes the seeds that failed,
//   each with its sequence and first difference: replay one with --seeds S:S+1. Every rank draws
//   the same sequence (same seed), as SPMD training requires.
//   --sequence runs the given calls instead of random ones (the seed still picks the model), one
//   code each, comma-separated:
//     Z0 zero_grad(set_to_none=false)   Z zero_grad()                     F forward
//     A forward, two losses on its output (backwarded apart by P)         E forward under NoGradGuard
//     I forward under InferenceMode     G forward never backwarded        B backward of the pending sum
//     R backward(retain_graph)          P backward of each pending loss on its own
//     N no_sync{forward; backward}      C clip_grad_norm_ (refused after N until a synchronized backward)
//     S optimizer.step() (refused likewise)                               T freeze or unfreeze a block
//     X a forward that throws           Y backward with a parameter hook that throws
//     Q torch::autograd::grad of the parameters (refused)                 U unshard(){forward; backward}
#include <map>
#include <random>
#include <sstream>

#include "engine/flat_param.h"
#include "fuzz_models.h"

namespace worker {
namespace {
using namespace fuzz;

enum class Call { ZERO_GRAD, ZERO_GRAD_TO_NONE, FORWARD, FORWARD_TWO_LOSSES, EVAL_NO_GRAD, EVAL_INFERENCE,
                  FORWARD_NEVER_BACKWARDED, BACKWARD, BACKWARD_RETAIN_GRAPH, BACKWARD_EACH, NO_SYNC_MICRO_BATCH, CLIP,
                  STEP, TOGGLE_FROZEN, THROW_IN_FORWARD, THROW_IN_BACKWARD, GRAD_OF_PARAMETERS, UNSHARDED_STEP };
struct CallInfo {
  const char* code;
  const char* name;
};
const CallInfo kCalls[] = {{"Z0", "zero_grad(set_to_none=false)"}, {"Z", "zero_grad()"}, {"F", "forward"},
                           {"A", "forward with two losses"}, {"E", "forward under NoGradGuard"},
                           {"I", "forward under InferenceMode"}, {"G", "forward never backwarded"},
                           {"B", "backward"}, {"R", "backward(retain_graph)"}, {"P", "backward of each loss apart"},
                           {"N", "no_sync{forward; backward}"}, {"C", "clip_grad_norm_"}, {"S", "optimizer.step()"},
                           {"T", "freeze/unfreeze a block"}, {"X", "forward that throws"},
                           {"Y", "backward whose parameter hook throws"}, {"Q", "autograd::grad of the parameters"},
                           {"U", "unshard(){forward; backward}"}};
const char* name_of(Call c) { return kCalls[static_cast<int>(c)].name; }

struct Tolerance {
  double atol, rtol;
  bool close(double mine, double ref) const { return std::abs(mine - ref) <= atol + rtol * std::abs(ref); }
};

struct Seed {
  std::ostringstream calls;  // the sequence so far
  std::string failure;       // the first difference
  void fail(const std::string& what) {
    if (failure.empty()) failure = what;
  }
};

// This rank's part of `mine` (a parameter or its gradient: 1-D shard, or whole while unsharded or
// with F = 1) against the same elements of `ref`.
void compare(Seed& s, const char* kind, const std::string& fqn, const torch::Tensor& mine, const torch::Tensor& ref,
             const fsdp::ShardSlice& slice, const Tolerance& tol) {
  if (!ref.defined() || !mine.defined()) {
    if (slice.length > 0 && ref.defined() != mine.defined()) {
      s.fail(std::string(kind) + " of " + fqn + " is " + (mine.defined() ? "defined" : "None") + " under fsdp but " +
             (ref.defined() ? "defined" : "None") + " in the reference");
    }
    return;
  }
  const auto r = ref.detach().to(torch::kCPU, torch::kDouble).reshape(-1);
  auto m = mine.detach().to(torch::kCPU, torch::kDouble).reshape(-1);
  const auto want = m.numel() == r.numel() ? r : r.narrow(0, slice.param_begin, slice.length);
  if (m.numel() != want.numel()) {
    s.fail(std::string(kind) + " of " + fqn + " has " + std::to_string(m.numel()) + " elements, expected " +
           std::to_string(want.numel()));
    return;
  }
  if (m.numel() == 0) return;
  const double excess = ((m - want).abs() - tol.rtol * want.abs()).max().item<double>();
  if (excess > tol.atol) {
    s.fail(std::string(kind) + " of " + fqn + " differs by " + std::to_string(excess + tol.atol) +
           " (max |Δ| beyond the relative tolerance)");
  }
}

std::vector<Call> parse_sequence(const std::string& text) {
  std::map<std::string, Call> codes;
  for (int i = 0; i < static_cast<int>(std::size(kCalls)); ++i) codes[kCalls[i].code] = static_cast<Call>(i);
  std::vector<Call> out;
  std::stringstream in(text);
  std::string code;
  while (std::getline(in, code, ',')) {
    auto it = codes.find(code);
    if (it == codes.end()) throw std::invalid_argument("fuzz: unknown call code '" + code + "' in --sequence");
    out.push_back(it->second);
  }
  return out;
}

// The seed's model and loop features, drawn from its own generator (every rank the same).
Features draw_features(std::mt19937_64& rng, bool mixed_precision, uint64_t seed) {
  Features f;
  f.gpt = rng() % 2 == 0;
  static const char* kOptimizers[] = {"sgd", "sgd", "adam", "adamw"};
  f.optimizer = kOptimizers[rng() % 4];
  // Adam's update is about lr whatever the gradient's size: a gradient near zero whose sign bf16
  // rounding flips moves a parameter by 2 lr, more than the replay's tolerance. In bf16, SGD only.
  if (mixed_precision) f.optimizer = "sgd";
  f.frozen_block = rng() % 4 == 0;
  // In-place writes in forward and a nested teacher: fp32 only (a write under mixed precision is
  // refused, holes.cpp tests that; the teacher's own casts have no replay).
  f.max_norm = f.gpt && !mixed_precision && rng() % 3 == 0;
  f.teacher = f.gpt && !mixed_precision && rng() % 4 == 0;
  // The DHEN-like model, its rows outside fsdp: fp32 (fsdp casts none of the rows it ignores,
  // which the replay's working copies would).
  f.dhen = !f.gpt && !mixed_precision && rng() % 2 == 0;
  // Drawn apart (issue 35), so that the seeds drawn before keep their models and calls: a weight
  // shared by two units neither of which is the root, and a second wrapped model trained with it.
  std::mt19937_64 extra(seed * 0x9E3779B97F4A7C15ULL + 35);
  if (!f.gpt && !f.dhen) {
    f.tied = extra() % 2 == 0;
    f.two_roots = !mixed_precision && extra() % 2 == 0;
  }
  return f;
}

template <typename Out>
std::string run_seed(const std::shared_ptr<fsdp::Mesh>& mesh, fsdp::Options opts, uint64_t seed, int calls,
                     const std::optional<fsdp::MixedPrecision>& mp, const std::vector<Call>& given,
                     const std::string& forced) {
  const int W = mesh->world_size(), rank = mesh->rank();
  const int64_t per = kGlobalBatch / W;
  std::mt19937_64 rng(seed * 2654435761ULL + 17);
  Features features = draw_features(rng, mp.has_value(), seed);
  if (!forced.empty()) features.force(forced);
  if (features.two_roots && mp) throw std::invalid_argument("fuzz: two_roots runs in fp32 only (the replay has no second root)");
  const double lr = 0.1;
  // Adam's step is about lr whatever the gradient's size, so the rounding of a gradient near zero
  // (the reduction sums in another order than local training) can move a parameter by up to 2 lr
  // (2e-2 here): Adam's tolerance is 1e-3, which a gradient that is unreduced or reduced wrong
  // (other signs, not only another scale) still exceeds; SGD's catches scale errors.
  const bool adam = features.optimizer != "sgd";
  const Tolerance tol = mp ? Tolerance{2e-3, 2e-2} : adam ? Tolerance{1e-3, 1e-3} : Tolerance{1e-5, 1e-4};
  const Tolerance loss_tol = mp ? Tolerance{1e-3, 1e-3} : Tolerance{1e-5, 1e-5};
  // Mixed precision against the same loop in fp32: the stated tolerance of bf16 compute.
  const Tolerance fp32_loss_tol{5e-2, 3e-2};

  auto net = std::make_shared<FuzzNetImpl<Out>>(features, mesh);
  opts.auto_wrap_policy = net->core.policy();
  opts.ignored_modules = net->core.ignored();
  opts.mixed_precision = mp;
  // A teacher wrapped on its own, called inside the student's forward (nested roots).
  std::optional<Core> teacher_core;
  std::unique_ptr<fsdp::FullyShardedDataParallel<torch::nn::Module>> teacher;
  if (features.teacher) {
    teacher_core = make_core(features, 1);
    fsdp::Options topts = opts;
    teacher = std::make_unique<fsdp::FullyShardedDataParallel<torch::nn::Module>>(teacher_core->module, mesh, topts);
    net->teacher = [&](const torch::Tensor& x) {
      torch::NoGradGuard no_grad;
      return teacher->forward_with([&] { return teacher_core->run(x); });
    };
  }
  fsdp::FullyShardedDataParallel<FuzzNetImpl<Out>> sharded(net, mesh, opts);
  // A second model wrapped on its own, whose output is the core's input (trained with it).
  torch::nn::Sequential second{nullptr};
  std::unique_ptr<fsdp::FullyShardedDataParallel<torch::nn::SequentialImpl>> second_root;
  if (features.two_roots) {
    second = make_second_root();
    fsdp::Options sopts = opts;
    sopts.auto_wrap_policy = fsdp::module_type_policy<torch::nn::LinearImpl>();
    sopts.ignored_modules.clear();
    second_root = std::make_unique<fsdp::FullyShardedDataParallel<torch::nn::SequentialImpl>>(second, mesh, sopts);
  }
  auto forward_all = [&](const torch::Tensor& x) {
    return sharded.forward(second_root ? second_root->forward(x) : x);
  };
  std::vector<torch::Tensor> params;
  for (auto& kv : unique_params(*net)) params.push_back(kv.second);
  if (second_root) {
    for (auto& p : second_root->parameters()) params.push_back(p);
  }
  auto optim = make_optimizer(features.optimizer, params, lr);
  auto ref = make_reference(features, W, mp, lr);
  std::unique_ptr<Reference> fp32 = mp ? make_reference(features, W, std::nullopt, lr) : nullptr;

  Seed s;
  s.calls << features.describe() << ", forward returns " << fuzz::name_of(static_cast<OutKind>(seed % kOutKinds)) << ":";
  std::vector<torch::Tensor> pending;  // this rank's losses not backwarded yet
  std::vector<int> pending_forwards;   // how many of them each forward left
  bool unsynced = false;               // a no_sync backward not followed by a synchronized one
  int64_t batch = 0;
  auto named = [&](const std::string& fqn) {
    for (auto& [name, p] : unique_params(*net)) {
      if (name == fqn) return p;
    }
    throw std::invalid_argument("fuzz: no parameter " + fqn);
  };
  auto forward_both = [&](ForwardKind kind) {
    const int64_t b = batch++;
    const double want = ref->forward(b, kind);
    const double want32 = fp32 ? fp32->forward(b, kind) : 0;
    const bool grad = kind == ForwardKind::GRAD || kind == ForwardKind::TWO_LOSSES;
    auto [x, y] = net->core.data(b, rank * per, (rank + 1) * per);
    torch::Tensor out, loss;
    {
      std::optional<c10::InferenceMode> inference;
      if (kind == ForwardKind::INFERENCE) inference.emplace();
      torch::AutoGradMode mode(grad);
      out = unpack(forward_all(x));
      loss = net->core.loss(out, y);
    }
    const double got = global_mean(mesh, loss);
    if (!loss_tol.close(got, want)) s.fail("loss " + std::to_string(got) + " under fsdp, " + std::to_string(want) + " in the reference");
    if (fp32 && !fp32_loss_tol.close(got, want32)) {
      s.fail("loss " + std::to_string(got) + " under fsdp, " + std::to_string(want32) + " in the fp32 loop");
    }
    if (grad) {
      pending.push_back(loss);
      pending_forwards.push_back(1);
      if (kind == ForwardKind::TWO_LOSSES) {
        pending.push_back(net->core.aux_loss(out));
        pending_forwards.back() = 2;
      }
    }
  };
  auto refs = [&](auto&& fn) {
    fn(*ref);
    if (fp32) fn(*fp32);
  };
  auto drop_pending = [&] {
    pending.clear();
    pending_forwards.clear();
  };
  auto sum_of_pending = [&] {
    torch::Tensor sum = pending[0];
    for (size_t i = 1; i < pending.size(); ++i) sum = sum + pending[i];
    return sum;
  };
  auto backward_both = [&](bool retain, bool no_sync) {
    refs([&](Reference& r) { r.backward(retain, no_sync); });
    sum_of_pending().backward({}, retain);
    if (!retain) drop_pending();
  };
  // A refusal expected by name: the call must throw, and the message must say what to do.
  auto expect_refusal = [&](const std::function<void()>& fn, const char* what, const char* says) {
    try {
      fn();
    } catch (const std::exception& e) {
      if (std::string(e.what()).find(says) == std::string::npos) s.fail(std::string(what) + " threw without naming it: " + e.what());
      return;
    }
    s.fail(std::string(what) + " was not refused");
  };

  if (!given.empty()) calls = static_cast<int>(given.size());
  bool stop = false;  // the loop ends after this call (a refused step)
  for (int c = 0; c < calls && s.failure.empty() && !stop; ++c) {
    std::vector<Call> allowed{Call::ZERO_GRAD, Call::ZERO_GRAD_TO_NONE};
    // An embedding with max_norm writes its weight in every forward, which a graph still waiting
    // for its backward has saved: in plain libtorch too, autograd refuses that loop (a tensor it
    // needs was modified in place). So with max_norm a forward waits for the last one's backward.
    if (!features.max_norm || pending.empty()) {
      allowed.insert(allowed.end(), {Call::FORWARD, Call::FORWARD, Call::FORWARD_TWO_LOSSES, Call::EVAL_NO_GRAD,
                                     Call::EVAL_INFERENCE, Call::FORWARD_NEVER_BACKWARDED});
    }
    if (!features.max_norm) allowed.push_back(Call::THROW_IN_FORWARD);
    if (!pending.empty()) {
      allowed.insert(allowed.end(), {Call::BACKWARD, Call::BACKWARD, Call::BACKWARD_RETAIN_GRAPH, Call::BACKWARD_EACH,
                                     Call::THROW_IN_BACKWARD, Call::GRAD_OF_PARAMETERS});
    }
    if (pending.empty()) allowed.push_back(Call::NO_SYNC_MICRO_BATCH);
    if (pending.empty()) allowed.insert(allowed.end(), {Call::CLIP, Call::STEP, Call::STEP});
    if (pending.empty() && !unsynced) allowed.insert(allowed.end(), {Call::TOGGLE_FROZEN, Call::UNSHARDED_STEP});
    const Call call = given.empty() ? allowed[rng() % allowed.size()] : given[static_cast<size_t>(c)];
    s.calls << " " << name_of(call) << ";";
    try {
      switch (call) {
        case Call::ZERO_GRAD:
        case Call::ZERO_GRAD_TO_NONE:
          optim->zero_grad(call == Call::ZERO_GRAD_TO_NONE);
          refs([&](Reference& r) { r.zero_grad(call == Call::ZERO_GRAD_TO_NONE); });
          if (call == Call::ZERO_GRAD_TO_NONE) unsynced = false;  // nothing unreduced is left
          break;
        case Call::FORWARD: forward_both(ForwardKind::GRAD); break;
        case Call::FORWARD_TWO_LOSSES: forward_both(ForwardKind::TWO_LOSSES); break;
        case Call::EVAL_NO_GRAD: forward_both(ForwardKind::NO_GRAD); break;
        case Call::EVAL_INFERENCE: forward_both(ForwardKind::INFERENCE); break;
        case Call::FORWARD_NEVER_BACKWARDED:
          forward_both(ForwardKind::GRAD);
          refs([&](Reference& r) { r.drop_graph(); });
          pending.pop_back();
          pending_forwards.pop_back();
          break;
        case Call::BACKWARD:
          backward_both(false, false);
          unsynced = false;
          break;
        case Call::BACKWARD_RETAIN_GRAPH:
          backward_both(true, false);
          unsynced = false;
          break;
        case Call::BACKWARD_EACH:
          refs([&](Reference& r) { r.backward_each(); });
          {
            // Without retain_graph between forwards: each forward's graph is backwarded once.
            const std::vector<bool> retain = retain_for_each(pending_forwards);
            for (size_t i = 0; i < pending.size(); ++i) pending[i].backward({}, retain[i]);
          }
          drop_pending();
          unsynced = false;
          break;
        case Call::NO_SYNC_MICRO_BATCH: {
          auto guard = sharded.no_sync();
          std::optional<fsdp::FullyShardedDataParallelBase::NoSync> second_guard;
          if (second_root) second_guard.emplace(second_root->no_sync());
          forward_both(ForwardKind::GRAD);
          backward_both(false, true);
          unsynced = true;
          break;
        }
        case Call::CLIP:
          if (unsynced) {
            expect_refusal([&] { sharded.clip_grad_norm_(0.05, net->core.model_parallel()); },
                           "clip_grad_norm_ after no_sync", "no_sync");
          } else {
            // The DHEN's rows are outside fsdp: the norm counts them as model-parallel. Each
            // wrapped model clips its own gradients (the reference clips each model apart).
            sharded.clip_grad_norm_(0.05, net->core.model_parallel());
            if (second_root) second_root->clip_grad_norm_(0.05);
            refs([&](Reference& r) { r.clip(0.05); });
          }
          break;
        case Call::STEP:
          if (unsynced) {
            expect_refusal([&] { optim->step(); }, "optimizer.step() after no_sync", "no_sync");
            // Refused at the first operator that reads a gradient: SGD may have scaled a momentum
            // buffer, Adam its moments, before it. The loop is wrong and ends here.
            stop = true;
          } else {
            optim->step();
            refs([&](Reference& r) { r.step(); });
          }
          break;
        case Call::TOGGLE_FROZEN:
          for (auto& p : net->core.toggle_module().parameters()) p.requires_grad_(!p.requires_grad());
          refs([&](Reference& r) { r.toggle_frozen(); });
          break;
        case Call::THROW_IN_FORWARD: {
          auto [x, y] = net->core.data(batch, rank * per, (rank + 1) * per);
          if (mp && x.is_floating_point()) x = x.to(mp->param_dtype);  // as forward() casts its inputs
          try {
            sharded.forward_with([&]() -> torch::Tensor {
              net->core.run(x);
              throw std::runtime_error("fuzz: forward throws");
            });
            s.fail("the forward did not throw");
          } catch (const std::exception& e) {
            if (std::string(e.what()).find("fuzz: forward throws") == std::string::npos) throw;
          }
          break;
        }
        case Call::THROW_IN_BACKWARD: {
          unsynced = false;  // a synchronized backward, which reduces what it got to before it threw
          // A hook on a parameter that will get a gradient (drawn among those requiring one).
          std::vector<std::string> names;
          for (auto& [name, p] : unique_params(*net)) {
            if (p.requires_grad() && name.rfind("core.", 0) == 0 && name.find("unused") == std::string::npos &&
                name.find("sparse") == std::string::npos) {
              names.push_back(name);
            }
          }
          const std::string fqn = names[rng() % names.size()];
          s.calls << " (at " << fqn << ")";
          refs([&](Reference& r) { r.backward_throwing_at(fqn); });
          torch::Tensor hooked = named(fqn);
          const unsigned handle = hooked.register_hook(
              [](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("fuzz: hook throws"); });
          try {
            sum_of_pending().backward();
          } catch (const std::exception& e) {
            if (std::string(e.what()).find("fuzz: hook throws") == std::string::npos) {
              hooked.remove_hook(handle);
              throw;
            }
          }
          hooked.remove_hook(handle);
          drop_pending();
          if (mp) {
            // Under mixed precision a parameter gathered in another dtype gets an AccumulateGrad
            // node per forward (set_data of another dtype makes a new one), which the replay's
            // working copies do not: which part of the gradient was in when the hook threw differs.
            // The loop skips that batch, as training does: zero_grad.
            optim->zero_grad();
            refs([&](Reference& r) { r.zero_grad(true); });
          }
          break;
        }
        case Call::GRAD_OF_PARAMETERS: {
          std::vector<torch::Tensor> wanted;
          for (auto& p : sharded.parameters()) {
            if (p.requires_grad()) wanted.push_back(p);
          }
          if (!wanted.empty() && !mp) {
            expect_refusal([&] { torch::autograd::grad({sum_of_pending()}, wanted, {}, std::nullopt, false, true); },
                           "torch::autograd::grad of the parameters", "torch::autograd::grad");
          } else if (!wanted.empty()) {
            // Under mixed precision the graph accumulates into the nodes of the compute copies
            // (set_data of another dtype makes new ones): the parameters asked about at rest are
            // not in it, so libtorch gives no gradient for them (or, without allow_unused, says
            // they were not used). Refused, or nothing: never a number.
            try {
              const auto grads = torch::autograd::grad({sum_of_pending()}, wanted, {}, std::nullopt, false, true);
              for (const auto& g : grads) {
                if (g.defined()) s.fail("torch::autograd::grad of the parameters returned a gradient under mixed precision");
              }
            } catch (const std::exception& e) {
              if (std::string(e.what()).find("torch::autograd::grad") == std::string::npos) throw;
            }
          }
          refs([&](Reference& r) { r.drop_all_graphs(); });
          drop_pending();
          break;
        }
        case Call::UNSHARDED_STEP: {
          auto whole = sharded.unshard();
          std::optional<fsdp::FullyShardedDataParallelBase::Unsharded> second_whole;
          if (second_root) second_whole.emplace(second_root->unshard());
          forward_both(ForwardKind::GRAD);
          backward_both(false, false);
          break;
        }
      }
    } catch (const std::exception& e) {
      s.fail(std::string("threw: ") + e.what());
    }
    // Every parameter and gradient, this rank's part of it; not while gradients wait in the
    // no_sync accumulator for a synchronized backward.
    if (!unsynced && !stop && s.failure.empty()) {
      auto mine = net->named_parameters();
      auto ref_params = ref->params();
      auto ref_grads = ref->grads();
      const int F = sharded.shard_size();
      for (const auto& unit : sharded.units()) {
        std::vector<std::vector<int64_t>> shapes;
        for (const auto& f : unit.fqns) shapes.push_back(ref_params.at(f).sizes().vec());
        const fsdp::FlatParamLayout layout(unit.fqns, shapes, F);
        for (size_t i = 0; i < unit.fqns.size(); ++i) {
          const auto slice = layout.slice(i, rank % F);
          compare(s, "parameter", unit.fqns[i], mine[unit.fqns[i]], ref_params.at(unit.fqns[i]), slice, tol);
          compare(s, "gradient", unit.fqns[i], mine[unit.fqns[i]].grad(), ref_grads.at(unit.fqns[i]), slice, tol);
        }
      }
      // The second root's units, against the reference's second model ("second.<name>").
      if (second_root) {
        std::map<std::string, torch::Tensor> second_params;
        for (const auto& item : second->named_parameters()) second_params[item.key()] = item.value();
        for (const auto& unit : second_root->units()) {
          std::vector<std::vector<int64_t>> shapes;
          for (const auto& f : unit.fqns) shapes.push_back(ref_params.at("second." + f).sizes().vec());
          const fsdp::FlatParamLayout layout(unit.fqns, shapes, second_root->shard_size());
          for (size_t i = 0; i < unit.fqns.size(); ++i) {
            const auto slice = layout.slice(i, rank % second_root->shard_size());
            const auto& p = second_params.at(unit.fqns[i]);
            compare(s, "parameter", "second." + unit.fqns[i], p, ref_params.at("second." + unit.fqns[i]), slice, tol);
            compare(s, "gradient", "second." + unit.fqns[i], p.grad(), ref_grads.at("second." + unit.fqns[i]), slice, tol);
          }
        }
      }
      // The DHEN's rows this rank holds, against the same rows of the reference's whole table.
      const auto [row_begin, rows] = net->core.rows();
      if (rows > 0) {
        const fsdp::ShardSlice whole{0, 0, rows * ref_params.at("core.sparse.weight").size(1)};
        const torch::Tensor p = net->core.model_parallel()[0];
        auto ref_rows = [&](const torch::Tensor& t) { return t.defined() ? t.narrow(0, row_begin, rows) : t; };
        compare(s, "parameter", "core.sparse.weight (this rank's rows)", p, ref_rows(ref_params.at("core.sparse.weight")), whole, tol);
        compare(s, "gradient", "core.sparse.weight (this rank's rows)", p.grad(), ref_rows(ref_grads.at("core.sparse.weight")), whole, tol);
      }
    }
    if (!s.failure.empty()) s.failure = "after call " + std::to_string(c) + " (" + name_of(call) + "): " + s.failure;
    // Every rank compares its own shards: one that found a difference stops the seed, and so must
    // the others, before their next collective would wait for it.
    std::vector<at::Tensor> flag{torch::tensor({s.failure.empty() ? 0.0f : 1.0f})};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    mesh->world()->allreduce(flag, max)->wait();
    if (flag[0].item<float>() > 0 && s.failure.empty()) s.fail("after call " + std::to_string(c) + ": another rank found a difference");
  }
  return s.failure.empty() ? "" : s.calls.str() + "\n  " + s.failure;
}

}  // namespace

json run_fuzz(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const auto colon = a.seeds.find(':');
  const uint64_t first = std::stoull(a.seeds.substr(0, colon));
  const uint64_t last = colon == std::string::npos ? first + 1 : std::stoull(a.seeds.substr(colon + 1));
  std::optional<fsdp::MixedPrecision> mp;
  if (a.mixed_precision != "none") {
    const auto d = fsdp::parse_dtype(a.mixed_precision);
    mp = fsdp::MixedPrecision{d, d, d, false};
  }
  const std::vector<Call> given = a.sequence.empty() ? std::vector<Call>{} : parse_sequence(a.sequence);
  json failures = json::array();
  for (uint64_t seed = first; seed < last; ++seed) {
    const fsdp::Options opts = options_from(a);
    std::string failure;
    switch (static_cast<OutKind>(seed % kOutKinds)) {
      case OutKind::TENSOR: failure = run_seed<torch::Tensor>(mesh, opts, seed, a.calls, mp, given, a.features); break;
      case OutKind::PAIR: failure = run_seed<std::pair<torch::Tensor, int64_t>>(mesh, opts, seed, a.calls, mp, given, a.features); break;
      case OutKind::STRUCT: failure = run_seed<TwoHeads>(mesh, opts, seed, a.calls, mp, given, a.features); break;
      case OutKind::MAP: failure = run_seed<std::map<std::string, torch::Tensor>>(mesh, opts, seed, a.calls, mp, given, a.features); break;
      case OutKind::DICT: failure = run_seed<c10::Dict<std::string, torch::Tensor>>(mesh, opts, seed, a.calls, mp, given, a.features); break;
      case OutKind::IVALUE: failure = run_seed<c10::IValue>(mesh, opts, seed, a.calls, mp, given, a.features); break;
      case OutKind::NESTED: failure = run_seed<NestedOut>(mesh, opts, seed, a.calls, mp, given, a.features); break;
    }
    if (!failure.empty()) failures.push_back(json{{"seed", seed}, {"failure", failure}});
  }
  return json{{"rank", mesh->rank()}, {"seeds", last - first}, {"failures", failures}};
}

}  // namespace worker
