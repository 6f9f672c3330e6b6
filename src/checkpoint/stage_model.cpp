// Staging the model's parameters and buffers for a load (stage_model, checkpoint_reader.h): the
// saved names matched to the model's (tied weights' other names too), shapes checked, and this
// rank's elements read into staging tensors.
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/ignored_state.h"
#include "checkpoint/piece_reader.h"
#include "checkpoint/tensor_parallel_state.h"

#include <set>

namespace fsdp {
namespace {

using reading::PieceReader;
using reading::read_into;

std::string list(const std::vector<std::string>& names, size_t most = 5) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < most; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > most) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// The saved name for a live name (itself, or the saved tensor it is an alias of).
const std::string* resolve(const SavedTensors& saved, const std::string& name) {
  if (saved.shapes.count(name)) return &saved.shapes.find(name)->first;
  auto a = saved.alias_of.find(name);
  if (a != saved.alias_of.end() && saved.shapes.count(a->second)) return &a->second;
  return nullptr;
}

}  // namespace

void stage_model(detail::ShardedRoot& root, const SavedTensors& saved, StagedLoad& out) {
  at::NoGradGuard no_grad;
  PieceReader reader(saved, out.files_read);
  std::set<std::string> used;
  std::vector<std::string> missing, mismatched;
  auto check = [&](const std::string& name, const std::vector<int64_t>& shape) -> const std::string* {
    const std::string* found = resolve(saved, name);
    if (!found) {
      missing.push_back(name);
      return nullptr;
    }
    used.insert(*found);
    const auto& s = saved.shapes.at(*found);
    if (s != shape) {
      mismatched.push_back(name + " (saved " + shape_text(s) + ", model " + shape_text(shape) + ")");
      return nullptr;
    }
    return found;
  };
  // What to read: elements [begin, begin + dest.numel()) of the saved tensor `name`, or, for a
  // parameter split for tensor parallelism, of this rank's part of it (tensor_parallel_state.h).
  struct Read {
    const std::string* name;
    at::Tensor dest;
    int64_t begin;
    std::optional<TensorParallelPlacement> split;
  };
  std::vector<Read> reads;
  // Every name of each parameter: a tied weight may be saved under any of them (Python's
  // safetensors.torch.save_model keeps one name of a tied pair, not necessarily the first).
  std::map<const c10::TensorImpl*, std::vector<std::string>> names_of;
  for (const auto& item : root.module().named_parameters(true)) names_of[item.value().unsafeGetTensorImpl()].push_back(item.key());
  auto saved_name = [&](const at::Tensor& param, const std::string& first, const std::vector<int64_t>& shape) {
    std::string live = first;
    for (const std::string& n : names_of[param.unsafeGetTensorImpl()]) {
      if (resolve(saved, n)) {
        live = n;
        break;
      }
    }
    return check(live, shape);
  };
  for (const auto& unit : root.unit_list()) {
    const FlatParamHandle& h = unit->handle();
    for (size_t i = 0; i < h.layout().entries().size(); ++i) {
      const std::string* name = saved_name(h.params()[i], h.layout().entries()[i].fqn, whole_shape(h, i));
      if (name) reads.push_back({name, shard_slice(*unit, i), h.slices()[i].param_begin, split_placement(h, i)});
    }
  }
  // Ignored parameters: a row-sharded table's rows this rank holds now (its declaration at this
  // world size), from the saved whole; a replicated one whole.
  for (const IgnoredParam& p : ignored_params(root)) {
    const std::string* name = saved_name(p.param, p.name, p.shape);
    if (name) reads.push_back({name, p.param.detach(), p.flat_begin, std::nullopt});
  }
  // A tied weight's other names may also be in the file (Python's state_dict lists every name).
  for (const auto& item : root.module().named_parameters(true)) {
    if (const std::string* found = resolve(saved, item.key())) used.insert(*found);
  }
  for (const auto& b : root.module().named_buffers(true)) {
    if (!b.value().defined()) continue;
    const std::string* name = check(b.key(), b.value().sizes().vec());
    if (name) reads.push_back({name, b.value().detach(), 0, std::nullopt});
  }
  std::vector<std::string> unexpected;
  for (const auto& [name, shape] : saved.shapes) {
    if (!used.count(name)) unexpected.push_back(name);
  }
  if (!missing.empty() || !mismatched.empty() || !unexpected.empty()) {
    std::string why = "it is not a state of this model:";
    if (!missing.empty()) why += " the model's " + list(missing) + " not in it;";
    if (!unexpected.empty()) why += " it holds " + list(unexpected) + ", which the model lacks;";
    if (!mismatched.empty()) why += " shapes differ for " + list(mismatched) + ";";
    // A file of only some of the model's tensors (PyTorch's strict=False) is refused whole: say how
    // to set those it has.
    if (!missing.empty()) why += " to set only the tensors a file holds, copy them in inside summon_full_params();";
    reading::fail(saved.origin, why + " (a checkpoint of another model or configuration?)");
  }
  for (auto& r : reads) {
    at::Tensor staged = at::empty({r.dest.numel()}, r.dest.options().device(c10::kCPU));
    read_into(reader, *r.name, r.split, r.begin, staged);
    out.copies.emplace_back(r.dest, staged);
  }
}

}  // namespace fsdp
