#include "unit_decomposition.h"

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

std::vector<UnitPlan> decompose(torch::nn::Module& root, const WrapPolicy& policy) {
  Decomposer d{policy, {}, {}, {}};
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    d.first_fqn.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  for (const auto& child : root.named_children()) d.visit(*child.value(), child.key());
  auto rest = d.unclaimed(root);
  if (!rest.empty()) d.claim("", root, std::move(rest), true);
  return std::move(d.units);
}

}  // namespace fsdp
