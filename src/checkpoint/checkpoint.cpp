// Checkpoints on disk (include/fsdp/checkpoint.h, docs/checkpoints.md): the commit protocol that
// makes a save all-or-nothing, asynchronous saves, keep-last, and loads that change nothing unless
// every rank can load everything.
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
#include <unordered_map>
#include <unordered_set>
#include <thread>

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/serialize.h>

#include "checkpoint/checkpoint_folder.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/dcp_reader.h"
#include "checkpoint/file_system.h"
#include "checkpoint/ignored_state.h"
#include "checkpoint/manifest.h"
#include "checkpoint/optimizer_state.h"
#include "comm/mesh_state.h"
#include "checkpoint/safetensors.h"
#include "wrap/sharded_root.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/tensor_parallel_state.h"
#include "tensor_parallel/rng_tracker.h"

namespace fsdp {
namespace {

std::string hex(const at::Tensor& bytes) {
  static const char* digits = "0123456789abcdef";
  const auto* p = bytes.data_ptr<uint8_t>();
  std::string out;
  out.reserve(2 * bytes.numel());
  for (int64_t i = 0; i < bytes.numel(); ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

at::Tensor unhex(const std::string& text) {
  at::Tensor out = at::empty({static_cast<int64_t>(text.size() / 2)}, at::kByte);
  auto* p = out.data_ptr<uint8_t>();
  auto v = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (size_t i = 0; i + 1 < text.size(); i += 2) p[i / 2] = static_cast<uint8_t>(v(text[i]) << 4 | v(text[i + 1]));
  return out;
}

// The random number generators a rank's training draws from: the CPU one and, with CUDA, the
// current device's.
nlohmann::json rng_state() {
  nlohmann::json out;
  {
    at::Generator g = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(g.mutex());
    out["cpu"] = hex(g.get_state());
  }
  if (at::hasCUDA()) {
    at::Generator g = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA));
    std::lock_guard<std::mutex> lock(g.mutex());
    out["cuda"] = hex(g.get_state());
  }
  // This TP rank's streams for dropout on split activations (fsdp::seed_tensor_parallel_rng).
  for (auto& [name, g] : detail::tensor_parallel_generators()) {
    std::lock_guard<std::mutex> lock(g.mutex());
    out[name] = hex(g.get_state());
  }
  return out;
}

// A rank's saved generator states, checked by setting them on clones of the generators (a state of
// the wrong size or version throws here, while nothing has changed), applied only after every rank
// has checked its own.
struct StagedRng {
  std::vector<std::pair<at::Generator, at::Tensor>> states;

  static StagedRng check(const nlohmann::json& j, const std::string& origin) {
    StagedRng out;
    auto stage = [&](const char* name, at::Generator g) {
      if (!j.contains(name)) return;
      at::Tensor state = unhex(j[name].get<std::string>());
      try {
        at::Generator probe = g.clone();
        probe.set_state(state);
      } catch (const std::exception& e) {
        throw std::runtime_error("fsdp: cannot load " + origin + ": its " + name + " random number generator state does "
                                 "not fit this build of libtorch (" + first_line(e.what()) + ")");
      }
      out.states.emplace_back(std::move(g), std::move(state));
    };
    stage("cpu", at::detail::getDefaultCPUGenerator());
    if (at::hasCUDA()) stage("cuda", at::globalContext().defaultGenerator(c10::Device(c10::kCUDA)));
    for (auto& [name, g] : detail::tensor_parallel_generators()) stage(name.c_str(), g);
    return out;
  }

  void apply() {
    for (auto& [g, state] : states) {
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(state);
    }
  }
};

// Every rank's error (empty: none); throws on every rank, naming the first rank that failed, when
// any did. Every rank calls it at the same point, so a failure on one rank cannot leave the others
// waiting in a later collective.
void agree(const GroupPtr& group, const std::string& mine, const std::string& what) {
  const auto all = all_gather_strings(group, mine);
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) {
      throw std::runtime_error("fsdp: " + what + " failed on rank " + std::to_string(r) + ": " + all[r]);
    }
  }
}

