// A tensor-parallel plan applied to a model built whole (include/fsdp/tensor_parallel.h), and the
// placements it leaves behind. Why a plan over parameter names rather than parallel module types:
// the model keeps its modules (torch::nn::Linear stays Linear, names and initialization stay those
// of local training, so every TP rank starts from local training's exact values by slicing them),
// and the same model source runs with and without TP. docs/design.md, "Two dimensions".
#include "fsdp/tensor_parallel.h"

#include <c10/core/GradMode.h>
#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

namespace fsdp {
namespace {

// Placements by TensorImpl: fsdp swaps a parameter's data, never its TensorImpl, so the placement
// follows the parameter through sharding. The weak pointer tells a live entry from one whose
// tensor died and whose address was reused.
struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  TensorParallelPlacement placement;
};
std::mutex registry_mutex;
std::unordered_map<const c10::TensorImpl*, Entry>& registry() {
  static std::unordered_map<const c10::TensorImpl*, Entry> r;
  return r;
}
// Replicated parameters whose gradient is summed over a TP group (partial_gradient_rule).
struct PartialEntry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  std::shared_ptr<TensorParallel> tp;
};
std::unordered_map<const c10::TensorImpl*, PartialEntry>& partial_registry() {
  static std::unordered_map<const c10::TensorImpl*, PartialEntry> r;
  return r;
}

// '*' any run without '.', "**" any run at all.
bool glob(const char* p, const char* s) {
  if (*p == '\0') return *s == '\0';
  if (p[0] == '*' && p[1] == '*') {
    for (const char* t = s;; ++t) {
      if (glob(p + 2, t)) return true;
      if (*t == '\0') return false;
    }
  }
  if (*p == '*') {
    for (const char* t = s;; ++t) {
      if (glob(p + 1, t)) return true;
      if (*t == '\0' || *t == '.') return false;
    }
  }
  return *p == *s && glob(p + 1, s + 1);
}

