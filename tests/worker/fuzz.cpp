// fsdp-test-worker fuzz --strategy S [--shard-size F] [--mixed-precision none|bf16] --seeds A:B
//                       [--calls N] [--sequence CODES] --out PREFIX
//   The loop fuzzer: for each seed in [A, B), draws a random sequence of the calls a training loop
//   makes — zero_grad (to None or to zero) anywhere, forwards with and without grad, forwards
//   never backwarded, several forwards then one backward, backward with retain_graph twice,
//   no_sync micro-batches, clipping, optimizer steps — on a model whose forward returns one of
//   seven C++ types, and runs it under fsdp and under the reference (fuzz_models.h), comparing
//   losses, this rank's part of every gradient and every parameter after every call. Writes the
//   seeds that failed, each with its sequence and first difference: replay one with
//   --seeds S:S+1. Every rank draws the same sequence (same seed), as SPMD training requires.
//   --sequence runs the given calls instead of random ones (the seed still picks the model and the
//   output type), one code each, comma-separated: Z0 zero_grad(set_to_none=false), Z zero_grad(),
//   F forward, E forward under NoGradGuard, G forward never backwarded, B backward, R
//   backward(retain_graph), N no_sync{forward; backward}, C clip_grad_norm_, S optimizer.step().
#include <map>
#include <random>
#include <sstream>

#include "engine/flat_param.h"
#include "fuzz_models.h"

