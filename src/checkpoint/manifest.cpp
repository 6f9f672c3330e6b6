#include "checkpoint/manifest.h"

#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>

#include "checkpoint/safetensors.h"

namespace fsdp {
namespace {

using json = nlohmann::json;

// Numbers of elements beyond this are refused: 2^62 keeps every product and byte count in int64.
constexpr int64_t kMaxElements = int64_t{1} << 62;

std::string quoted(const std::string& key) { return "[" + json(key).dump() + "]"; }

// Walks a manifest with the path of the field in hand, so that every error names it.
class Checker {
 public:
  explicit Checker(std::string origin) : origin_(std::move(origin)) {}

  [[noreturn]] void bad(const std::string& field, const std::string& what) const {
    throw std::runtime_error("fsdp: checkpoint manifest " + origin_ + " is invalid: field `" + field + "` " + what +
                             " (a damaged or hand-edited manifest; load an earlier checkpoint)");
  }

  const json& field(const json& parent, const std::string& parent_name, const std::string& key) const {
    auto it = parent.find(key);
    if (it == parent.end()) bad(join(parent_name, key), "is missing");
    return *it;
  }

  const json& object(const json& v, const std::string& name) const {
    if (!v.is_object()) bad(name, "must be a JSON object, not " + type(v));
    return v;
  }
  const json& array(const json& v, const std::string& name) const {
    if (!v.is_array()) bad(name, "must be a JSON array, not " + type(v));
    return v;
  }
  const std::string& string(const json& v, const std::string& name) const {
    if (!v.is_string()) bad(name, "must be a string, not " + type(v));
    return v.get_ref<const std::string&>();
  }
  // An integer written as one (2.9 and 2.0 are refused), within [lo, hi].
  int64_t integer(const json& v, const std::string& name, int64_t lo, int64_t hi) const {
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(hi)) bad(name, "is " + std::to_string(u) + ", above its limit " + std::to_string(hi));
      return static_cast<int64_t>(u);
    }
    if (!v.is_number_integer()) bad(name, "must be an integer, not " + type(v) + " " + v.dump());
    const int64_t i = v.get<int64_t>();
    if (i < lo || i > hi) {
      bad(name, "is " + std::to_string(i) + ", outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    return i;
  }
  double number(const json& v, const std::string& name) const {
    if (!v.is_number()) bad(name, "must be a number, not " + type(v));
    const double d = v.get<double>();
    if (!std::isfinite(d)) bad(name, "must be finite");
    return d;
  }

  static std::string join(const std::string& parent, const std::string& key) {
    return parent.empty() ? key : parent + "." + key;
  }
  static std::string type(const json& v) {
    if (v.is_number_float()) return "a fractional number";
    return std::string(v.type_name());
  }

 private:
  std::string origin_;
};

// A file name in the manifest: relative, inside the folder (no "..", no empty or "." parts).
void check_relative_path(const Checker& c, const std::string& name, const std::string& path) {
  if (path.empty() || path.front() == '/') c.bad(name, "must be a path relative to the checkpoint folder, not \"" + path + "\"");
  if (path.find('\0') != std::string::npos) c.bad(name, "holds a NUL byte");
  std::istringstream parts(path);
  std::string part;
  while (std::getline(parts, part, '/')) {
    if (part.empty() || part == "." || part == "..") {
      c.bad(name, "must stay inside the checkpoint folder (no \"..\", \".\" or empty parts), not \"" + path + "\"");
    }
  }
  if (path.back() == '/') c.bad(name, "must name a file, not \"" + path + "\"");
}

int64_t check_shape(const Checker& c, const json& v, const std::string& name) {
  int64_t numel = 1;
  const json& shape = c.array(v, name);
  if (shape.size() > 64) c.bad(name, "has " + std::to_string(shape.size()) + " dimensions");
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t d = c.integer(shape[i], name + "[" + std::to_string(i) + "]", 0, kMaxElements);
    if (d != 0 && numel > kMaxElements / d) c.bad(name, "has more than 2^62 elements");
    numel *= d;
  }
  return numel;
}

void check_hex(const Checker& c, const json& v, const std::string& name) {
  const std::string& s = c.string(v, name);
  if (s.size() % 2 != 0) c.bad(name, "must be hexadecimal bytes (an even count of digits)");
  for (char ch : s) {
    if (!((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f'))) c.bad(name, "must be lowercase hexadecimal digits");
  }
}

}  // namespace

std::string manifest_text(json manifest) {
  manifest.erase("manifest_crc32c");
  const std::string canonical = manifest.dump();
  manifest["manifest_crc32c"] = crc32c_update(0, canonical.data(), canonical.size());
  return manifest.dump(1) + "\n";
}

uint32_t manifest_checksum(const json& manifest) {
  auto it = manifest.find("manifest_crc32c");
  return it != manifest.end() && it->is_number_unsigned() ? it->get<uint32_t>() : 0;
}

json read_manifest(const std::string& folder) {
  const std::string path = folder + "/manifest.json";
  std::ifstream in(path);
  if (!in) {
    struct stat st {};
    if (::stat(folder.c_str(), &st) != 0) throw std::runtime_error("fsdp: no checkpoint at " + folder + ": it does not exist");
    throw std::runtime_error("fsdp: " + folder + " is not a complete fsdp checkpoint: " + path +
                             " is missing (an interrupted save leaves no manifest; load an earlier checkpoint)");
  }
  json m;
  try {
    m = json::parse(in);
  } catch (const std::exception& e) {
    throw std::runtime_error("fsdp: checkpoint manifest " + path + " is not valid JSON (corrupt?): " + e.what());
  }
  if (!m.is_object() || !m.contains("format") || m["format"] != "fsdp-checkpoint") {
    throw std::runtime_error("fsdp: " + path + " is not an fsdp checkpoint manifest (its \"format\" is not \"fsdp-checkpoint\")");
  }
  const json version = m.value("version", json());
  if (version != 1 && version != kManifestVersion) {
    throw std::runtime_error("fsdp: " + path + " has manifest version " + version.dump() + "; this fsdp reads versions 1 and " +
                             std::to_string(kManifestVersion));
  }
  if (version == kManifestVersion) {
    const json stored = m.value("manifest_crc32c", json());
    json rest = m;
    rest.erase("manifest_crc32c");
    const std::string canonical = rest.dump();
    const uint32_t crc = crc32c_update(0, canonical.data(), canonical.size());
    if (!stored.is_number_unsigned() || stored.get<uint64_t>() != crc) {
      throw std::runtime_error("fsdp: checkpoint manifest " + path + " is corrupt: its manifest_crc32c is " + stored.dump() +
                               ", its content's is " + std::to_string(crc) +
                               " (a changed byte; restore it from a copy or load an earlier checkpoint)");
    }
  }
  validate_manifest(m, path);
  return m;
}

void validate_manifest(const json& m, const std::string& origin) {
  const Checker c(origin);
  c.object(m, "(manifest)");
  const std::string kind = c.string(c.field(m, "", "kind"), "kind");
  if (kind != "full" && kind != "sharded" && kind != "local") c.bad("kind", "must be \"full\", \"sharded\" or \"local\", not \"" + kind + "\"");
  c.integer(c.field(m, "", "step"), "step", 0, std::numeric_limits<int64_t>::max());
  const int64_t W = c.integer(c.field(m, "", "world_size"), "world_size", 1, 1 << 24);
  const int64_t F = c.integer(c.field(m, "", "shard_size"), "shard_size", 1, W);
  if (W % F != 0) c.bad("shard_size", "is " + std::to_string(F) + ", which does not divide world_size " + std::to_string(W));
  if (m.contains("tensor_parallel")) {  // version 2 manifests from issue 27 on; absent: 1
    const int64_t tp = c.integer(m["tensor_parallel"], "tensor_parallel", 1, W);
    if (W % (tp * F) != 0) c.bad("tensor_parallel", "is " + std::to_string(tp) + ": world_size " + std::to_string(W) +
                                                        " is not a multiple of tensor_parallel x shard_size");
  }
  c.string(c.field(m, "", "strategy"), "strategy");
  const json& mp = c.field(m, "", "mixed_precision");
  if (!mp.is_null()) c.string(mp, "mixed_precision");
  c.object(c.field(m, "", "training"), "training");

  // The model: every tensor's shape and dtype; what pieces may name.
  std::map<std::string, int64_t> numel;  // tensor name -> elements
  const json& model = c.object(c.field(m, "", "model"), "model");
  std::set<std::string> param_names;
  for (const char* group : {"params", "buffers"}) {
    const std::string gname = std::string("model.") + group;
    const json& g = c.object(c.field(model, "model", group), gname);
    for (auto it = g.begin(); it != g.end(); ++it) {
      const std::string name = gname + quoted(it.key());
      c.object(*it, name);
      const int64_t n = check_shape(c, c.field(*it, name, "shape"), name + ".shape");
      const std::string& dtype = c.string(c.field(*it, name, "dtype"), name + ".dtype");
      try {
        dtype_from_safetensors(dtype, origin);
      } catch (const std::exception&) {
        c.bad(name + ".dtype", "is \"" + dtype + "\", not a dtype fsdp reads");
      }
      if (it->contains("aliases")) {
        const json& aliases = c.array((*it)["aliases"], name + ".aliases");
        for (size_t i = 0; i < aliases.size(); ++i) c.string(aliases[i], name + ".aliases[" + std::to_string(i) + "]");
      }
      if (!numel.emplace(it.key(), n).second) c.bad(name, "names a tensor twice");
      if (std::string(group) == "params") param_names.insert(it.key());
    }
  }
  c.array(c.field(model, "model", "units"), "model.units");

  const json& opt = c.field(m, "", "optimizer");
  if (!opt.is_null()) {
    c.object(opt, "optimizer");
    c.string(c.field(opt, "optimizer", "type"), "optimizer.type");
    const json& groups = c.array(c.field(opt, "optimizer", "groups"), "optimizer.groups");
    for (size_t g = 0; g < groups.size(); ++g) {
      const std::string gname = "optimizer.groups[" + std::to_string(g) + "]";
      c.object(groups[g], gname);
      const json& params = c.array(c.field(groups[g], gname, "params"), gname + ".params");
      for (size_t i = 0; i < params.size(); ++i) c.string(params[i], gname + ".params[" + std::to_string(i) + "]");
      c.object(c.field(groups[g], gname, "options"), gname + ".options");
    }
    const json& steps = c.object(c.field(opt, "optimizer", "steps"), "optimizer.steps");
    for (auto it = steps.begin(); it != steps.end(); ++it) {
      const std::string name = "optimizer.steps" + quoted(it.key());
      if (!param_names.count(it.key())) c.bad(name, "names no parameter of model.params");
      c.integer(*it, name, 0, std::numeric_limits<int64_t>::max());
    }
  }
  const json& scaler = c.field(m, "", "scaler");
  if (!scaler.is_null()) {
    c.object(scaler, "scaler");
    const double scale = c.number(c.field(scaler, "scaler", "scale"), "scaler.scale");
    if (!(scale > 0)) c.bad("scaler.scale", "must be positive");
    c.integer(c.field(scaler, "scaler", "growth_tracker"), "scaler.growth_tracker", 0, std::numeric_limits<int32_t>::max());
  }

  // Files: inside the folder, each with its size and checksum.
  const json& files = c.object(c.field(m, "", "files"), "files");
  for (auto it = files.begin(); it != files.end(); ++it) {
    const std::string name = "files" + quoted(it.key());
    check_relative_path(c, name, it.key());
    c.object(*it, name);
    c.integer(c.field(*it, name, "bytes"), name + ".bytes", 0, std::numeric_limits<int64_t>::max());
    c.integer(c.field(*it, name, "crc32c"), name + ".crc32c", 0, 0xFFFFFFFFll);
  }
  // Pieces: of a tensor the model names (or the optimizer state of one), inside its bounds, in a
  // listed file.
  const json& pieces = c.object(c.field(m, "", "pieces"), "pieces");
  for (auto it = pieces.begin(); it != pieces.end(); ++it) {
    const std::string name = "pieces" + quoted(it.key());
    int64_t n = -1;
    if (auto found = numel.find(it.key()); found != numel.end()) {
      n = found->second;
    } else if (it.key().rfind("state.", 0) == 0) {
      // state.<parameter>.<key>: the longest parameter name that prefixes it.
      const std::string rest = it.key().substr(6);
      std::string param;
      for (const std::string& p : param_names) {
        if (rest.size() > p.size() + 1 && rest.compare(0, p.size(), p) == 0 && rest[p.size()] == '.') {
          n = numel[p];
          param = p;
        }
      }
      if (n < 0) c.bad(name, "is optimizer state of no parameter in model.params");
      if (opt.is_null()) c.bad(name, "is optimizer state, and the manifest has no optimizer");
      if (!opt["steps"].contains(param)) c.bad(name, "is optimizer state of \"" + param + "\", which optimizer.steps does not list");
    } else {
      c.bad(name, "names no tensor of model.params or model.buffers");
    }
    const json& list = c.array(*it, name);
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string pname = name + "[" + std::to_string(i) + "]";
      c.object(list[i], pname);
      const std::string& file = c.string(c.field(list[i], pname, "file"), pname + ".file");
      if (!files.contains(file)) c.bad(pname + ".file", "is \"" + file + "\", which `files` does not list");
      c.string(c.field(list[i], pname, "key"), pname + ".key");
      const json& flat = c.array(c.field(list[i], pname, "flat"), pname + ".flat");
      if (flat.size() != 2) c.bad(pname + ".flat", "must be [begin, end]");
      const int64_t b = c.integer(flat[0], pname + ".flat[0]", 0, n);
      c.integer(flat[1], pname + ".flat[1]", b, n);
      // Where in its file tensor the piece starts: 0 for FULL and SHARDED (a piece is a whole file
      // tensor), the offset in the raw flat shard for LOCAL, where it must be given.
      if (kind == "local" || list[i].contains("at")) {
        c.integer(c.field(list[i], pname, "at"), pname + ".at", 0, kind == "local" ? kMaxElements : 0);
      }
    }
  }
  if (m.contains("rng")) {
    const json& rng = c.object(m["rng"], "rng");
    for (auto it = rng.begin(); it != rng.end(); ++it) {
      const std::string name = "rng" + quoted(it.key());
      int64_t r = -1;
      try {
        size_t used = 0;
        r = std::stoll(it.key(), &used);
        if (used != it.key().size()) r = -1;
      } catch (const std::exception&) {
      }
      if (r < 0 || r >= W) c.bad(name, "must be a rank from 0 to world_size - 1");
      c.object(*it, name);
      for (auto g = it->begin(); g != it->end(); ++g) check_hex(c, *g, name + "." + g.key());
    }
  }
}

}  // namespace fsdp
