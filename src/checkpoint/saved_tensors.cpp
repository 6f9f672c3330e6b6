// Finding a load's saved pieces: where each saved tensor's elements live, with its shape, dtype and
// other names, from a checkpoint's manifest, a plain safetensors file, or a dict of tensors in
// memory (SavedTensors, checkpoint_reader.h).
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/piece_reader.h"

namespace fsdp {
namespace {


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
      reading::fail(path, "it is one rank's piece of a sharded checkpoint (DCP_SHARDING_INFO); load the checkpoint folder "
                 "with load_checkpoint, or a full file");
    }
    s.shapes[e.name] = e.shape;
    s.dtypes[e.name] = e.dtype;
    s.pieces[e.name].push_back(SavedPiece{path, e.name, 0, e.numel(), 0, {}, false, {}});
  }
  return s;
}

SavedTensors saved_from_memory(const std::string& origin, const std::map<std::string, at::Tensor>& tensors) {
  SavedTensors s;
  s.origin = origin;
  for (const auto& [name, t] : tensors) {
    s.shapes[name] = t.sizes().vec();
    s.dtypes[name] = t.scalar_type();
    s.pieces[name].push_back(SavedPiece{origin, name, 0, t.numel(), 0, t.detach().contiguous(), false, {}});
  }
  return s;
}

}  // namespace fsdp
