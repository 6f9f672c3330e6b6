// Reading a checkpoint PyTorch wrote with torch.distributed.checkpoint's Hugging Face writer
// (`dcp.save(state, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))`, e.g.
// from an FSDP2 job): a folder of safetensors files, each holding some ranks' chunks of tensors,
// their places in the whole tensors in the file's `DCP_SHARDING_INFO` ("saved_offsets"); no
// manifest. Keys are the model's parameter names and, for the optimizer, the flattened keys of
// `get_optimizer_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))`:
// `state.<param>.<key>` (`exp_avg`, `exp_avg_sq`, `step`, ...).
//
// Each chunk (a box of its tensor) becomes pieces of contiguous elements, so any chunking reads:
// FSDP2's dim-0 chunks are one piece each, a column chunk one piece per row.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_reader.h"

namespace fsdp {

struct DcpFolder {
  SavedTensors model;      // the model's tensors (shapes, pieces)
  SavedTensors optimizer;  // pieces of state.<param>.<key>, the step tensors' values in `steps`
  nlohmann::json steps = nlohmann::json::object();  // param -> step count, from state.<param>.step
};

// True when `folder` holds safetensors files and no fsdp manifest.
bool is_dcp_folder(const std::string& folder);

// Reads every safetensors file's header in `folder` (not the data). Throws, naming the file, for a
// chunk outside its tensor, chunks of one tensor with different dtypes, or chunks that overlap.
DcpFolder read_dcp_folder(const std::string& folder);

}  // namespace fsdp