// A checkpoint holds one value of each buffer (buffers are whole on every rank; rank 0 writes
// them, as PyTorch's state dicts hold rank 0's). Buffers that differ across ranks -- BatchNorm's
// running statistics, any buffer a forward updates from the rank's own rows -- come back as rank
// 0's on every rank, so a resumed run is not bit for bit the one saved on the other ranks (an
// evaluation with them, a forward that reads them). Found by the conformance scenario
// Buffers.CheckpointsRestoreBuffersBitwise. Not refused (a BatchNorm model trained without
// synchronized statistics must stay checkpointable, as in PyTorch), but said: the names of the
// buffers that differ, "" when none do. Every rank calls it (a collective).
std::string buffers_that_differ(const GroupPtr& group, detail::ShardedRoot& root) {
  if (group->getSize() == 1) return "";
  std::vector<std::string> names;
  std::string mine;
  for (const auto& b : root.module().named_buffers(true)) {
    if (!b.value().defined()) continue;
    const at::Tensor t = b.value().detach().to(c10::kCPU).contiguous();
    uint64_t h = 1469598103934665603ULL;  // FNV-1a over the bytes
    const auto* p = static_cast<const unsigned char*>(t.data_ptr());
    for (size_t i = 0; i < t.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ULL;
    names.push_back(b.key());
    mine += std::to_string(h) + ",";
  }
  if (names.empty()) return "";
  const auto all = all_gather_strings(group, mine);
  auto split = [](const std::string& s) {
    std::vector<std::string> out;
    size_t from = 0;
    for (size_t comma = s.find(','); comma != std::string::npos; from = comma + 1, comma = s.find(',', from)) {
      out.push_back(s.substr(from, comma - from));
    }
    return out;
  };
  const auto rank0 = split(all[0]);
  std::vector<std::string> differ;
  int first_rank = -1;
  for (size_t i = 0; i < names.size(); ++i) {
    for (size_t r = 1; r < all.size(); ++r) {
      const auto theirs = split(all[r]);
      if (i >= theirs.size() || i >= rank0.size() || theirs[i] != rank0[i]) {
        differ.push_back("'" + names[i] + "'");
        if (first_rank < 0) first_rank = static_cast<int>(r);
        break;
      }
    }
  }
  if (differ.empty()) return "";
  std::string list;
  for (size_t i = 0; i < differ.size() && i < 8; ++i) list += (i ? ", " : "") + differ[i];
  if (differ.size() > 8) list += " and " + std::to_string(differ.size() - 8) + " more";
  return list + " differ across ranks (rank " + std::to_string(first_rank) + "'s from rank 0's)";
}

// Every rank's optimizer must step the same parameters in the same groups (in any order): the
// manifest records rank 0's groups, and a rank whose optimizer lacks a parameter would save no
// state for its piece of it, a checkpoint that resumes that parameter from nothing. Collective:
// throws on every rank, naming the rank and the parameters, before anything is written.
void check_same_optimizer_on_all_ranks(const GroupPtr& group, const RankState& rs) {
  nlohmann::json mine = nullptr;  // no optimizer given
  if (rs.optimizer) {
    std::vector<std::vector<std::string>> groups;
    for (const auto& g : rs.optimizer->groups) {
      std::vector<std::string> names = g.at("params").get<std::vector<std::string>>();
      std::sort(names.begin(), names.end());
      groups.push_back(std::move(names));
    }
    std::sort(groups.begin(), groups.end());
    mine = groups;
  }
  const auto all = all_gather_strings(group, mine.dump());
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    const auto theirs = nlohmann::json::parse(all[r]), first = nlohmann::json::parse(all[0]);
    auto names_of = [](const nlohmann::json& j) {
      std::set<std::string> out;
      if (j.is_array()) {
        for (const auto& g : j) {
          for (const auto& n : g) out.insert(n.get<std::string>());
        }
      }
      return out;
    };
    const auto a = names_of(first), b = names_of(theirs);
    auto list = [](const std::set<std::string>& s) {
      std::string out;
      for (const auto& n : s) out += (out.empty() ? "" : ", ") + n;
      return out;
    };
    std::set<std::string> lacks, extra;
    for (const auto& n : a) if (!b.count(n)) lacks.insert(n);
    for (const auto& n : b) if (!a.count(n)) extra.insert(n);
    const std::string who = "rank " + std::to_string(r) + "'s optimizer";
    std::string what;
    if (first.is_null() != theirs.is_null()) {
      what = first.is_null() ? who + " was given and rank 0's was not" : who + " was not given and rank 0's was";
    } else if (!lacks.empty() || !extra.empty()) {
      if (!lacks.empty()) what = who + " lacks " + list(lacks) + ", which rank 0's steps";
      if (!extra.empty()) what += (what.empty() ? who : std::string(", and")) + " steps " + list(extra) + ", which rank 0's lacks";
    } else {
      what = who + " groups the parameters otherwise than rank 0's";
    }
    throw std::invalid_argument("fsdp: saving a checkpoint: the optimizers differ across ranks: " + what +
                                ". Every rank must build its optimizer from the same parameters in the same groups "
                                "(the wrapper's parameters(), in any order); nothing was saved");
  }
}

