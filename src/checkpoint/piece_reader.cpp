// Reading a saved tensor's elements from the pieces that hold them: PieceReader opens each file
// once, checks each FULL or SHARDED piece lies where its file says, and converts dtypes; read_into
// reads a tensor-parallel rank's part of a whole saved tensor.
#include "checkpoint/piece_reader.h"

#include <algorithm>

namespace fsdp {
namespace reading {

[[noreturn]] void fail(const std::string& origin, const std::string& what) {
  throw std::runtime_error("fsdp: cannot load " + origin + ": " + what);
}

void PieceReader::read(const std::string& name, int64_t begin, at::Tensor& out) {
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

void PieceReader::check_box(const SafetensorsFile& f, const SafetensorsEntry& e, const SavedPiece& p,
                            const std::string& name) {
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

const SafetensorsFile& PieceReader::file(const std::string& rel) {
  auto it = files_.find(rel);
  if (it != files_.end()) return *it->second;
  const std::string path = saved_.folder.empty() || rel.front() == '/' ? rel : saved_.folder + "/" + rel;
  opened_.insert(rel);
  // A file of another size than the manifest's is truncated or replaced: say so, before its
  // header's own checks say something less direct.
  if (auto want = saved_.file_bytes.find(rel); want != saved_.file_bytes.end()) check_listed_file(path, want->second);
  return *files_.emplace(rel, std::make_unique<SafetensorsFile>(path)).first->second;
}

void read_into(PieceReader& reader, const std::string& name, const std::optional<TensorParallelPlacement>& split,
               int64_t begin, at::Tensor into) {
  if (!split) {
    reader.read(name, begin, into);
    return;
  }
  read_part([&](int64_t whole_begin, at::Tensor run) { reader.read(name, whole_begin, run); }, split->full_shape,
            split->shard, split->tp->rank(), split->tp->size(), begin, into);
}

}  // namespace reading
}  // namespace fsdp
