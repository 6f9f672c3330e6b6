// Checkpoints (paper §3.2's state dicts; docs/checkpoints.md): a wrapped model's parameters and
// buffers, its optimizer's state and what resuming needs, keyed by the original parameter names,
// on disk as a folder of safetensors files and a JSON manifest.
//
//   fsdp::Checkpointer ckpt(mesh, "run/checkpoints", {fsdp::StateDictKind::SHARDED, /*keep_last=*/3});
//   if (auto last = ckpt.latest()) start = fsdp::load_checkpoint(*last, model, &optim).step;
//   for (step = start; ...) { ...; if (step % 100 == 0) ckpt.save(model, &optim, {step + 1}); }
//
// Three kinds, as PyTorch's FSDP offers them:
//   FULL     every parameter in its original shape in one file, written by rank 0 as it gathers
//            one unit at a time (no rank holds more than its shards and one unit).
//   SHARDED  each rank writes the pieces it holds with their place in the whole tensor, no
//            communication; torch.distributed.checkpoint's Hugging Face reader reads the folder.
//   LOCAL    each rank's raw flat shards: the fastest resume, into the same layout only.
// FULL and SHARDED load into a model wrapped at any strategy and world size (each rank reads only
// the elements it holds). A load checks everything first and changes nothing unless every rank
// can load all of it. Saves go to a temporary folder, are fsynced and renamed into place once
// every rank's part is complete, so a crash during a save leaves the previous checkpoint intact.
// Parameters fsdp ignores (Options::ignored_modules) are saved too, by kind (options.h): a table
// declared in Options::row_sharded_parameters whole, with its optimizer state, each rank reading
// its rows back at any world size; any other as replicated, once, after checking that the ranks'
// copies are equal (refused otherwise, naming it: save, export_full and full_state_dict).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include "fsdp/fsdp.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/mesh.h"

namespace fsdp {

enum class StateDictKind { FULL, SHARDED, LOCAL };
StateDictKind parse_state_dict_kind(const std::string& name);  // "full", "sharded", "local"
std::string to_string(StateDictKind kind);

// What a training loop needs besides weights and optimizer state to continue where it stopped.
struct TrainingState {
  int64_t step = 0;              // the next step to run
  std::string user_json = "{}";  // anything else, as a JSON object (data position, schedule, ...)
};

struct CheckpointOptions {
  StateDictKind kind = StateDictKind::SHARDED;
  int keep_last = 0;   // after a save, delete all but the newest K checkpoints; 0 keeps every one
  // Copy this rank's state to host memory and write it on a background thread while training
  // continues; the next save (or wait(), or the destructor) waits for it. SHARDED and LOCAL only.
  bool async = false;
};

class Checkpointer {
 public:
  // `dir` holds checkpoints step-00000010/, step-00000020/, ...; it must be one folder that every
  // rank sees (a shared file system when ranks are on several hosts). Collective: every rank
  // constructs one, in the same order. One job per folder: the checkpointer locks it (dir/.lock)
  // for its life and throws on every rank, naming the holder, when another job holds it; a
  // crashed job's lock goes with its process.
  //
  // A save at step S moves complete checkpoints at steps >= S that this checkpointer did not write
  // (those of a run this one was resumed away from) to dir/abandoned-<time>/, with a warning:
  // keep-last and latest() then see only this run's checkpoints.
  Checkpointer(std::shared_ptr<Mesh> mesh, std::string dir, CheckpointOptions options = {});
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Collective. Saves `model` (and `optimizer`, `scaler` when given) as checkpoint `state.step`.
  // Returns the checkpoint's folder (with async, the folder it will have once committed).
  std::string save(FullyShardedDataParallelBase& model, torch::optim::Optimizer* optimizer,
                   const TrainingState& state, const ShardedGradScaler* scaler = nullptr);
  // Waits until the last asynchronous save is committed; throws its error if it failed.
  void wait();
  // Collective. The newest complete checkpoint under the folder that is not damaged, if any
  // (damaged newer ones are skipped with a warning), decided by rank 0: every rank gets the same.
  std::optional<std::string> latest() const;
  const std::string& dir() const { return dir_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string dir_;
};

// The newest complete, undamaged checkpoint (step-N folder with its manifest) under `dir`, if any,
// as this process sees it; damaged newer ones are skipped with a warning. Not collective: ranks
// that must agree use find_checkpoint or Checkpointer::latest.
std::optional<std::string> latest_checkpoint(const std::string& dir);

// Collective. What `path` names for every rank: `path` itself when it is a checkpoint (holds a
// manifest.json), else the newest good checkpoint under it; nullopt when neither. Rank 0 decides.
std::optional<std::string> find_checkpoint(Mesh& mesh, const std::string& path);

// Collective. Loads checkpoint folder `path` (any kind) into `model` and, when given, `optimizer`
// and `scaler`; restores each rank's random number generators when the world size is the same.
// Returns the training state saved with it. The manifest is checked against its checksum and a
// schema, every rank checks it read the same one, and everything (weights, optimizer state,
// scaler, generators) is read and checked before anything changes: it throws, naming the file,
// the field and the problem, with nothing changed on any rank when any rank cannot load all of it.
TrainingState load_checkpoint(const std::string& path, FullyShardedDataParallelBase& model,
                              torch::optim::Optimizer* optimizer = nullptr, ShardedGradScaler* scaler = nullptr);

// Collective. Writes the model's parameters and buffers whole to one safetensors file (rank 0
// writes, gathering one unit at a time): what Python's safetensors.torch.load_file reads. Tied
// weights are written once; the file's "__metadata__" lists their other names under "aliases".
void export_full(const std::string& path, FullyShardedDataParallelBase& model);

// Collective. Loads a plain state dict file into `model`: safetensors (e.g. saved from Python with
// safetensors.torch.save_file), or a torch.save file of a dict of tensors. Names are the model's
// parameter and buffer names; a tied weight may appear under any of its names. Each rank reads only
// the elements it holds from a safetensors file.
void load_model_file(const std::string& path, FullyShardedDataParallelBase& model);

// In memory, keyed by the original names: every parameter and buffer whole, a tensor registered
// under several names (a tied weight) under each of them (collective; with
// rank0_only the other ranks get an empty list and hold one unit at a time).
std::vector<std::pair<std::string, at::Tensor>> full_state_dict(FullyShardedDataParallelBase& model,
                                                                bool rank0_only = true);

// One tensor's piece held by this rank: `local` holds elements [flat_begin, flat_begin + numel)
// of the whole tensor of `shape`, flattened in row-major order.
struct ShardedTensor {
  std::vector<int64_t> shape;
  int64_t flat_begin = 0;
  at::Tensor local;
};
// In memory: this rank's pieces (views of its shards, no copies, no communication).
std::vector<std::pair<std::string, ShardedTensor>> sharded_state_dict(FullyShardedDataParallelBase& model);

}  // namespace fsdp