std::string shape_text(at::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

std::vector<TensorParallelRule> column_parallel_rule(const std::string& module_pattern, int64_t parts, bool bias) {
  std::vector<TensorParallelRule> rules = {{module_pattern + ".weight", {0, parts}}};
  if (bias) rules.push_back({module_pattern + ".bias", {0, parts}});
  return rules;
}

std::vector<TensorParallelRule> row_parallel_rule(const std::string& module_pattern) {
  return {{module_pattern + ".weight", {1, 1}}};
}

TensorParallelRule partial_gradient_rule(const std::string& param_pattern) { return {param_pattern, {}, true}; }

TensorParallelRule vocab_parallel_rule(const std::string& param_pattern) { return {param_pattern, {0, 1, true}}; }

namespace {
// `n` rounded up to a multiple of `size` when padding is asked for.
int64_t padded(int64_t n, const TensorParallelShard& shard, int size) {
  return shard.pad ? (n + size - 1) / size * size : n;
}
}  // namespace

int64_t TensorParallelPlacement::split_size() const {
  return padded(full_shape.at(static_cast<size_t>(shard.dim)), shard, tp ? tp->size() : 1);
}

at::Tensor tensor_parallel_part(const at::Tensor& whole, const TensorParallelShard& shard, int rank, int size) {
  const int64_t dim = shard.dim < 0 ? shard.dim + whole.dim() : shard.dim;
  TORCH_CHECK(dim >= 0 && dim < whole.dim(), "fsdp: a tensor-parallel split along dimension ", shard.dim,
              " of a tensor of shape ", shape_text(whole.sizes()));
  const int64_t n = padded(whole.size(dim), shard, size);
  TORCH_CHECK(shard.parts >= 1 && n % (shard.parts * size) == 0, "fsdp: dimension ", dim, " of shape ",
              shape_text(whole.sizes()), " does not split into ", shard.parts, " parts of ", size, " ranks");
  if (n != whole.size(dim)) {
    // The padding rows: zeros after the whole tensor's, on the last rank(s).
    std::vector<int64_t> extra = whole.sizes().vec();
    extra[static_cast<size_t>(dim)] = n - whole.size(dim);
    return tensor_parallel_part(at::cat({whole, at::zeros(extra, whole.options())}, dim),
                                TensorParallelShard{shard.dim, shard.parts, false}, rank, size);
  }
  const int64_t part = n / shard.parts, slice = part / size;
  std::vector<at::Tensor> mine;
  for (int64_t p = 0; p < shard.parts; ++p) mine.push_back(whole.narrow(dim, p * part + rank * slice, slice));
  return at::cat(mine, dim).contiguous();
}

at::Tensor tensor_parallel_whole(const at::Tensor& part, const TensorParallelPlacement& placement) {
  const auto& tp = *placement.tp;
  const int64_t dim = placement.shard.dim, parts = placement.shard.parts;
  const at::Tensor mine = part.contiguous();
  at::Tensor flat = mine.reshape({-1});  // Gloo's all-gather wants the output as the inputs side by side
  at::Tensor all = at::empty({tp.size() * mine.numel()}, mine.options());
  auto work = tp.group(mine.device().type())->_allgather_base(all, flat);
  work->wait();
  // all = [size, *local_shape]; rank r's slice of part p sits at p * part + r * slice.
  std::vector<int64_t> local = mine.sizes().vec();
  std::vector<int64_t> stacked = {tp.size()};
  stacked.insert(stacked.end(), local.begin(), local.end());
  const at::Tensor byrank = all.view(stacked);
  const int64_t slice = local[dim] / parts;
  std::vector<at::Tensor> pieces;
  for (int64_t p = 0; p < parts; ++p)
    for (int r = 0; r < tp.size(); ++r) pieces.push_back(byrank[r].narrow(dim, p * slice, slice));
  const at::Tensor whole = at::cat(pieces, dim);
  // Without the padding rows (shard.pad): the tensor the model was built with.
  const int64_t n = placement.full_shape.at(static_cast<size_t>(dim));
  return whole.size(dim) == n ? whole : whole.narrow(dim, 0, n).contiguous();
}

void parallelize(torch::nn::Module& model, const std::shared_ptr<TensorParallel>& tp,
                 const std::vector<TensorParallelRule>& plan) {
  if (!tp) throw std::invalid_argument("fsdp::parallelize: the TensorParallel is null");
  {
    // Entries of tensors that died go first: they hold their TensorParallel (and its groups).
    std::lock_guard<std::mutex> lock(registry_mutex);
    for (auto it = registry().begin(); it != registry().end();) {
      it = it->second.impl.expired() ? registry().erase(it) : std::next(it);
    }
    for (auto it = partial_registry().begin(); it != partial_registry().end();) {
      it = it->second.impl.expired() ? partial_registry().erase(it) : std::next(it);
    }
  }
  std::vector<int> matched(plan.size(), 0);
  std::unordered_set<const c10::TensorImpl*> done;  // a tied weight is listed under each name
  at::NoGradGuard no_grad;
  for (auto& np : model.named_parameters(/*recurse=*/true)) {
    at::Tensor& p = np.value();
    const std::string& name = np.key();
    int rule = -1;
    for (size_t i = 0; i < plan.size(); ++i) {
      if (glob(plan[i].pattern.c_str(), name.c_str())) {
        rule = static_cast<int>(i);
        break;
      }
    }
    if (rule < 0) continue;
    ++matched[rule];
    if (!done.insert(p.unsafeGetTensorImpl()).second) continue;
    if (tensor_parallel_placement(p) || tensor_parallel_partial_gradient(p)) {
      throw std::invalid_argument("fsdp::parallelize: parameter '" + name + "' is split already; apply a plan once");
    }
    if (plan[rule].partial_gradient) {
      std::lock_guard<std::mutex> lock(registry_mutex);
      partial_registry().insert_or_assign(p.unsafeGetTensorImpl(),
                                          PartialEntry{c10::weak_intrusive_ptr<c10::TensorImpl>(p.getIntrusivePtr()), tp});
      continue;
    }
    const TensorParallelShard& shard = plan[rule].shard;
    const int64_t dim = shard.dim < 0 ? shard.dim + p.dim() : shard.dim;
    if (shard.pad && (dim != 0 || shard.parts != 1)) {
      throw std::invalid_argument("fsdp::parallelize: rule '" + plan[rule].pattern + "' pads parameter '" + name +
                                  "' along dimension " + std::to_string(shard.dim) + " in " + std::to_string(shard.parts) +
                                  " parts: padding is for a vocabulary split by rows (dimension 0, one part: "
                                  "fsdp::vocab_parallel_rule)");
    }
    if (shard.pad && p.dim() >= 1 && padded(p.size(0), shard, tp->size()) / tp->size() * (tp->size() - 1) >= p.size(0)) {
      throw std::invalid_argument("fsdp::parallelize: parameter '" + name + "' has " + std::to_string(p.size(0)) +
                                  " rows: padded over " + std::to_string(tp->size()) +
                                  " TP ranks, the last would hold padding only; use a smaller TP size");
    }
    if (dim < 0 || dim >= p.dim() || shard.parts < 1 ||
        padded(p.size(dim), shard, tp->size()) % (shard.parts * tp->size()) != 0) {
      throw std::invalid_argument("fsdp::parallelize: rule '" + plan[rule].pattern + "' splits parameter '" + name +
                                  "' of shape " + shape_text(p.sizes()) + " along dimension " +
                                  std::to_string(shard.dim) + " into " + std::to_string(shard.parts) + " part(s) of " +
                                  std::to_string(tp->size()) + " ranks, which does not divide it; pick a TP size that "
                                  "divides the heads and features" +
                                  (p.dim() == 1 && dim != 0
                                       ? std::string(" (a 1-D tensor where the rule expects more dimensions: a model "
                                                     "wrapped with fsdp already holds flat shards; call "
                                                     "fsdp::parallelize before wrapping)")
                                       : std::string()));
    }
    TensorParallelPlacement placement{{dim, shard.parts, shard.pad}, p.sizes().vec(), tp};
    if (tp->size() > 1) p.set_data(tensor_parallel_part(p, placement.shard, tp->rank(), tp->size()));
    std::lock_guard<std::mutex> lock(registry_mutex);
    registry().insert_or_assign(p.unsafeGetTensorImpl(),
                                Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(p.getIntrusivePtr()), std::move(placement)});
  }
  for (size_t i = 0; i < plan.size(); ++i) {
    if (matched[i] == 0) {
      std::string names;
      int shown = 0;
      for (const auto& np : model.named_parameters(true)) {
        if (shown++ == 8) { names += ", ..."; break; }
        names += (names.empty() ? "" : ", ") + np.key();
      }
      throw std::invalid_argument("fsdp::parallelize: rule '" + plan[i].pattern + "' matches no parameter of the model (" +
                                  names + "); '*' matches within one name component, '**' across them");
    }
  }
}

std::optional<TensorParallelPlacement> tensor_parallel_placement(const at::Tensor& param) {
  if (!param.defined()) return std::nullopt;
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& r = registry();
  auto it = r.find(param.unsafeGetTensorImpl());
  if (it == r.end()) return std::nullopt;
  if (it->second.impl.lock().get() != param.unsafeGetTensorImpl()) {
    r.erase(it);  // the split tensor died; this is another one at its address
    return std::nullopt;
  }
  return it->second.placement;
}

std::shared_ptr<TensorParallel> tensor_parallel_partial_gradient(const at::Tensor& param) {
  if (!param.defined()) return nullptr;
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& r = partial_registry();
  auto it = r.find(param.unsafeGetTensorImpl());
  if (it == r.end()) return nullptr;
  if (it->second.impl.lock().get() != param.unsafeGetTensorImpl()) {
    r.erase(it);
    return nullptr;
  }
  return it->second.tp;
}

}  // namespace fsdp
