// Checkpoints on disk (include/fsdp/checkpoint.h, docs/checkpoints.md): the commit protocol that
// makes a save all-or-nothing, asynchronous saves, keep-last. Loading is checkpoint_load.cpp's, the
// ranks' agreement rank_agreement.cpp's.
//
// A save, on every rank, over the checkpointer's own process group (so that an asynchronous save's
// collectives on its thread never interleave with training's):
//   PREPARE  rank 0 sweeps what killed saves left (.tmp-*) and creates .tmp-step-N/{model,optim}
//   WRITE    each rank writes and fsyncs its files (FULL: rank 0, gathering one unit at a time)
//   GATHER   every rank's part (pieces, files with sizes and CRC-32C, RNG state, error if any)
//            reaches rank 0, point-to-point (the bytes moved are the sum of the parts)
//   COMMIT   rank 0 writes and fsyncs manifest.json (with its own checksum), moves an abandoned
//            run's newer checkpoints aside, puts .tmp-step-N in place as step-N (an atomic
//            exchange when step-N exists) and syncs the folder; only then is the checkpoint
//            visible; then keep-last deletes the oldest
//   The whole time, rank 0 holds the folder's lock (checkpoint_folder.h): one job per folder.
//   RESULT   rank 0's outcome reaches every rank: a failure anywhere fails the save everywhere
// A rank that dies before COMMIT leaves only a .tmp folder: the previous checkpoints are untouched.
#include "fsdp/checkpoint.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <thread>


#include "checkpoint/checkpoint_folder.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/file_system.h"
#include "checkpoint/generator_state.h"
#include "checkpoint/ignored_state.h"
#include "checkpoint/manifest.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/rank_agreement.h"
#include "comm/mesh_state.h"
#include "wrap/sharded_root.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/tensor_parallel_state.h"

namespace fsdp {
namespace {

// What a manifest says besides the pieces: the same on every rank (rank 0's is written).
nlohmann::json manifest_base(detail::ShardedRoot& root, StateDictKind kind, const RankState& state,
                             const TrainingState& training, const ShardedGradScaler* scaler) {
  nlohmann::json m;
  m["format"] = "fsdp-checkpoint";
  m["version"] = kManifestVersion;
  m["kind"] = to_string(kind);
  m["step"] = training.step;
  // The job's ranks (data-parallel x tensor-parallel), whose generators the checkpoint holds, and
  // fsdp's sharding factor over the data-parallel ones.
  m["world_size"] = job_size(root);
  m["shard_size"] = root.comm().mesh().shard_size;
  const TensorParallel* tp = tensor_parallel_of(root);
  m["tensor_parallel"] = tp ? tp->size() : 1;
  m["strategy"] = to_string(root.options().strategy);
  m["mixed_precision"] = root.options().mixed_precision ? nlohmann::json(dtype_name(root.options().mixed_precision->param_dtype))
                                                        : nlohmann::json();
  m["model"] = describe_model_state(root);
  if (state.optimizer) {
    m["optimizer"] = {{"type", state.optimizer->type}, {"groups", state.optimizer->groups}, {"steps", nlohmann::json::object()}};
  } else {
    m["optimizer"] = nullptr;
  }
  if (scaler) {
    m["scaler"] = {{"scale", scaler->state().scale}, {"growth_tracker", scaler->state().growth_tracker}};
  } else {
    m["scaler"] = nullptr;
  }
  nlohmann::json user = nlohmann::json::parse(training.user_json, nullptr, false);
  if (!user.is_object()) throw std::invalid_argument("fsdp: TrainingState::user_json must be a JSON object, got: " + training.user_json);
  m["training"] = user;
  return m;
}

void write_manifest(const std::string& folder, const nlohmann::json& m) {
  const std::string path = folder + "/manifest.json";
  {
    std::ofstream out(path);
    out << manifest_text(m);
    out.flush();
    if (!out) throw std::runtime_error("fsdp: cannot write " + path + ": " + std::strerror(errno));
  }
  fsync_path(path);
}

}  // namespace


StateDictKind parse_state_dict_kind(const std::string& name) {
  if (name == "full") return StateDictKind::FULL;
  if (name == "sharded") return StateDictKind::SHARDED;
  if (name == "local") return StateDictKind::LOCAL;
  throw std::invalid_argument("fsdp: unknown state dict kind \"" + name + "\"; choose full, sharded or local");
}

std::string to_string(StateDictKind kind) {
  switch (kind) {
    case StateDictKind::FULL: return "full";
    case StateDictKind::SHARDED: return "sharded";
    case StateDictKind::LOCAL: return "local";
  }
  return "?";
}

struct Checkpointer::Impl {
  std::shared_ptr<Mesh> mesh;
  CheckpointOptions options;
  GroupPtr group;  // this checkpointer's own: its collectives may run on the save thread
  std::thread writer;
  std::string error;  // the last asynchronous save's, until wait() reports it
  std::unique_ptr<FolderLock> lock;  // rank 0's, for the checkpointer's life
  std::set<int64_t> committed;        // rank 0: the steps this checkpointer saved
  // Asynchronous saves' host copy, one buffer per dtype, kept from save to save: the next save
  // waits for the previous write, so it can reuse the memory (already faulted in) at once.
  std::map<c10::ScalarType, at::Tensor> staging;
  bool warned_buffers = false;  // rank 0 said once that buffers differ across ranks (see save)

