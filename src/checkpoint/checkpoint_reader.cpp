#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/ignored_state.h"
#include "checkpoint/tensor_parallel_state.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

namespace fsdp {
namespace {

[[noreturn]] void fail(const std::string& origin, const std::string& what) {
  throw std::runtime_error("fsdp: cannot load " + origin + ": " + what);
}

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

// A file the manifest lists: there, with the size it says.
void check_listed_file(const std::string& path, int64_t bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw std::runtime_error("fsdp: checkpoint file " + path + " is missing (the manifest lists it); the checkpoint "
                             "is incomplete: copy the whole folder, or load an earlier checkpoint");
  }
  if (st.st_size != bytes) {
    throw std::runtime_error("fsdp: checkpoint file " + path + " has " + std::to_string(st.st_size) +
                             " bytes, the manifest says " + std::to_string(bytes) + " (truncated or replaced)");
  }
}

// Reads pieces; opens each file once.
class PieceReader {
 public:
  PieceReader(const SavedTensors& saved, std::set<std::string>& opened) : saved_(saved), opened_(opened) {}

  // Elements [begin, begin + out.numel()) of saved tensor `name` into `out` (1-D, contiguous),
  // converting the dtype if the saved one differs.
  void read(const std::string& name, int64_t begin, at::Tensor& out) {
    const int64_t end = begin + out.numel();
    if (begin == end) return;
    auto it = saved_.pieces.find(name);
    if (it == saved_.pieces.end()) fail(saved_.origin, "it holds no data for \"" + name + "\"");
    std::vector<const SavedPiece*> hits;
    for (const SavedPiece& p : it->second) {
      if (p.begin < end && p.end > begin) hits.push_back(&p);
    }
    std::sort(hits.begin(), hits.end(), [](const SavedPiece* a, const SavedPiece* b) { return a->begin < b->begin; });
    int64_t cursor = begin;
    for (const SavedPiece* p : hits) {
      if (p->end <= cursor) continue;  // covered already (replicas' copies of a local checkpoint)
      if (p->begin > cursor) break;
      const int64_t stop = std::min(end, p->end);
      at::Tensor dst = out.narrow(0, cursor - begin, stop - cursor);
      const int64_t first = p->at + (cursor - p->begin);
      if (p->memory.defined()) {
        dst.copy_(p->memory.reshape({-1}).narrow(0, first, stop - cursor));
      } else {
        const SafetensorsFile& f = file(p->file);
        const SafetensorsEntry* e = f.find(p->key);
        if (!e) fail(f.path(), "the manifest names tensor \"" + p->key + "\", which the file does not hold");
        if (p->boxed) check_box(f, *e, *p, name);
        if (first + (stop - cursor) > e->numel()) {
          fail(f.path(), "tensor \"" + p->key + "\" is smaller than the manifest says");
        }
        if (e->dtype == dst.scalar_type()) {
          f.read(*e, first, dst);
        } else {
          at::Tensor tmp = at::empty({stop - cursor}, at::TensorOptions().dtype(e->dtype));
          f.read(*e, first, tmp);
          dst.copy_(tmp);
        }
      }
      cursor = stop;
      if (cursor == end) break;
    }
    if (cursor < end) {
      fail(saved_.origin, "elements " + std::to_string(cursor) + " to " + std::to_string(end) + " of \"" + name +
                              "\" are in none of its files (a rank's file is missing from the manifest?)");
    }
  }

 private:
  // A FULL or SHARDED piece: the whole file tensor, placed where the file's own sharding metadata
  // says (a manifest that points a piece elsewhere would load the wrong elements).
  void check_box(const SafetensorsFile& f, const SafetensorsEntry& e, const SavedPiece& p, const std::string& name) {
    if (p.at != 0 || e.numel() != p.end - p.begin) {
      fail(f.path(), "tensor \"" + p.key + "\" holds " + std::to_string(e.numel()) + " elements; the manifest's piece of \"" +
                         name + "\" says " + std::to_string(p.end - p.begin) + " from element " + std::to_string(p.at));
    }
    auto meta = f.metadata().find("DCP_SHARDING_INFO");
    if (meta == f.metadata().end()) {
      if (p.begin != 0 || e.shape != p.whole_shape) {
        fail(f.path(), "tensor \"" + p.key + "\" is not the whole of \"" + name + "\", and the file says nothing of where it lies");
      }
      return;
    }
    auto& info = sharding_[f.path()];
    if (info.is_null()) info = nlohmann::json::parse(meta->second, nullptr, false);
    const auto entry = info.is_object() ? info.find(p.key) : info.end();
    int64_t flat = 0, stride = 1;
    bool ok = entry != info.end() && entry->is_object() && entry->contains("saved_offsets") &&
              (*entry)["saved_offsets"].is_array() && (*entry)["saved_offsets"].size() == p.whole_shape.size() &&
              e.shape.size() == p.whole_shape.size();
    for (size_t d = p.whole_shape.size(); ok && d-- > 0;) {
      const auto& o = (*entry)["saved_offsets"][d];
      ok = o.is_number_integer() && o.get<int64_t>() >= 0 && o.get<int64_t>() + e.shape[d] <= p.whole_shape[d];
      if (ok) flat += o.get<int64_t>() * stride;
      stride *= p.whole_shape[d];
    }
    if (!ok || flat != p.begin) {
      fail(f.path(), "tensor \"" + p.key + "\" lies elsewhere in \"" + name + "\" than the manifest's piece (element " +
                         std::to_string(p.begin) + ") says: its DCP_SHARDING_INFO and the manifest disagree");
    }
  }

