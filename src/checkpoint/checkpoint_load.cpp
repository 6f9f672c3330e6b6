// Loading a checkpoint (fsdp::load_checkpoint): every rank stages everything it will change -- the
// weights, the optimizer state, the scaler, the generators, the training state -- from an fsdp
// checkpoint or a PyTorch one (torch.distributed.checkpoint); the ranks agree; only then does any
// rank apply it. A load that fails anywhere changes nothing anywhere.
#include "fsdp/checkpoint.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <set>

#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/dcp_reader.h"
#include "checkpoint/file_system.h"
#include "checkpoint/generator_state.h"
#include "checkpoint/manifest.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/rank_agreement.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/tensor_parallel_state.h"
#include "wrap/sharded_root.h"

namespace fsdp {
namespace {

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

}  // namespace

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

}  // namespace fsdp
