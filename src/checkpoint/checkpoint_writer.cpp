#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/ignored_state.h"
#include "checkpoint/tensor_parallel_state.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>

#include "checkpoint/safetensors.h"

namespace fsdp {
namespace {


struct PendingTensor {
  SafetensorsEntry entry;
  at::Tensor data;
  nlohmann::json piece;  // its manifest entry (file filled in when written)
  nlohmann::json saved_offsets;
};

// Writes one file of pending tensors and records its pieces and checksum in `part`.
void write_file(const std::string& root_folder, const std::string& rel, std::vector<PendingTensor>& tensors,
                const std::map<std::string, std::string>& metadata, WrittenPart& part, int rank, bool* first) {
  std::vector<SafetensorsEntry> entries;
  for (const auto& t : tensors) entries.push_back(t.entry);
  SafetensorsWriter w(root_folder + "/" + rel, entries, metadata);
  for (size_t i = 0; i < tensors.size(); ++i) {
    w.write_next(tensors[i].data);
    if (*first) {
      *first = false;
      maybe_killed_for_test(rank);
    }
    if (tensors[i].piece.is_null()) continue;  // LOCAL's flat shards: their parameters' pieces point in
    nlohmann::json piece = tensors[i].piece;
    piece["file"] = rel;
    part["pieces"][tensors[i].entry.name].push_back(piece);
  }
  const uint32_t crc = w.finish();
  part["files"][rel] = {{"bytes", w.bytes_written()}, {"crc32c", crc}};
}

nlohmann::json piece_json(const std::string& key, int64_t begin, int64_t end, int64_t at) {
  return {{"key", key}, {"flat", {begin, end}}, {"at", at}};
}

WrittenPart empty_part() { return {{"pieces", nlohmann::json::object()}, {"files", nlohmann::json::object()}}; }

}  // namespace

std::string rank_file(const std::string& folder, int rank, int world, int part) {
  char name[96];
  std::snprintf(name, sizeof(name), "%s/rank-%05d-of-%05d%s.safetensors", folder.c_str(), rank, world,
                part == 0 ? "" : (".part-" + std::to_string(part)).c_str());
  return name;
}

void maybe_killed_for_test(int rank) {
  static const char* env = std::getenv("FSDP_TEST_KILL_RANK_IN_SAVE");
  static int saves = 0;  // this process's saves that reached this point
  if (!env) return;
  ++saves;
  int who = -1, nth = 1;
  if (std::sscanf(env, "%d:%d", &who, &nth) < 1 || who != rank || saves != nth) return;
  std::fprintf(stderr, "fsdp: FSDP_TEST_KILL_RANK_IN_SAVE=%s: rank %d kills itself in the middle of its save %d\n", env,
               rank, nth);
  std::raise(SIGKILL);
}

WrittenPart write_rank_files(const std::string& folder, const RankState& state, StateDictKind kind, int rank,
                             int world_size, bool writes) {
  WrittenPart part = empty_part();
  bool first = true;
  for (const std::string sub : {"model", "optim"}) {
    // parts[j]: the j-th box of every piece (each key once per file, as readers require).
    std::vector<std::vector<PendingTensor>> parts(1);
    std::vector<nlohmann::json> sharding(1, nlohmann::json::object());
    std::map<int, std::vector<PendingTensor>> flat_units;  // LOCAL: one tensor per unit shard
    // `writes` false (a SHARDED save's other replicas): this rank writes only its own rows.
    auto written_here = [&](const StatePiece& p) { return p.local.numel() > 0 && (writes || p.own_rows); };
    for (const StatePiece& p : state.pieces) {
      if (p.folder != sub || !written_here(p)) continue;
      const bool buffer = p.unit < 0 && !p.own_rows;  // whole on every rank: rank 0 writes it
      if (buffer && rank != 0) continue;
      const int64_t n = p.local.numel();
      if (kind == StateDictKind::LOCAL && p.unit >= 0 && sub == "model") continue;  // whole shards below
      if (kind == StateDictKind::LOCAL || buffer) {
        PendingTensor t;
        t.entry.name = p.key;
        t.entry.dtype = p.dtype;
        t.entry.shape = buffer ? p.shape : std::vector<int64_t>{n};
        t.data = p.local;
        t.piece = piece_json(p.key, p.flat_begin, p.flat_begin + n, 0);
        std::vector<int64_t> zeros(t.entry.shape.size(), 0);
        sharding[0][p.key] = {{"saved_offsets", zeros}};
        parts[0].push_back(std::move(t));
        continue;
      }
      const auto boxes = boxes_of_range(p.shape, p.flat_begin, p.flat_begin + n);
      if (parts.size() < boxes.size()) {
        parts.resize(boxes.size());
        sharding.resize(boxes.size(), nlohmann::json::object());
      }
      for (size_t j = 0; j < boxes.size(); ++j) {
        const Box& b = boxes[j];
        PendingTensor t;
        t.entry.name = p.key;
        t.entry.dtype = p.dtype;
        t.entry.shape = b.sizes;
        t.data = p.local.narrow(0, b.flat_begin - p.flat_begin, b.flat_end - b.flat_begin);
        t.piece = piece_json(p.key, b.flat_begin, b.flat_end, 0);
        sharding[j][p.key] = {{"saved_offsets", b.offsets}};
        parts[j].push_back(std::move(t));
      }
    }
    if (kind == StateDictKind::SHARDED && sub == "optim" && state.optimizer) {
      // Each parameter's step count as the 0-d float32 tensor `state.<param>.step`, which is what
      // PyTorch's Adam family keeps and get_optimizer_state_dict(flatten_optimizer_state_dict) names:
      // torch.distributed.checkpoint reads the whole flattened state from the files. Written by
      // every rank that holds state of the parameter (copies of one scalar; readers take any).
      std::set<std::string> params;
      for (const StatePiece& p : state.pieces) {
        if (p.folder == "optim" && written_here(p)) params.insert(p.param);
      }
      for (const std::string& param : params) {
        if (!state.optimizer->steps.contains(param)) continue;
        PendingTensor t;
        t.entry.name = "state." + param + ".step";
        t.entry.dtype = c10::kFloat;
        t.data = at::full({}, static_cast<double>(state.optimizer->steps[param].get<int64_t>()), at::kFloat);
        t.piece = piece_json(t.entry.name, 0, 1, 0);
        sharding[0][t.entry.name] = {{"saved_offsets", nlohmann::json::array()}};
        parts[0].push_back(std::move(t));
      }
    }
    if (kind == StateDictKind::LOCAL && sub == "model" && writes) {
      // The raw flat shard of every unit, padding included; each parameter's piece points into it.
      for (size_t u = 0; u < state.unit_shards.size(); ++u) {
        PendingTensor t;
        t.entry.name = "flat." + std::to_string(u);
        t.entry.dtype = state.unit_shards[u].scalar_type();
        t.entry.shape = {state.unit_shards[u].numel()};
        t.data = state.unit_shards[u];
        sharding[0][t.entry.name] = {{"saved_offsets", {0}}};
        parts[0].push_back(std::move(t));
      }
    }
    for (size_t j = 0; j < parts.size(); ++j) {
      if (parts[j].empty()) continue;
      const std::string rel = sub + "/" + rank_file("", rank, world_size, static_cast<int>(j)).substr(1);
      std::map<std::string, std::string> meta = {{"format", "pt"}};
      if (kind == StateDictKind::SHARDED) {
        meta["DCP_SHARDING_INFO"] = sharding[j].dump();
        meta["DCP_VERSION"] = "1.0";
      }
      write_file(folder, rel, parts[j], meta, part, rank, &first);
      if (kind == StateDictKind::LOCAL && sub == "model") {
        for (const StatePiece& p : state.pieces) {
          if (p.folder != "model" || p.unit < 0 || p.local.numel() == 0) continue;
          nlohmann::json piece = piece_json("flat." + std::to_string(p.unit), p.flat_begin,
                                            p.flat_begin + p.local.numel(), p.shard_offset);
          piece["file"] = rel;
          part["pieces"][p.key].push_back(piece);
        }
      }
    }
  }
  return part;
}

}  // namespace fsdp