  const SafetensorsFile& file(const std::string& rel) {
    auto it = files_.find(rel);
    if (it != files_.end()) return *it->second;
    const std::string path = saved_.folder.empty() || rel.front() == '/' ? rel : saved_.folder + "/" + rel;
    opened_.insert(rel);
    // A file of another size than the manifest's is truncated or replaced: say so, before its
    // header's own checks say something less direct.
    if (auto want = saved_.file_bytes.find(rel); want != saved_.file_bytes.end()) check_listed_file(path, want->second);
    return *files_.emplace(rel, std::make_unique<SafetensorsFile>(path)).first->second;
  }

  const SavedTensors& saved_;
  std::set<std::string>& opened_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, nlohmann::json> sharding_;  // file path -> its DCP_SHARDING_INFO
};

// The saved name for a live name (itself, or the saved tensor it is an alias of).
const std::string* resolve(const SavedTensors& saved, const std::string& name) {
  if (saved.shapes.count(name)) return &saved.shapes.find(name)->first;
  auto a = saved.alias_of.find(name);
  if (a != saved.alias_of.end() && saved.shapes.count(a->second)) return &a->second;
  return nullptr;
}

}  // namespace

SavedTensors saved_from_manifest(const std::string& folder, const nlohmann::json& m) {
  SavedTensors s;
  s.origin = "checkpoint " + folder;
  s.folder = folder;
  try {
    for (const char* group : {"params", "buffers"}) {
      for (auto it = m["model"][group].begin(); it != m["model"][group].end(); ++it) {
        s.shapes[it.key()] = (*it)["shape"].get<std::vector<int64_t>>();
        s.dtypes[it.key()] = dtype_from_safetensors((*it)["dtype"].get<std::string>(), folder + "/manifest.json");
        if (it->contains("aliases")) {
          for (const auto& a : (*it)["aliases"]) s.alias_of[a.get<std::string>()] = it.key();
        }
      }
    }
    const bool local = m["kind"] == "local";
    // A piece's whole tensor: a parameter or buffer, or a parameter's optimizer state
    // (state.<parameter>.<key>: the longest parameter name that prefixes it).
    auto shape_of = [&](const std::string& name) {
      if (auto found = s.shapes.find(name); found != s.shapes.end()) return found->second;
      std::vector<int64_t> shape;
      if (name.size() > 5 && name.compare(name.size() - 5, 5, ".step") == 0) return shape;  // a scalar step count
      size_t longest = 0;
      for (const auto& [param, sh] : s.shapes) {
        if (name.rfind("state." + param + ".", 0) == 0 && param.size() >= longest) {
          longest = param.size();
          shape = sh;
        }
      }
      return shape;
    };
    for (auto it = m["files"].begin(); it != m["files"].end(); ++it) s.file_bytes[it.key()] = (*it)["bytes"].get<int64_t>();
    for (auto it = m["pieces"].begin(); it != m["pieces"].end(); ++it) {
      for (const auto& p : *it) {
        SavedPiece piece;
        piece.file = p.at("file").get<std::string>();
        piece.key = p.at("key").get<std::string>();
        piece.begin = p.at("flat").at(0).get<int64_t>();
        piece.end = p.at("flat").at(1).get<int64_t>();
        piece.at = p.value("at", int64_t{0});
        if (!local) {
          piece.boxed = true;
          piece.whole_shape = shape_of(it.key());
        }
        s.pieces[it.key()].push_back(std::move(piece));
      }
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error("fsdp: checkpoint manifest " + folder + "/manifest.json is malformed: " + e.what());
  }
  return s;
}

SavedTensors saved_from_safetensors(const std::string& path) {
  SafetensorsFile f(path);
  SavedTensors s;
  s.origin = path;
  nlohmann::json sharding;
  auto meta = f.metadata().find("DCP_SHARDING_INFO");
  if (meta != f.metadata().end()) sharding = nlohmann::json::parse(meta->second, nullptr, false);
  auto aliases = f.metadata().find("aliases");
  if (aliases != f.metadata().end()) {
    const auto j = nlohmann::json::parse(aliases->second, nullptr, false);
    if (j.is_object()) {
      for (auto it = j.begin(); it != j.end(); ++it) {
        for (const auto& a : *it) s.alias_of[a.get<std::string>()] = it.key();
      }
    }
  }
  for (const SafetensorsEntry& e : f.entries()) {
    if (sharding.is_object() && sharding.contains(e.name)) {
      fail(path, "it is one rank's piece of a sharded checkpoint (DCP_SHARDING_INFO); load the checkpoint folder "
                 "with load_checkpoint, or a full file");
    }
    s.shapes[e.name] = e.shape;
    s.dtypes[e.name] = e.dtype;
    s.pieces[e.name].push_back(SavedPiece{path, e.name, 0, e.numel(), 0, {}});
  }
  return s;
}

SavedTensors saved_from_memory(const std::string& origin, const std::map<std::string, at::Tensor>& tensors) {
  SavedTensors s;
  s.origin = origin;
  for (const auto& [name, t] : tensors) {
    s.shapes[name] = t.sizes().vec();
    s.dtypes[name] = t.scalar_type();
    s.pieces[name].push_back(SavedPiece{origin, name, 0, t.numel(), 0, t.detach().contiguous()});
  }
  return s;
}

// Elements [begin, begin + into.numel()) of saved tensor `name`, or of this rank's part of it when
// the parameter is split for tensor parallelism.
void read_into(PieceReader& reader, const std::string& name, const std::optional<TensorParallelPlacement>& split,
               int64_t begin, at::Tensor into) {
  if (!split) {
    reader.read(name, begin, into);
    return;
  }
  read_part([&](int64_t whole_begin, at::Tensor run) { reader.read(name, whole_begin, run); }, split->full_shape,
            split->shard, split->tp->rank(), split->tp->size(), begin, into);
}

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
    fail(saved.origin, why + " (a checkpoint of another model or configuration?)");
  }
  for (auto& r : reads) {
    at::Tensor staged = at::empty({r.dest.numel()}, r.dest.options().device(c10::kCPU));
    read_into(reader, *r.name, r.split, r.begin, staged);
    out.copies.emplace_back(r.dest, staged);
  }
}