  // The steps after the files are written: gather the parts, commit on rank 0, agree.
  void commit(const std::string& dir, const std::string& tmp, nlohmann::json manifest, const nlohmann::json& part) {
    const int rank = group->getRank();
    // Replace, not throw, on bytes that are not UTF-8: an error message may quote a damaged file.
    const auto parts = gather_strings_to_rank0(group, part.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    std::string result;
    if (rank == 0) {
      result = error_of([&] {
        manifest["pieces"] = nlohmann::json::object();
        manifest["files"] = nlohmann::json::object();
        manifest["rng"] = nlohmann::json::object();
        for (size_t r = 0; r < parts.size(); ++r) {
          const auto p = nlohmann::json::parse(parts[r]);
          if (p.contains("error")) throw std::runtime_error("rank " + std::to_string(r) + " could not write its part: " + p["error"].get<std::string>());
          for (auto it = p["pieces"].begin(); it != p["pieces"].end(); ++it) {
            for (const auto& piece : *it) manifest["pieces"][it.key()].push_back(piece);
          }
          for (auto it = p["files"].begin(); it != p["files"].end(); ++it) manifest["files"][it.key()] = *it;
          manifest["rng"][std::to_string(r)] = p["rng"];
          if (!manifest["optimizer"].is_null()) {
            for (auto it = p["steps"].begin(); it != p["steps"].end(); ++it) {
              auto& s = manifest["optimizer"]["steps"][it.key()];
              if (s.is_null() || s.get<int64_t>() < it->get<int64_t>()) s = *it;
            }
          }
        }
        write_manifest(tmp, manifest);
        for (const char* sub : {"model", "optim"}) fsync_path(tmp + "/" + sub);
        fsync_path(tmp);
        const int64_t step = manifest["step"].get<int64_t>();
        // A run resumed from an older step owns the future: checkpoints at this step or later that
        // this checkpointer did not write belong to the run it abandoned.
        std::vector<StepFolder> abandoned;
        for (const StepFolder& c : complete_checkpoints(dir)) {
          if (c.step >= step && !committed.count(c.step)) abandoned.push_back(c);
        }
        if (!abandoned.empty()) {
          const std::string aside = set_aside(dir, abandoned);
          std::string names;
          for (const StepFolder& c : abandoned) names += (names.empty() ? "" : ", ") + step_name(c.step);
          std::fprintf(stderr,
                       "fsdp: %s/%s continues a run resumed from an earlier step: the abandoned run's %s moved to %s "
                       "(neither resumed from nor deleted; remove them when you no longer need them)\n",
                       dir.c_str(), step_name(step).c_str(), names.c_str(), aside.c_str());
        }
        commit_folder(tmp, dir + "/" + step_name(step));
        fsync_path(dir);
        committed.insert(step);
        if (options.keep_last > 0) {
          auto all = complete_checkpoints(dir);
          for (size_t i = 0; i + options.keep_last < all.size(); ++i) remove_tree(all[i].path);
        }
      });
      // A failed save leaves the previous checkpoints as they were, and gives back its space.
      if (!result.empty()) error_of([&] { remove_tree(tmp); });
    }
    agree(group, result, "saving checkpoint " + dir + "/" + step_name(manifest["step"].get<int64_t>()));
  }

  // PREPARE: returns the temporary folder.
  std::string prepare(const std::string& dir, int64_t step) {
    const std::string tmp = dir + "/.tmp-" + step_name(step);
    std::string err;
    if (group->getRank() == 0) {
      err = error_of([&] {
        make_directories(dir);
        sweep(dir);
        make_directories(tmp + "/model");
        make_directories(tmp + "/optim");
      });
    }
    agree(group, err, "preparing checkpoint folder " + tmp);
    return tmp;
  }
};

Checkpointer::Checkpointer(std::shared_ptr<Mesh> mesh, std::string dir, CheckpointOptions options)
    : impl_(std::make_unique<Impl>()), dir_(std::move(dir)) {
  TORCH_CHECK(options.keep_last >= 0, "fsdp: keep_last must be 0 (keep all) or a positive count");
  impl_->mesh = std::move(mesh);
  impl_->options = options;
  static std::atomic<int> count{0};
  auto& state = detail::MeshState::of(*impl_->mesh);
  impl_->group = state.make_group("checkpoint/" + std::to_string(count++), impl_->mesh->rank(),
                                  impl_->mesh->world_size(), c10::DeviceType::CPU);
  // One job per folder: rank 0 holds its lock (the other ranks write only inside its save's
  // temporary folder, which rank 0 creates).
  std::string err;
  if (impl_->group->getRank() == 0) {
    err = error_of([&] {
      impl_->lock = std::make_unique<FolderLock>(dir_);
      sweep(dir_);  // what a killed save left, before anyone resumes from the folder
    });
  }
  agree(impl_->group, err, "opening checkpoint folder " + dir_);
}

Checkpointer::~Checkpointer() {
  if (impl_->writer.joinable()) impl_->writer.join();
  // A destructor cannot throw: an asynchronous save that failed and was never waited for is at
  // least reported (wait() before the end of training reports it as an exception).
  if (!impl_->error.empty()) std::fprintf(stderr, "%s\n", impl_->error.c_str());
}

void Checkpointer::wait() {
  if (impl_->writer.joinable()) impl_->writer.join();
  if (!impl_->error.empty()) {
    const std::string e = std::move(impl_->error);
    impl_->error.clear();
    throw std::runtime_error(e);
  }
}

std::optional<std::string> Checkpointer::latest() const { return decided_by_rank0(impl_->group, dir_); }

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  std::vector<std::string> skipped;
  auto found = newest_good_checkpoint(dir, &skipped);
  for (const std::string& s : skipped) {
    std::fprintf(stderr, "fsdp: WARNING: skipping damaged checkpoint %s; %s\n", s.c_str(),
                 found ? ("using the newest good one, " + *found).c_str() : "no good one is left");
  }
  return found;
}

std::optional<std::string> find_checkpoint(Mesh& mesh, const std::string& path) {
  return decided_by_rank0(detail::MeshState::of(mesh).world, path);
}

std::string Checkpointer::save(FullyShardedDataParallelBase& model, torch::optim::Optimizer* optimizer,
                               const TrainingState& state, const ShardedGradScaler* scaler) {
  wait();
  detail::ShardedRoot& root = detail::RootAccess::of(model);
  root.check_checkpointable("saving a checkpoint");
  check_replicated_agree(root, "saving a checkpoint");
  const StateDictKind kind = impl_->options.kind;
  const MeshInfo& mi = root.comm().mesh();
  if (const TensorParallel* tp = tensor_parallel_of(root)) {
    // A split parameter's shard is a set of strided runs of the whole tensor, which SHARDED and
    // LOCAL pieces (one range each) cannot place; FULL puts the parts together as it gathers.
    if (kind != StateDictKind::FULL) {
      throw std::invalid_argument("fsdp: saving a " + to_string(kind) + " checkpoint of a model split for tensor "
                                  "parallelism (" + std::to_string(tp->size()) + " ranks): save FULL checkpoints "
                                  "(CheckpointOptions::kind, fsdp-train --checkpoint-kind full); they load at any "
                                  "TP and data-parallel size");
    }
  }
  if (impl_->group->getSize() != job_size(root)) {
    throw std::invalid_argument("fsdp: this Checkpointer was made on a mesh of " + std::to_string(impl_->group->getSize()) +
                                " ranks and the model is trained by " + std::to_string(job_size(root)) +
                                "; with tensor parallelism give it the job's mesh (TensorParallel::world())");
  }
  const std::string differ = buffers_that_differ(impl_->group, root);
  if (!differ.empty() && impl_->group->getRank() == 0 && !impl_->warned_buffers) {
    impl_->warned_buffers = true;  // once per checkpointer: the same buffers differ at every save
    std::cerr << ("fsdp: warning: saving a checkpoint: buffer(s) " + differ +
                  ": each rank's forwards update them from its own rows, as BatchNorm's running statistics are. A "
                  "checkpoint holds rank 0's, as PyTorch's state dicts do: a load gives every rank "
                  "rank 0's values, so a resumed run is not bit for bit the saved one on the other ranks. To keep them "
                  "exact, make them equal before saving (average them over the ranks with the mesh's world() group).\n")
              << std::flush;
  }
  // What this rank holds, by name. It throws on a rank whose optimizer steps a tensor that is not
  // the model's (or is of a class checkpoints do not know): every rank learns it here, instead of
  // the others waiting out the collective timeout in the next collective.
  RankState rs;
  agree(impl_->group, error_of([&] { rs = collect_rank_state(root, optimizer); }), "saving a checkpoint (nothing was saved)");
  check_same_optimizer_on_all_ranks(impl_->group, rs);
  nlohmann::json manifest = manifest_base(root, kind, rs, state, scaler);
  const std::string final_path = dir_ + "/" + step_name(state.step);
  // The first replica writes a SHARDED checkpoint (the others hold the same shards); every rank
  // writes its own LOCAL one.
  const bool writes = kind == StateDictKind::LOCAL || mi.rank / mi.shard_size == 0;
  auto part_of = [&](const WrittenPart& written) {
    nlohmann::json p = written;
    p["rng"] = rng_state();
    p["steps"] = rs.optimizer ? rs.optimizer->steps : nlohmann::json::object();
    return p;
  };

  if (kind == StateDictKind::FULL) {
    TORCH_CHECK(!impl_->options.async, "fsdp: asynchronous saves write SHARDED or LOCAL checkpoints; a FULL one is "
                                       "gathered through the model's own collectives and is written synchronously: drop "
                                       "CheckpointOptions::async (fsdp-train: --async-save), or save SHARDED checkpoints");
    const std::string tmp = impl_->prepare(dir_, state.step);
    WrittenPart written;
    const std::string err = error_of([&] { written = write_full_files(tmp, root, rs); });
    nlohmann::json p = err.empty() ? part_of(written) : nlohmann::json{{"error", err}};
    impl_->commit(dir_, tmp, std::move(manifest), p);
    return final_path;
  }
  if (!impl_->options.async) {
    const std::string tmp = impl_->prepare(dir_, state.step);
    WrittenPart written;
    const std::string err = error_of([&] { written = write_rank_files(tmp, rs, kind, mi.rank, mi.world_size, writes); });
    nlohmann::json p = err.empty() ? part_of(written) : nlohmann::json{{"error", err}};
    impl_->commit(dir_, tmp, std::move(manifest), p);
    return final_path;
  }
  // Asynchronous: copy this rank's state to host memory now (the stall), write it on a thread.
  // Each element once, into the staging buffers: LOCAL copies whole flat shards (the parameters'
  // pieces become views of those copies), SHARDED copies the pieces.
  {
    at::NoGradGuard no_grad;
    const bool local = kind == StateDictKind::LOCAL;
    auto is_shard_view = [&](const StatePiece& p) { return local && p.folder == "model" && p.unit >= 0; };
    std::vector<at::Tensor*> sources;
    if (local) {
      for (auto& shard : rs.unit_shards) sources.push_back(&shard);
    } else {
      rs.unit_shards.clear();
    }
    for (auto& piece : rs.pieces) {
      if (!is_shard_view(piece)) sources.push_back(&piece.local);
    }
    std::map<c10::ScalarType, int64_t> need;
    for (const at::Tensor* t : sources) need[t->scalar_type()] += t->numel();
    for (const auto& [dtype, n] : need) {
      at::Tensor& buf = impl_->staging[dtype];
      if (!buf.defined() || buf.numel() != n) buf = at::empty({n}, at::TensorOptions().dtype(dtype));
    }
    std::map<c10::ScalarType, int64_t> at;
    for (at::Tensor* t : sources) {
      int64_t& offset = at[t->scalar_type()];
      at::Tensor dst = impl_->staging[t->scalar_type()].narrow(0, offset, t->numel());
      dst.copy_(t->reshape({-1}));
      offset += t->numel();
      *t = dst;
    }
    for (auto& piece : rs.pieces) {
      if (is_shard_view(piece)) piece.local = rs.unit_shards[piece.unit].narrow(0, piece.shard_offset, piece.local.numel());
    }
  }
  const nlohmann::json rng = rng_state();
  impl_->writer = std::thread([this, rs = std::move(rs), manifest = std::move(manifest), kind, writes, rng,
                               rank = mi.rank, world = mi.world_size, step = state.step]() mutable {
    impl_->error = error_of([&] {
      const std::string tmp = impl_->prepare(dir_, step);
      WrittenPart written;
      const std::string err = error_of([&] { written = write_rank_files(tmp, rs, kind, rank, world, writes); });
      nlohmann::json p = written;
      if (!err.empty()) {
        p = {{"error", err}};
      } else {
        p["rng"] = rng;
        p["steps"] = rs.optimizer ? rs.optimizer->steps : nlohmann::json::object();
      }
      rs = RankState{};  // the host copy goes as soon as it is written
      impl_->commit(dir_, tmp, std::move(manifest), p);
    });
  });
  return final_path;
}

}  // namespace fsdp
