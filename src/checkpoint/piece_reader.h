// Reading a saved tensor's elements from the pieces that hold them (a checkpoint's safetensors
// files, or tensors in memory): what the checkpoint reader's parts share (saved_tensors.cpp,
// stage_model.cpp, stage_optimizer.cpp, verify_files.cpp). Internal to src/checkpoint/.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_parallel_state.h"

namespace fsdp {
namespace reading {

// Throws "fsdp: cannot load <origin>: <what>".
[[noreturn]] void fail(const std::string& origin, const std::string& what);

// A file the manifest lists: there, with the size it says (verify_files.cpp).
void check_listed_file(const std::string& path, int64_t bytes);

// Reads pieces; opens each file once.
class PieceReader {
 public:
  PieceReader(const SavedTensors& saved, std::set<std::string>& opened) : saved_(saved), opened_(opened) {}

  // Elements [begin, begin + out.numel()) of saved tensor `name` into `out` (1-D, contiguous),
  // converting the dtype if the saved one differs.
  void read(const std::string& name, int64_t begin, at::Tensor& out);

 private:
  // A FULL or SHARDED piece: the whole file tensor, placed where the file's own sharding metadata
  // says (a manifest that points a piece elsewhere would load the wrong elements).
  void check_box(const SafetensorsFile& f, const SafetensorsEntry& e, const SavedPiece& p, const std::string& name);

  const SafetensorsFile& file(const std::string& rel);

  const SavedTensors& saved_;
  std::set<std::string>& opened_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, nlohmann::json> sharding_;  // file path -> its DCP_SHARDING_INFO
};

// Elements [begin, begin + into.numel()) of saved tensor `name`, or of this rank's part of it when
// the parameter is split for tensor parallelism.
void read_into(PieceReader& reader, const std::string& name, const std::optional<TensorParallelPlacement>& split,
               int64_t begin, at::Tensor into);

}  // namespace reading
}  // namespace fsdp