// What a manifest would say of the optimizer, for a PyTorch checkpoint: its type is taken to be
// this optimizer's (the state tensors' names, checked by stage_optimizer, must fit it), the step
// counts are the files', and the groups with their hyper-parameters are those of the folder's
// optimizer_groups.json when it has one (torch 2.11's Hugging Face writer cannot store them: see
// tests/python/optimizer_interop.py), else this optimizer's own.
nlohmann::json dcp_optimizer_json(detail::ShardedRoot& root, torch::optim::Optimizer& optimizer, const DcpFolder& dcp) {
  auto adapter = OptimizerStateAdapter::for_optimizer(optimizer);
  const std::map<const c10::TensorImpl*, std::string> name_of = saved_parameter_names(root);
  nlohmann::json groups = nlohmann::json::array();
  for (auto& group : optimizer.param_groups()) {
    nlohmann::json names = nlohmann::json::array();
    for (const auto& p : group.params()) {
      auto it = name_of.find(p.unsafeGetTensorImpl());
      if (it != name_of.end()) names.push_back(it->second);
    }
    groups.push_back({{"params", names}, {"options", adapter->group_options(group)}});
  }
  std::set<std::string> params;
  for (const auto& [impl, name] : name_of) params.insert(name);
  for (const auto& [key, pieces] : dcp.optimizer.pieces) {
    const std::string param = key.substr(6, key.rfind('.') - 6);
    if (!params.count(param)) {
      throw std::runtime_error("fsdp: cannot load " + dcp.optimizer.origin + ": it holds optimizer state \"" + key +
                               "\" of \"" + param + "\", which is not a parameter of this model (by its first name)");
    }
    if (!dcp.steps.contains(param)) {
      throw std::runtime_error("fsdp: cannot load " + dcp.optimizer.origin + ": it holds \"" + key + "\" but no \"state." +
                               param + ".step\" (save the optimizer state flattened, with its step tensors)");
    }
  }
  const std::string sidecar = dcp.model.folder + "/optimizer_groups.json";
  if (path_exists(sidecar)) {
    std::ifstream in(sidecar);
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    const nlohmann::json saved = j.is_object() ? j.value("groups", nlohmann::json()) : nlohmann::json();
    bool ok = saved.is_array();
    for (const auto& g : ok ? saved : nlohmann::json::array()) {
      ok = ok && g.is_object() && g.contains("params") && g["params"].is_array() && g.contains("options") &&
           g["options"].is_object();
      for (const auto& n : ok ? g["params"] : nlohmann::json::array()) ok = ok && n.is_string();
    }
    if (!ok) {
      throw std::runtime_error("fsdp: cannot load " + sidecar + ": not {\"groups\": [{\"params\": [names], \"options\": "
                               "{...}}, ...]}");
    }
    groups = saved;
  }
  return {{"type", adapter->name()}, {"groups", groups}, {"steps", dcp.steps}};
}

// Which checkpoint `path` means (itself when it holds a manifest, else the newest good one under
// it), decided by rank 0 alone and sent to every rank: ranks that looked on their own could see
// different folders (a commit landing between their listings, a network file system's cache).
std::optional<std::string> decided_by_rank0(const GroupPtr& group, const std::string& path) {
  std::string mine;
  if (group->getRank() == 0) {
    if (path_exists(path + "/manifest.json") || is_dcp_folder(path)) {
      mine = "=" + path;
    } else if (auto found = latest_checkpoint(path)) {
      mine = "=" + *found;
    }
  }
  const std::string decided = all_gather_strings(group, mine).at(0);
  if (decided.empty()) return std::nullopt;
  return decided.substr(1);
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
    return "";
  } catch (const c10::Error& e) {
    // The message the other ranks get too: without this rank's backtrace.
    std::string msg = e.what_without_backtrace();
    return msg.empty() ? "unknown error" : msg;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    return msg.empty() ? "unknown error" : msg;
  }
}

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
                                       "gathered through the model's own collectives and is written synchronously");
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