void stage_optimizer(detail::ShardedRoot& root, torch::optim::Optimizer& optimizer, const SavedTensors& saved,
                     const nlohmann::json& mo, StagedLoad& out) {
  at::NoGradGuard no_grad;
  auto adapter = OptimizerStateAdapter::for_optimizer(optimizer);
  if (mo.is_null()) {
    fail(saved.origin, "it holds no optimizer state; load it without an optimizer, or start the optimizer fresh");
  }
  const std::string type = mo.value("type", "");
  if (type != adapter->name()) {
    fail(saved.origin, "its optimizer state is " + type + "'s, and this optimizer is " + adapter->name());
  }
  // Groups: the same parameters, by name, in the same groups.
  std::map<const c10::TensorImpl*, std::string> name_of = saved_parameter_names(root);
  for (auto& group : optimizer.param_groups()) {
    std::set<std::string> names;
    for (const auto& p : group.params()) names.insert(name_of.count(p.unsafeGetTensorImpl()) ? name_of[p.unsafeGetTensorImpl()] : "?");
    const nlohmann::json* match = nullptr;
    std::set<std::string> closest;  // the saved group sharing the most parameters with this one
    size_t closest_shared = 0;
    for (const auto& g : mo.at("groups")) {
      std::set<std::string> saved_names;
      for (const auto& n : g.at("params")) {
        const std::string s = n.get<std::string>();
        auto a = saved.alias_of.find(s);
        saved_names.insert(a == saved.alias_of.end() ? s : a->second);
      }
      if (saved_names == names) match = &g;
      size_t shared = 0;
      for (const auto& n : names) shared += saved_names.count(n);
      if (shared > closest_shared) {
        closest_shared = shared;
        closest = saved_names;
      }
    }
    if (!match) {
      // Name the parameters that differ from the closest saved group (a parameter left out of
      // this rank's optimizer, one added), so that the message says what to change.
      std::string lacks, extra;
      for (const auto& n : closest) {
        if (!names.count(n)) lacks += (lacks.empty() ? "" : ", ") + n;
      }
      for (const auto& n : names) {
        if (!closest.count(n)) extra += (extra.empty() ? "" : ", ") + n;
      }
      std::string diff;
      if (!lacks.empty()) diff += "; it lacks " + lacks + ", which the saved group has";
      if (!extra.empty()) diff += "; it has " + extra + ", which the saved group lacks";
      fail(saved.origin, "no saved optimizer group has the parameters of this optimizer's group that starts with " +
                             (names.empty() ? std::string("(empty)") : *names.begin()) + diff +
                             " (the optimizer was built with other groups: build it from the same parameters and "
                             "groups as the one saved)");
    }
    // Checked now on a copy, so that apply() cannot fail halfway.
    torch::optim::OptimizerParamGroup probe(std::vector<at::Tensor>{}, group.options().clone());
    adapter->set_group_options(probe, match->at("options"));
    out.group_options.push_back(match->at("options"));
  }
  const nlohmann::json& steps = mo.at("steps");
  // Within a group every parameter with state has the same state tensors (the options that decide
  // them, momentum or amsgrad, are the group's): a parameter that lacks one would step from a
  // state libtorch never made (an undefined exp_avg).
  for (auto& group : optimizer.param_groups()) {
    std::map<std::string, std::string> first;  // key -> a parameter that has it
    std::vector<std::pair<std::string, std::set<std::string>>> keys_of;
    for (const auto& p : group.params()) {
      auto n = name_of.find(p.unsafeGetTensorImpl());
      if (n == name_of.end() || !steps.contains(n->second)) continue;
      std::set<std::string> keys;
      for (const std::string& key : adapter->tensor_keys()) {
        if (saved.pieces.count("state." + n->second + "." + key)) {
          keys.insert(key);
          first.emplace(key, n->second);
        }
      }
      keys_of.emplace_back(n->second, keys);
    }
    for (const auto& [param, keys] : keys_of) {
      for (const auto& [key, other] : first) {
        if (!keys.count(key)) {
          fail(saved.origin, "its optimizer state of \"" + param + "\" lacks \"" + key + "\", which \"" + other +
                                 "\" of the same group has (a piece missing from the manifest?)");
        }
      }
    }
  }
  PieceReader reader(saved, out.files_read);
  // `param`'s state: elements [begin, begin + param.numel()) of each saved state tensor of `fqn`.
  auto stage = [&](const std::string& fqn, const at::Tensor& param, int64_t begin,
                   const std::optional<TensorParallelPlacement>& split) {
    ParamOptimState st;
    if (steps.contains(fqn)) {
      st.present = true;
      st.step = steps[fqn].get<int64_t>();
      for (const std::string& key : adapter->tensor_keys()) {
        const std::string name = "state." + fqn + "." + key;
        if (!saved.pieces.count(name)) continue;
        // Read on the CPU (pread), then moved to the parameter's device.
        at::Tensor t = at::empty({param.numel()}, param.options().device(c10::kCPU));
        read_into(reader, name, split, begin, t);
        st.tensors[key] = t.view(param.sizes()).to(param.device());
      }
    }
    out.optimizer_states.emplace_back(param, std::move(st));
  };
  for (const auto& unit : root.unit_list()) {
    const FlatParamHandle& h = unit->handle();
    for (size_t i = 0; i < h.params().size(); ++i) {
      stage(h.layout().entries()[i].fqn, h.params()[i], h.slices()[i].param_begin, split_placement(h, i));
    }
  }
  for (const IgnoredParam& p : ignored_params(root)) stage(p.name, p.param, p.flat_begin, std::nullopt);
}

