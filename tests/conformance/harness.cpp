// What every scenario shares: the variants, the comparisons against local training, the registry.
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "conformance.h"

namespace conformance {

void Ctx::fail(const std::string& what) {
  failures.push_back((variant.empty() ? "" : variant + ": ") + what);
  // FSDP_CONFORMANCE_VERBOSE=1: each failure as it happens (a scenario that then hangs or aborts
  // writes no result file).
  if (std::getenv("FSDP_CONFORMANCE_VERBOSE")) {
    std::cerr << ("rank " + std::to_string(rank) + ": " + failures.back() + "\n") << std::flush;
  }
}

void Ctx::expect_near(const std::string& what, double got, double want, double tol) {
  if (std::isfinite(got) && std::isfinite(want) && std::abs(got - want) <= tol) return;
  std::ostringstream s;
  s << what << ": " << got << " under fsdp, " << want << " in local training (|diff| " << std::abs(got - want)
    << ", tolerance " << tol << ")";
  fail(s.str());
}

void Ctx::expect_refused(const std::string& what, const std::function<void()>& fn, const std::vector<std::string>& says) {
  try {
    fn();
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    for (const auto& s : says) {
      if (msg.find(s) == std::string::npos) {
        fail(what + " was refused, but the message does not say \"" + s + "\": " + msg);
        return;
      }
    }
    return;
  }
  fail(what + " was not refused");
}

void Ctx::expect_ok(const std::string& what, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    fail(what + " threw: " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(what + " threw: " + e.what());
  }
}

void Ctx::figure(const std::string& key, double value) {
  const std::string k = (variant.empty() ? "" : variant + ": ") + key;
  if (!figures.contains(k) || figures[k].get<double>() < value) figures[k] = value;
}

namespace {
Variant make_variant(const std::string& strategy, int shard_size, bool bf16, int world) {
  Variant v;
  v.options.strategy = fsdp::parse_strategy(strategy);
  v.options.shard_size = shard_size;
  const int F = strategy == "no_shard" ? 1 : shard_size > 0 ? shard_size : world;
  v.name = strategy + " F=" + std::to_string(F);
  if (bf16) {
    v.options.mixed_precision = fsdp::MixedPrecision{torch::kBFloat16, torch::kBFloat16, torch::kBFloat16, false};
    v.name += " bf16";
  }
  return v;
}
}  // namespace

std::vector<Variant> every_strategy(const Ctx& c, bool bf16) {
  std::vector<Variant> out;
  for (const bool low : {false, true}) {
    if (low && !bf16) break;
    for (const char* s : {"full_shard", "shard_grad_op", "no_shard"}) out.push_back(make_variant(s, 0, low, c.world));
    if (c.world == 4) {
      out.push_back(make_variant("hybrid_shard", 2, low, c.world));
      out.push_back(make_variant("hybrid_shard_zero2", 2, low, c.world));
    }
  }
  return out;
}

Variant strategy(const Ctx& c, const std::string& name) {
  const bool hybrid = name.rfind("hybrid", 0) == 0;
  return make_variant(name, hybrid ? 2 : 0, false, c.world);
}

void for_each(Ctx& c, const std::vector<Variant>& variants, const std::function<void(const Variant&)>& body) {
  for (const auto& v : variants) {
    c.variant = v.name;
    c.expect_ok("the scenario", [&] { body(v); });
    // Every rank reaches here before the next variant: a rank that failed early waits for the rest.
    std::vector<at::Tensor> flag{torch::zeros({1})};
    c.mesh->world()->allreduce(flag)->wait();
  }
  c.variant.clear();
}

torch::Tensor my_rows(const Ctx& c, const torch::Tensor& global) {
  const int64_t per = global.size(0) / c.world;
  TORCH_CHECK(per * c.world == global.size(0), "conformance: a global batch of ", global.size(0),
              " rows does not divide among ", c.world, " ranks");
  return global.narrow(0, c.rank * per, per);
}

double global_mean(const Ctx& c, double local) {
  std::vector<at::Tensor> t{torch::tensor({local}, torch::kDouble)};
  c.mesh->world()->allreduce(t)->wait();
  return t[0].item<double>() / c.world;
}

torch::Tensor randn(uint64_t seed, at::IntArrayRef sizes) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(sizes, gen, at::kFloat);
}

