// A model's weights alone, in one file: export_full writes a safetensors file a plain model loads;
// load_model_file reads one (or a torch.save dict of tensors), each rank the elements it holds.
#include "fsdp/checkpoint.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <vector>

#include <torch/serialize.h>

#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/file_system.h"
#include "checkpoint/ignored_state.h"
#include "checkpoint/rank_agreement.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/tensor_parallel_state.h"
#include "wrap/sharded_root.h"

namespace fsdp {

void export_full(const std::string& path, FullyShardedDataParallelBase& model) {
  detail::ShardedRoot& root = detail::RootAccess::of(model);
  root.check_checkpointable("export_full");
  check_replicated_agree(root, "export_full");
  const RankState rs = collect_rank_state(root, nullptr);
  const std::string tmp = path + ".tmp";
  std::string err = error_of([&] { write_full_model_file(tmp, root, rs); });
  if (writes_whole(root) && err.empty()) err = error_of([&] { rename_path(tmp, path); });
  agree(job_group(root), err, "exporting " + path);
}

void load_model_file(const std::string& path, FullyShardedDataParallelBase& model) {
  detail::ShardedRoot& root = detail::RootAccess::of(model);
  root.check_checkpointable("load_model_file");
  StagedLoad staged;
  const std::string err = error_of([&] {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("fsdp: cannot open " + path + ": " + std::strerror(errno));
    char magic[4] = {0, 0, 0, 0};
    in.read(magic, 4);
    // A torch.save file is a zip archive (a local file header, "PK\3\4"), read whole by the
    // unpickler; anything else is read as safetensors, each rank only the elements it holds (a
    // safetensors header of 0x4B50 bytes also starts with "PK").
    if (in.gcount() == 4 && std::memcmp(magic, "PK\x03\x04", 4) == 0) {
      in.seekg(0);
      std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      c10::IValue value;
      try {
        value = torch::pickle_load(data);
      } catch (const std::exception& e) {
        throw std::runtime_error(
            "fsdp: cannot read " + path + " with libtorch's unpickler (" + first_line(e.what()) +
            "). A torch.save of model.state_dict() stores an OrderedDict, which libtorch cannot read (PyTorch issue "
            "#100741). Re-save it from Python as a plain dict, torch.save(dict(model.state_dict()), path), or as "
            "safetensors, safetensors.torch.save_model(model, path).");
      }
      if (!value.isGenericDict()) throw std::runtime_error("fsdp: " + path + " holds a " + value.tagKind() + ", not a dict of tensors");
      std::map<std::string, at::Tensor> tensors;
      for (const auto& kv : value.toGenericDict()) {
        if (!kv.key().isString() || !kv.value().isTensor()) {
          throw std::runtime_error("fsdp: " + path + " is not a dict of name -> tensor (entry " + kv.key().tagKind() + ")");
        }
        tensors[kv.key().toStringRef()] = kv.value().toTensor();
      }
      stage_model(root, saved_from_memory(path, tensors), staged);
    } else {
      stage_model(root, saved_from_safetensors(path), staged);
    }
  });
  agree(job_group(root), err, "loading " + path + " (nothing was changed)");
  apply(staged, nullptr);
}

}  // namespace fsdp