void verify_files(const std::string& folder, const nlohmann::json& manifest, int rank, int world_size,
                  const std::set<std::string>& files_read) {
  int index = 0;
  for (auto it = manifest["files"].begin(); it != manifest["files"].end(); ++it, ++index) {
    const bool crc_here = index % world_size == rank;
    if (!crc_here && !files_read.count(it.key())) continue;
    const std::string path = folder + "/" + it.key();
    check_listed_file(path, (*it)["bytes"].get<int64_t>());
    if (!crc_here) continue;
    const uint32_t crc = SafetensorsFile(path).crc32c();
    const uint32_t want = (*it)["crc32c"].get<uint32_t>();
    if (crc != want) {
      std::ostringstream msg;
      msg << "fsdp: checkpoint file " << path << " is corrupt: its CRC-32C is " << crc << ", the manifest says " << want
          << " (a changed byte; restore the file from a copy or load an earlier checkpoint)";
      throw std::runtime_error(msg.str());
    }
  }
}

void apply(StagedLoad& staged, torch::optim::Optimizer* optimizer) {
  at::NoGradGuard no_grad;
  for (auto& [dest, src] : staged.copies) dest.copy_(src.view(dest.sizes()));
  if (!optimizer) return;
  auto adapter = OptimizerStateAdapter::for_optimizer(*optimizer);
  for (size_t g = 0; g < staged.group_options.size(); ++g) {
    adapter->set_group_options(optimizer->param_groups()[g], staged.group_options[g]);
  }
  for (auto& [param, st] : staged.optimizer_states) adapter->set(*optimizer, param, st);
}

}  // namespace fsdp
