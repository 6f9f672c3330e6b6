#include "engine/unit_decomposition.h"

#include <memory>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "fsdp/fsdp.h"

namespace fsdp {
namespace {
// Marks by address, each with a weak reference to its module: a mark whose module has died (or
// whose address now holds another module) no longer counts, and is dropped at the next mark.
std::mutex g_marks_mutex;
std::unordered_map<const torch::nn::Module*, std::weak_ptr<const torch::nn::Module>> g_marks;

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

struct Decomposer {
  const WrapPolicy& policy;
  std::unordered_map<const c10::TensorImpl*, std::string> first_fqn;  // from the root's view
  std::unordered_set<const c10::TensorImpl*> claimed;
  std::vector<UnitPlan> units;

  // Unclaimed parameters of `m`'s subtree, in named_parameters() order, each once.
  std::vector<at::Tensor> unclaimed(const torch::nn::Module& m) {
    std::vector<at::Tensor> out;
    std::unordered_set<const c10::TensorImpl*> seen;
    for (const auto& item : m.named_parameters(/*recurse=*/true)) {
      const c10::TensorImpl* impl = item.value().unsafeGetTensorImpl();
      if (claimed.count(impl) || !seen.insert(impl).second) continue;
      out.push_back(item.value());
    }
    return out;
  }

  void claim(const std::string& name, const torch::nn::Module& m, std::vector<at::Tensor> params, bool is_root) {
    UnitPlan u;
    u.name = name;
    u.module = &m;
    u.is_root = is_root;
    for (auto& p : params) {
      claimed.insert(p.unsafeGetTensorImpl());
      u.fqns.push_back(first_fqn.at(p.unsafeGetTensorImpl()));
      u.params.push_back(p);
    }
    for (const auto& sub : m.modules(/*include_self=*/true)) u.subtree.insert(sub.get());
    units.push_back(std::move(u));
  }

  void visit(const torch::nn::Module& m, const std::string& prefix) {
    for (const auto& child : m.named_children()) visit(*child.value(), join(prefix, child.key()));
    auto params = unclaimed(m);
    if (params.empty()) return;
    int64_t numel = 0;
    for (const auto& p : params) numel += p.numel();
    if (is_marked_unit(m) || (policy && policy(prefix, m, numel))) claim(prefix, m, std::move(params), false);
  }
};
}  // namespace

void fully_shard(const torch::nn::Module& module) {
  std::weak_ptr<const torch::nn::Module> owner = module.weak_from_this();
  if (owner.expired()) {
    throw std::invalid_argument("fsdp::fully_shard: the module is not owned by a std::shared_ptr (a module on the "
                                "stack?). Mark modules of a model held the libtorch way: registered submodules "
                                "or TORCH_MODULE holders.");
  }
  std::lock_guard<std::mutex> lock(g_marks_mutex);
  for (auto it = g_marks.begin(); it != g_marks.end();) {
    it = it->second.expired() ? g_marks.erase(it) : std::next(it);
  }
  g_marks[&module] = std::move(owner);
}

bool is_marked_unit(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(g_marks_mutex);
  auto it = g_marks.find(&module);
  if (it == g_marks.end()) return false;
  const auto alive = it->second.lock();
  return alive && alive.get() == &module;
}

IgnoredSet ignored_tensors(const torch::nn::Module& root, const Options& options) {
  IgnoredSet out;
  if (options.ignored_modules.empty() && options.ignored_parameters.empty()) return out;
  std::unordered_set<const torch::nn::Module*> modules;
  for (const auto& m : root.modules(/*include_self=*/true)) modules.insert(m.get());
  IgnoredSet params;
  for (const auto& p : root.parameters(/*recurse=*/true)) params.insert(p.unsafeGetTensorImpl());
  for (const auto& m : options.ignored_modules) {
    if (!m || !modules.count(m.get())) {
      throw std::invalid_argument("fsdp: an entry of Options::ignored_modules (" + (m ? m->name() : std::string("null")) +
                                  ") is not a module of the wrapped model; pass the model's own submodules");
    }
    if (m.get() == &root) {
      throw std::invalid_argument("fsdp: Options::ignored_modules holds the wrapped model itself: nothing would be "
                                  "sharded; train it without fsdp, or ignore only its submodules");
    }
    for (const auto& sub : m->modules(/*include_self=*/true)) {
      if (is_marked_unit(*sub)) {
        throw std::invalid_argument("fsdp: module " + sub->name() + " is both marked with fully_shard() and inside "
                                    "Options::ignored_modules; drop one of the two");
      }
    }
    for (const auto& p : m->parameters(/*recurse=*/true)) out.insert(p.unsafeGetTensorImpl());
  }
  for (const auto& p : options.ignored_parameters) {
    if (!p.defined() || !params.count(p.unsafeGetTensorImpl())) {
      throw std::invalid_argument("fsdp: an entry of Options::ignored_parameters is not a parameter of the wrapped "
                                  "model; pass the model's own parameter tensors");
    }
    out.insert(p.unsafeGetTensorImpl());
  }
  return out;
}

std::vector<UnitPlan> decompose(torch::nn::Module& root, const WrapPolicy& policy, const IgnoredSet& ignored) {
  Decomposer d{policy, {}, {}, {}};
  d.claimed = ignored;  // claimed by no unit: the caller's
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    d.first_fqn.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  for (const auto& child : root.named_children()) d.visit(*child.value(), child.key());
  auto rest = d.unclaimed(root);
  if (!rest.empty()) d.claim("", root, std::move(rest), true);
  return std::move(d.units);
}

}  // namespace fsdp