namespace worker {
namespace {
using namespace fuzz;

enum class Call { ZERO_GRAD, ZERO_GRAD_TO_NONE, FORWARD, EVAL_NO_GRAD, FORWARD_NEVER_BACKWARDED, BACKWARD,
                  BACKWARD_RETAIN_GRAPH, NO_SYNC_MICRO_BATCH, CLIP, STEP };
const char* kCallNames[] = {"zero_grad(set_to_none=false)", "zero_grad()", "forward", "forward under NoGradGuard",
                            "forward never backwarded", "backward", "backward(retain_graph)", "no_sync{forward; backward}",
                            "clip_grad_norm_", "optimizer.step()"};

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
  static const std::map<std::string, Call> codes = {
      {"Z0", Call::ZERO_GRAD}, {"Z", Call::ZERO_GRAD_TO_NONE}, {"F", Call::FORWARD}, {"E", Call::EVAL_NO_GRAD},
      {"G", Call::FORWARD_NEVER_BACKWARDED}, {"B", Call::BACKWARD}, {"R", Call::BACKWARD_RETAIN_GRAPH},
      {"N", Call::NO_SYNC_MICRO_BATCH}, {"C", Call::CLIP}, {"S", Call::STEP}};
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

template <typename Out>
std::string run_seed(const std::shared_ptr<fsdp::Mesh>& mesh, fsdp::Options opts, uint64_t seed, int calls,
                     const std::optional<fsdp::MixedPrecision>& mp, const std::vector<Call>& given) {
  const int W = mesh->world_size(), rank = mesh->rank();
  const int64_t per = kGlobalBatch / W;
  std::mt19937_64 rng(seed * 2654435761ULL + 17);
  const bool gpt = rng() % 2 == 0;
  const double lr = 0.1;
  const Tolerance tol = mp ? Tolerance{2e-3, 2e-2} : Tolerance{1e-5, 1e-4};
  const Tolerance loss_tol = mp ? Tolerance{1e-3, 1e-3} : Tolerance{1e-5, 1e-5};

  auto net = std::make_shared<FuzzNetImpl<Out>>(gpt);
  opts.auto_wrap_policy = net->core.policy();
  opts.mixed_precision = mp;
  fsdp::FullyShardedDataParallel<FuzzNetImpl<Out>> sharded(net, mesh, opts);
  std::vector<torch::Tensor> params;
  for (auto& kv : unique_params(*net)) params.push_back(kv.second);
  torch::optim::SGD optim(params, torch::optim::SGDOptions(lr).momentum(0.9));
  auto ref = make_reference(gpt, W, mp, lr);

  Seed s;
  s.calls << (gpt ? "tiny GPT" : "uneven net") << ", forward returns " << name_of(static_cast<OutKind>(seed % kOutKinds))
          << ":";
  std::vector<torch::Tensor> pending;  // this rank's losses not backwarded yet
  bool unsynced = false;               // a no_sync backward not followed by a synchronized one
  int64_t batch = 0;
  auto my_forward = [&](int64_t b) {
    auto [x, y] = net->core.data(b, rank * per, (rank + 1) * per);
    return net->core.loss(unpack(sharded.forward(x)), y);
  };
  auto forward_both = [&](bool grad, bool keep) {
    const int64_t b = batch++;
    const double want = ref->forward(b, grad);
    torch::Tensor loss;
    {
      torch::AutoGradMode mode(grad);
      loss = my_forward(b);
    }
    const double got = global_mean(mesh, loss);
    if (!loss_tol.close(got, want)) s.fail("loss " + std::to_string(got) + " under fsdp, " + std::to_string(want) + " in the reference");
    if (grad && keep) pending.push_back(loss);
    if (grad && !keep) ref->drop_graph();
  };
  auto backward_both = [&](bool retain, bool no_sync) {
    ref->backward(retain, no_sync);
    torch::Tensor sum = pending[0];
    for (size_t i = 1; i < pending.size(); ++i) sum = sum + pending[i];
    sum.backward({}, retain);
    if (!retain) pending.clear();
  };

  if (!given.empty()) calls = static_cast<int>(given.size());
  for (int c = 0; c < calls && s.failure.empty(); ++c) {
    std::vector<Call> allowed{Call::ZERO_GRAD, Call::ZERO_GRAD_TO_NONE, Call::FORWARD, Call::FORWARD,
                              Call::EVAL_NO_GRAD, Call::FORWARD_NEVER_BACKWARDED};
    if (!pending.empty()) allowed.insert(allowed.end(), {Call::BACKWARD, Call::BACKWARD, Call::BACKWARD_RETAIN_GRAPH});
    if (pending.empty()) allowed.push_back(Call::NO_SYNC_MICRO_BATCH);
    if (pending.empty() && !unsynced) allowed.insert(allowed.end(), {Call::CLIP, Call::STEP, Call::STEP});
    const Call call = given.empty() ? allowed[rng() % allowed.size()] : given[static_cast<size_t>(c)];
    s.calls << " " << kCallNames[static_cast<int>(call)] << ";";
    try {
      switch (call) {
        case Call::ZERO_GRAD:
        case Call::ZERO_GRAD_TO_NONE:
          optim.zero_grad(call == Call::ZERO_GRAD_TO_NONE);
          ref->zero_grad(call == Call::ZERO_GRAD_TO_NONE);
          break;
        case Call::FORWARD: forward_both(true, true); break;
        case Call::EVAL_NO_GRAD: forward_both(false, false); break;
        case Call::FORWARD_NEVER_BACKWARDED: forward_both(true, false); break;
        case Call::BACKWARD:
          backward_both(false, false);
          unsynced = false;
          break;
        case Call::BACKWARD_RETAIN_GRAPH:
          backward_both(true, false);
          unsynced = false;
          break;
        case Call::NO_SYNC_MICRO_BATCH: {
          auto guard = sharded.no_sync();
          forward_both(true, true);
          backward_both(false, true);
          unsynced = true;
          break;
        }
        case Call::CLIP:
          sharded.clip_grad_norm_(0.05);
          ref->clip(0.05);
          break;
        case Call::STEP:
          optim.step();
          ref->step();
          break;
      }
    } catch (const std::exception& e) {
      s.fail(std::string("threw: ") + e.what());
      break;
    }
    if (unsynced) continue;  // gradients wait in the no_sync accumulator until a synchronized backward
    // Every parameter and gradient, this rank's part of it.
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
    if (!s.failure.empty()) s.failure = "after call " + std::to_string(c) + " (" + kCallNames[static_cast<int>(call)] + "): " + s.failure;
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
      case OutKind::TENSOR: failure = run_seed<torch::Tensor>(mesh, opts, seed, a.calls, mp, given); break;
      case OutKind::PAIR: failure = run_seed<std::pair<torch::Tensor, int64_t>>(mesh, opts, seed, a.calls, mp, given); break;
      case OutKind::STRUCT: failure = run_seed<TwoHeads>(mesh, opts, seed, a.calls, mp, given); break;
      case OutKind::MAP: failure = run_seed<std::map<std::string, torch::Tensor>>(mesh, opts, seed, a.calls, mp, given); break;
      case OutKind::DICT: failure = run_seed<c10::Dict<std::string, torch::Tensor>>(mesh, opts, seed, a.calls, mp, given); break;
      case OutKind::IVALUE: failure = run_seed<c10::IValue>(mesh, opts, seed, a.calls, mp, given); break;
      case OutKind::NESTED: failure = run_seed<NestedOut>(mesh, opts, seed, a.calls, mp, given); break;
    }
    if (!failure.empty()) failures.push_back(json{{"seed", seed}, {"failure", failure}});
  }
  return json{{"rank", mesh->rank()}, {"seeds", last - first}, {"failures", failures}};
}

}  // namespace worker
