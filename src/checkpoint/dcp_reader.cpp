#include "checkpoint/dcp_reader.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "checkpoint/file_system.h"
#include "checkpoint/safetensors.h"

namespace fsdp {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("fsdp: cannot load the PyTorch checkpoint file " + path + ": " + what);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::vector<std::string> safetensors_files(const std::string& folder) {
  std::vector<std::string> out;
  for (const std::string& name : list_directory(folder)) {
    if (ends_with(name, ".safetensors") && !is_directory(folder + "/" + name)) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

struct Chunk {
  std::string file;  // relative to the folder
  const SafetensorsEntry* entry = nullptr;
  std::vector<int64_t> offsets;
};

// A box of a row-major tensor of shape `whole` as runs of contiguous elements: elements
// [begin, end) of the flattened tensor, stored from element `at` of the box (flattened).
std::vector<SavedPiece> runs_of_box(const std::string& file, const std::string& key, const std::vector<int64_t>& whole,
                                    const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  std::vector<SavedPiece> out;
  const size_t n = whole.size();
  for (int64_t s : sizes) {
    if (s == 0) return out;
  }
  if (n == 0) {
    out.push_back(SavedPiece{file, key, 0, 1, 0, {}});
    return out;
  }
  // The trailing dimensions the box covers whole are one run together with the first partial one.
  size_t d = n - 1;
  while (d > 0 && sizes[d] == whole[d]) --d;
  std::vector<int64_t> stride(n, 1);
  for (size_t i = n - 1; i > 0; --i) stride[i - 1] = stride[i] * whole[i];
  const int64_t run = sizes[d] * stride[d];
  int64_t count = 1;
  for (size_t i = 0; i < d; ++i) count *= sizes[i];
  if (count > (int64_t{1} << 22)) fail(file, "tensor \"" + key + "\" is chunked into more than 4M separate runs");
  std::vector<int64_t> index(d, 0);
  for (int64_t r = 0; r < count; ++r) {
    int64_t begin = offsets[d] * stride[d];
    for (size_t i = 0; i < d; ++i) begin += (offsets[i] + index[i]) * stride[i];
    out.push_back(SavedPiece{file, key, begin, begin + run, r * run, {}});
    for (size_t i = d; i-- > 0;) {  // the next multi-index, last dimension fastest
      if (++index[i] < sizes[i]) break;
      index[i] = 0;
    }
  }
  return out;
}

}  // namespace

bool is_dcp_folder(const std::string& folder) {
  return is_directory(folder) && !path_exists(folder + "/manifest.json") && !safetensors_files(folder).empty();
}

DcpFolder read_dcp_folder(const std::string& folder) {
  DcpFolder out;
  out.model.origin = out.optimizer.origin = "PyTorch checkpoint " + folder;
  out.model.folder = out.optimizer.folder = folder;
  // The headers, kept open while chunks point into them.
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, std::vector<Chunk>> chunks;
  for (const std::string& name : safetensors_files(folder)) {
    files.push_back(std::make_unique<SafetensorsFile>(folder + "/" + name));
    const SafetensorsFile& f = *files.back();
    nlohmann::json info;
    if (auto m = f.metadata().find("DCP_SHARDING_INFO"); m != f.metadata().end()) {
      info = nlohmann::json::parse(m->second, nullptr, false);
      if (!info.is_object()) fail(f.path(), "its DCP_SHARDING_INFO is not a JSON object");
    }
    for (const SafetensorsEntry& e : f.entries()) {
      Chunk c{name, &e, std::vector<int64_t>(e.shape.size(), 0)};
      if (info.is_object() && info.contains(e.name)) {
        const auto& o = info[e.name].is_object() ? info[e.name].value("saved_offsets", nlohmann::json()) : nlohmann::json();
        if (!o.is_array() || o.size() != e.shape.size()) {
          fail(f.path(), "DCP_SHARDING_INFO[\"" + e.name + "\"] has no saved_offsets of " + std::to_string(e.shape.size()) +
                             " dimensions");
        }
        for (size_t i = 0; i < o.size(); ++i) {
          if (!o[i].is_number_integer() || o[i].get<int64_t>() < 0 || o[i].get<int64_t>() > (int64_t{1} << 40)) {
            fail(f.path(), "DCP_SHARDING_INFO[\"" + e.name + "\"] has a saved offset that is not a small non-negative integer");
          }
          c.offsets[i] = o[i].get<int64_t>();
        }
      }
      chunks[e.name].push_back(std::move(c));
    }
  }
  for (auto& [key, list] : chunks) {
    // The whole tensor: as torch's reader infers it, the largest offset + size per dimension.
    std::vector<int64_t> whole(list.front().entry->shape.size(), 0);
    for (const Chunk& c : list) {
      if (c.entry->shape.size() != whole.size() || c.entry->dtype != list.front().entry->dtype) {
        fail(folder + "/" + c.file, "its chunk of \"" + key + "\" has another rank or dtype than the chunk in " + list.front().file);
      }
      for (size_t i = 0; i < whole.size(); ++i) whole[i] = std::max(whole[i], c.offsets[i] + c.entry->shape[i]);
    }
    std::vector<SavedPiece> pieces;
    for (const Chunk& c : list) {
      for (SavedPiece& p : runs_of_box(c.file, key, whole, c.offsets, c.entry->shape)) pieces.push_back(std::move(p));
    }
    // Chunks may repeat (replicas) but not overlap otherwise.
    std::sort(pieces.begin(), pieces.end(), [](const SavedPiece& a, const SavedPiece& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < pieces.size(); ++i) {
      const bool same = pieces[i].begin == pieces[i - 1].begin && pieces[i].end == pieces[i - 1].end;
      if (!same && pieces[i].begin < pieces[i - 1].end) {
        fail(folder, "chunks of \"" + key + "\" overlap (in " + pieces[i - 1].file + " and " + pieces[i].file + ")");
      }
    }
    if (key.rfind("state.", 0) == 0) {
      const std::string rest = key.substr(6);
      if (ends_with(rest, ".step")) {  // the step count: a scalar (float32 in torch's Adam family)
        const Chunk& c = list.front();
        if (c.entry->numel() != 1) fail(folder + "/" + c.file, "\"" + key + "\" is not a single number");
        at::Tensor v = at::empty({1}, at::TensorOptions().dtype(c.entry->dtype));
        for (const auto& f : files) {
          if (f->path() == folder + "/" + c.file) f->read(*c.entry, 0, v);
        }
        const double step = v.to(at::kDouble).item<double>();
        if (!(step >= 0) || step != std::floor(step) || step > 9e15) {
          fail(folder + "/" + c.file, "\"" + key + "\" is " + std::to_string(step) + ", not a step count");
        }
        out.steps[rest.substr(0, rest.size() - 5)] = static_cast<int64_t>(step);
        continue;
      }
      out.optimizer.pieces[key] = std::move(pieces);
      out.optimizer.dtypes[key] = list.front().entry->dtype;
      continue;
    }
    if (key.rfind("param_groups.", 0) == 0) continue;  // hyper-parameters come from the optimizer given
    out.model.shapes[key] = whole;
    out.model.dtypes[key] = list.front().entry->dtype;
    out.model.pieces[key] = std::move(pieces);
  }
  return out;
}

}  // namespace fsdp