namespace fsdp {
namespace {

// Rank 0's writing during a gather. A write that fails (no space left, a file size limit, a file
// it cannot create) must not leave the gather: the other ranks are sending into it and would wait
// for the collective timeout. So the first failure is kept, rank 0 goes on receiving without
// writing, and the error is thrown once every collective of the save is done.
class GatheredFile {
 public:
  GatheredFile(bool writer, std::string& error) : writer_(writer), error_(error) {}
  bool writing() const { return writer_ && error_.empty(); }
  template <typename Fn>
  void attempt(Fn&& fn) {
    if (!writing()) return;
    try {
      fn();
    } catch (const std::exception& e) {
      error_ = e.what();
    }
  }

 private:
  bool writer_;
  std::string& error_;
};

// Rank 0 writes the gathered model, unit by unit, then the buffers, to `path` (`rel` in pieces).
// A write error on rank 0 lands in `error` (see GatheredFile); every rank completes the gathers.
void write_gathered_model(const std::string& path, const std::string& rel, detail::ShardedRoot& root,
                          const RankState& state, std::map<std::string, std::string> metadata, WrittenPart& part,
                          std::string& error) {
  // Under tensor parallelism the job's rank 0 writes, each split parameter put together from its
  // TP group's parts (whole_of: the TP group of every data-parallel rank 0 gathers alike).
  GatheredFile out(writes_whole(root), error);
  std::vector<SafetensorsEntry> entries;
  for (const auto& unit : root.unit_list()) {
    const FlatParamHandle& h = unit->handle();
    for (size_t i = 0; i < h.layout().entries().size(); ++i) {
      entries.push_back({h.layout().entries()[i].fqn, h.dtypes().master, whole_shape(h, i)});
    }
  }
  // Row-sharded ignored parameters are put together from the ranks' rows; the rest outside the
  // units (buffers, replicated ignored parameters) is rank 0's own.
  const std::vector<IgnoredParam> ignored = ignored_params(root);
  for (const IgnoredParam& p : ignored) {
    if (p.table) entries.push_back({p.name, p.param.scalar_type(), p.shape});
  }
  std::vector<const StatePiece*> buffers;
  for (const StatePiece& p : state.pieces) {
    if (p.unit < 0 && !p.own_rows && p.folder == "model") {
      entries.push_back({p.key, p.dtype, p.shape});
      buffers.push_back(&p);
    }
  }
  std::unique_ptr<SafetensorsWriter> w;
  out.attempt([&] { w = std::make_unique<SafetensorsWriter>(path, entries, std::move(metadata)); });
  bool first = true;
  gather_units(
      root,
      shard_slice,
      [&](const Unit& u, const at::Tensor& full) {
        if (first) {
          first = false;
          maybe_killed_for_test(root.mesh().rank());
        }
        const FlatParamHandle& h = u.handle();
        for (size_t i = 0; i < h.layout().entries().size(); ++i) {
          const auto& e = h.layout().entries()[i];
          const at::Tensor whole = whole_of(h, i, view_of_param(full, e));  // collective under TP
          out.attempt([&] {
            w->write_next(whole);
            nlohmann::json piece = piece_json(e.fqn, 0, whole.numel(), 0);
            piece["file"] = rel;
            part["pieces"][e.fqn].push_back(piece);
          });
        }
      },
      GatherTo::TO_RANK0);
  for (const IgnoredParam& p : ignored) {
    if (!p.table) continue;
    const at::Tensor whole = whole_ignored(root, p, p.param, GatherTo::TO_RANK0);  // collective
    out.attempt([&] {
      w->write_next(whole);
      nlohmann::json piece = piece_json(p.name, 0, whole.numel(), 0);
      piece["file"] = rel;
      part["pieces"][p.name].push_back(piece);
    });
  }
  out.attempt([&] {
    for (const StatePiece* b : buffers) {
      w->write_next(b->local);
      nlohmann::json piece = piece_json(b->key, 0, b->local.numel(), 0);
      piece["file"] = rel;
      part["pieces"][b->key].push_back(piece);
    }
    const uint32_t crc = w->finish();
    part["files"][rel] = {{"bytes", w->bytes_written()}, {"crc32c", crc}};
  });
}

}  // namespace

WrittenPart write_full_files(const std::string& folder, detail::ShardedRoot& root, const RankState& state) {
  WrittenPart part = empty_part();
  std::string error;  // rank 0's first write error; thrown after the last gather
  write_gathered_model(folder + "/model/model.safetensors", "model/model.safetensors", root, state, {{"format", "pt"}},
                       part, error);
  if (!state.optimizer) {
    if (!error.empty()) throw std::runtime_error(error);
    return part;
  }
  // Which state tensors each parameter has, agreed by every rank (a rank may hold none of one).
  std::map<std::string, at::Tensor> local;
  nlohmann::json present = nlohmann::json::object();
  for (const StatePiece& p : state.pieces) {
    if (p.folder != "optim") continue;
    local[p.key] = p.local;
    present[p.param][p.state_key] = true;
  }
  std::set<std::string> keys;
  std::map<std::string, std::set<std::string>> has;  // state key -> parameters
  for (const std::string& text : all_gather_strings(root.comm().mesh().world_group, present.dump())) {
    const auto j = nlohmann::json::parse(text);
    for (auto it = j.begin(); it != j.end(); ++it) {
      for (auto k = it->begin(); k != it->end(); ++k) {
        keys.insert(k.key());
        has[k.key()].insert(it.key());
      }
    }
  }
  GatheredFile out(writes_whole(root), error);
  std::vector<SafetensorsEntry> entries;
  for (const std::string& key : keys) {
    for (const auto& unit : root.unit_list()) {
      const FlatParamHandle& h = unit->handle();
      for (size_t i = 0; i < h.layout().entries().size(); ++i) {
        const auto& e = h.layout().entries()[i];
        if (has[key].count(e.fqn)) entries.push_back({"state." + e.fqn + "." + key, h.dtypes().master, whole_shape(h, i)});
      }
    }
  }
  const std::vector<IgnoredParam> ignored = ignored_params(root);
  for (const std::string& key : keys) {
    for (const IgnoredParam& p : ignored) {
      if (has[key].count(p.name)) entries.push_back({"state." + p.name + "." + key, p.param.scalar_type(), p.shape});
    }
  }
  const std::string rel = "optim/optim.safetensors";
  std::unique_ptr<SafetensorsWriter> w;
  out.attempt([&] {
    w = std::make_unique<SafetensorsWriter>(folder + "/" + rel, entries, std::map<std::string, std::string>{{"format", "pt"}});
  });
  for (const std::string& key : keys) {
    gather_units(
        root,
        [&](const Unit& u, size_t i) {
          auto it = local.find("state." + u.handle().layout().entries()[i].fqn + "." + key);
          return it == local.end() ? at::Tensor() : it->second;
        },
        [&](const Unit& u, const at::Tensor& full) {
          const FlatParamHandle& h = u.handle();
          for (size_t i = 0; i < h.layout().entries().size(); ++i) {
            const auto& e = h.layout().entries()[i];
            if (!has[key].count(e.fqn)) continue;
            const std::string name = "state." + e.fqn + "." + key;
            const at::Tensor whole = whole_of(h, i, view_of_param(full, e));  // collective under TP
            out.attempt([&] {
              w->write_next(whole);
              nlohmann::json piece = piece_json(name, 0, whole.numel(), 0);
              piece["file"] = rel;
              part["pieces"][name].push_back(piece);
            });
          }
        },
        GatherTo::TO_RANK0);
  }
  for (const std::string& key : keys) {
    for (const IgnoredParam& p : ignored) {
      if (!has[key].count(p.name)) continue;
      const std::string name = "state." + p.name + "." + key;
      auto it = local.find(name);  // absent: a rank whose rows have no state yet sends zeros
      const at::Tensor mine = it == local.end() ? at::Tensor() : it->second.view(p.param.sizes());
      const at::Tensor whole = whole_ignored(root, p, mine, GatherTo::TO_RANK0);  // collective
      out.attempt([&] {
        w->write_next(whole);
        nlohmann::json piece = piece_json(name, 0, whole.numel(), 0);
        piece["file"] = rel;
        part["pieces"][name].push_back(piece);
      });
    }
  }
  out.attempt([&] {
    const uint32_t crc = w->finish();
    part["files"][rel] = {{"bytes", w->bytes_written()}, {"crc32c", crc}};
  });
  if (!error.empty()) throw std::runtime_error(error);
  return part;
}

void write_full_model_file(const std::string& path, detail::ShardedRoot& root, const RankState& state) {
  WrittenPart part = empty_part();
  const nlohmann::json model = describe_model_state(root);
  nlohmann::json aliases = nlohmann::json::object();
  for (auto it = model["params"].begin(); it != model["params"].end(); ++it) {
    if (!(*it)["aliases"].empty()) aliases[it.key()] = (*it)["aliases"];
  }
  std::string error;
  write_gathered_model(path, path, root, state, {{"format", "pt"}, {"aliases", aliases.dump()}}, part, error);
  if (!error.empty()) throw std::runtime_error(error);
}

}  // namespace fsdp