TrainingState load_checkpoint(const std::string& path, FullyShardedDataParallelBase& model,
                              torch::optim::Optimizer* optimizer, ShardedGradScaler* scaler) {
  detail::ShardedRoot& root = detail::RootAccess::of(model);
  root.check_checkpointable("loading a checkpoint");
  const MeshInfo& mi = root.comm().mesh();
  // Stage: every rank reads and checks everything it will change (weights, optimizer state,
  // scaler, generators, training state) into staging. Agree. Only then apply, on every rank.
  StagedLoad staged;
  StagedRng rng;
  nlohmann::json manifest;
  std::optional<GradScalerState> scaler_state;
  TrainingState out;
  std::string manifest_id = "(unread)";
  std::string err = error_of([&] {
    if (is_dcp_folder(path)) {
      // A PyTorch checkpoint (dcp_reader.h): weights and optimizer state by name; no generators,
      // scaler or training state; the optimizer's hyper-parameters stay those it was built with.
      const DcpFolder dcp = read_dcp_folder(path);
      manifest_id = "PyTorch checkpoint";
      stage_model(root, dcp.model, staged);
      if (optimizer) stage_optimizer(root, *optimizer, dcp.optimizer, dcp_optimizer_json(root, *optimizer, dcp), staged);
      if (scaler) throw std::runtime_error("fsdp: " + path + " is a PyTorch checkpoint: it holds no gradient scaler state");
      for (const auto& [param, step] : dcp.steps.items()) out.step = std::max(out.step, step.get<int64_t>());
      out.user_json = "{}";
      return;
    }
    manifest = read_manifest(path);
    manifest_id = std::to_string(manifest_checksum(manifest)) + " step " + manifest["step"].dump();
    const StateDictKind kind = parse_state_dict_kind(manifest["kind"].get<std::string>());
    if (kind == StateDictKind::LOCAL) {
      const auto here = describe_model_state(root);
      const int W = manifest["world_size"].get<int>(), F = manifest["shard_size"].get<int>();
      if (W != mi.world_size || F != mi.shard_size || manifest["model"]["units"] != here["units"]) {
        throw std::runtime_error(
            "fsdp: " + path + " is a LOCAL checkpoint saved at W=" + std::to_string(W) + ", F=" + std::to_string(F) +
            " (" + manifest["strategy"].get<std::string>() + ", " + std::to_string(manifest["model"]["units"].size()) +
            " units); this model is wrapped at W=" + std::to_string(mi.world_size) + ", F=" +
            std::to_string(mi.shard_size) + " (" + to_string(root.options().strategy) + ", " +
            std::to_string(here["units"].size()) + " units). LOCAL checkpoints load only into the same layout: "
            "resume with the saving job's world size and strategy, or save FULL or SHARDED checkpoints to reshard.");
      }
    }
    const SavedTensors saved = saved_from_manifest(path, manifest);
    stage_model(root, saved, staged);
    if (optimizer) stage_optimizer(root, *optimizer, saved, manifest["optimizer"], staged);
    // After staging, which opened only the files holding this rank's elements: their sizes, and the
    // checksums of this rank's share of all files.
    verify_files(path, manifest, job_rank(root), job_size(root), staged.files_read);
    if (scaler) {
      if (manifest["scaler"].is_null()) {
        throw std::runtime_error("fsdp: " + path + " holds no gradient scaler state (it was saved without one); "
                                 "load it without a scaler");
      }
      scaler_state = GradScalerState{manifest["scaler"]["scale"].get<double>(),
                                              manifest["scaler"]["growth_tracker"].get<int64_t>()};
    }
    // The generators go back to the ranks that saved them when the job has the same ranks.
    const std::string me = std::to_string(job_rank(root));
    const TensorParallel* tp = tensor_parallel_of(root);
    if (manifest["world_size"].get<int>() == job_size(root) && manifest.value("tensor_parallel", 1) == (tp ? tp->size() : 1) &&
        manifest.contains("rng") && manifest["rng"].contains(me)) {
      rng = StagedRng::check(manifest["rng"][me], path);
    }
    out.step = manifest["step"].get<int64_t>();
    out.user_json = manifest["training"].dump();
  });
  // Every rank must have read the same manifest (the same path, the same bytes).
  const auto ids = all_gather_strings(job_group(root), path + "\n" + manifest_id);
  for (size_t r = 1; r < ids.size() && err.empty(); ++r) {
    if (ids[r] != ids[0]) {
      err = "ranks read different manifests: rank 0 read " + ids[0].substr(0, ids[0].find('\n')) + " (" +
            ids[0].substr(ids[0].find('\n') + 1) + "), rank " + std::to_string(r) + " read " +
            ids[r].substr(0, ids[r].find('\n')) + " (" + ids[r].substr(ids[r].find('\n') + 1) +
            "). Give every rank the same checkpoint folder (fsdp::find_checkpoint decides one for all), on a file "
            "system every rank sees the same";
    }
  }
  agree(job_group(root), err, "loading checkpoint " + path + " (nothing was changed)");
  apply(staged, optimizer);
  if (scaler_state) scaler->load_state(*scaler_state);
  rng.apply();
  return out;
}

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
    if (!in) throw std::runtime_error("fsdp: cannot open " + path);
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