torch::Tensor randint(uint64_t seed, int64_t high, at::IntArrayRef sizes) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(high, sizes, gen, at::TensorOptions().dtype(at::kLong));
}

std::map<std::string, torch::Tensor> state_of(torch::nn::Module& m, bool buffers) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters(true)) out[p.key()] = p.value().detach().clone();
  if (buffers) {
    for (const auto& b : m.named_buffers(true)) {
      if (b.value().defined()) out[b.key()] = b.value().detach().clone();
    }
  }
  return out;
}

std::map<std::string, torch::Tensor> whole_state(fsdp::FullyShardedDataParallelBase& wrapped, torch::nn::Module& mine,
                                                 bool buffers) {
  auto whole = wrapped.summon_full_params({/*writeback=*/false, /*rank0_only=*/false});
  return state_of(mine, buffers);
}

void expect_same_tensor(Ctx& c, const std::string& what, const torch::Tensor& got, const torch::Tensor& want, double tol) {
  if (!got.defined() || !want.defined()) {
    if (got.defined() != want.defined()) {
      c.fail(what + " is " + (got.defined() ? "defined" : "undefined") + " under fsdp but " +
             (want.defined() ? "defined" : "undefined") + " in local training");
    }
    return;
  }
  if (got.sizes() != want.sizes()) {
    std::ostringstream s;
    s << what << " has shape " << got.sizes() << " under fsdp, " << want.sizes() << " in local training";
    c.fail(s.str());
    return;
  }
  if (got.scalar_type() != want.scalar_type()) {
    c.fail(what + " is " + std::string(c10::toString(got.scalar_type())) + " under fsdp, " +
           c10::toString(want.scalar_type()) + " in local training");
    return;
  }
  if (got.numel() == 0) return;
  const double diff = (got.detach().to(torch::kDouble) - want.detach().to(torch::kDouble)).abs().max().item<double>();
  c.figure("max_diff", diff);
  if (!(diff <= tol)) {
    std::ostringstream s;
    s << what << " differs from local training by " << diff << " (tolerance " << tol << ")";
    c.fail(s.str());
  }
}

double expect_same_model(Ctx& c, fsdp::FullyShardedDataParallelBase& wrapped, torch::nn::Module& mine,
                         torch::nn::Module& local, double tol, bool buffers) {
  const auto got = whole_state(wrapped, mine, buffers);
  const auto want = state_of(local, buffers);
  double worst = 0;
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    if (it == got.end()) {
      c.fail("the wrapped model has no " + name);
      continue;
    }
    expect_same_tensor(c, name, it->second, w, tol);
    if (it->second.sizes() == w.sizes() && w.numel() > 0) {
      worst = std::max(worst, (it->second.to(torch::kDouble) - w.to(torch::kDouble)).abs().max().item<double>());
    }
  }
  c.figure("max_param_diff", worst);
  return worst;
}

std::vector<torch::Tensor> unique_parameters(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : m.parameters(true)) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

namespace {
std::vector<Case>& registry() {
  static std::vector<Case> r;
  return r;
}
}  // namespace

int register_case(Case c) {
  // __FILE__ to its stem: "/.../tests/conformance/activation_checkpoint.cpp" -> "activation_checkpoint".
  const auto slash = c.file.find_last_of('/');
  if (slash != std::string::npos) c.file = c.file.substr(slash + 1);
  const auto dot = c.file.rfind('.');
  if (dot != std::string::npos) c.file = c.file.substr(0, dot);
  registry().push_back(std::move(c));
  return static_cast<int>(registry().size());
}

const std::vector<Case>& cases() { return registry(); }

}  // namespace conformance