std::vector<std::pair<std::string, at::Tensor>> full_state_dict(FullyShardedDataParallelBase& model, bool rank0_only) {
  detail::ShardedRoot& root = detail::RootAccess::of(model);
  root.check_checkpointable("full_state_dict");
  check_replicated_agree(root, "full_state_dict");
  const bool keep = !rank0_only || writes_whole(root);
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_map<const c10::TensorImpl*, at::Tensor> by_param;
  gather_units(
      root,
      shard_slice,
      [&](const Unit& u, const at::Tensor& full) {
        const FlatParamHandle& h = u.handle();
        for (size_t i = 0; i < h.layout().entries().size(); ++i) {
          // Under TP every rank that received the unit puts its parameters together (collective).
          const at::Tensor whole = whole_of(h, i, view_of_param(full, h.layout().entries()[i]));
          if (keep) {
            out.emplace_back(h.layout().entries()[i].fqn, split_placement(h, i) ? whole : whole.clone());
            by_param.emplace(h.params()[i].unsafeGetTensorImpl(), out.back().second);
          }
        }
      },
      rank0_only ? GatherTo::TO_RANK0 : GatherTo::TO_ALL);
  append_whole_ignored(root, out, keep, rank0_only ? GatherTo::TO_RANK0 : GatherTo::TO_ALL);
  if (keep) {
    // A tensor registered under several names (a tied weight, a module registered twice) is in
    // the state dict under each of them, the same tensor, as the module's own named_parameters()
    // lists it: a plain model loads it by any of its names.
    std::unordered_set<std::string> named;
    for (const auto& [name, t] : out) named.insert(name);
    for (const auto& p : root.module().named_parameters(true)) {
      auto it = by_param.find(p.value().unsafeGetTensorImpl());
      if (it != by_param.end() && !named.count(p.key())) out.emplace_back(p.key(), it->second);
    }

    for (const auto& b : root.module().named_buffers(true)) {
      if (b.value().defined()) out.emplace_back(b.key(), b.value().detach().clone());
    }
  }
  return out;
}

std::vector<std::pair<std::string, ShardedTensor>> sharded_state_dict(FullyShardedDataParallelBase& model) {
  detail::ShardedRoot& root = detail::RootAccess::of(model);
  root.check_checkpointable("sharded_state_dict");
  if (const TensorParallel* tp = tensor_parallel_of(root)) {
    throw std::invalid_argument("fsdp: sharded_state_dict of a model split for tensor parallelism (" +
                                std::to_string(tp->size()) + " ranks): a rank's piece of a split parameter is not one "
                                "range of the whole tensor; use full_state_dict");
  }
  std::vector<std::pair<std::string, ShardedTensor>> out;
  for (const StatePiece& p : collect_rank_state(root, nullptr).pieces) {
    out.emplace_back(p.key, ShardedTensor{p.shape, p.flat_begin, p.local});
  }
  return out;
}

}  // namespace fsdp
