// What stands behind a FullyShardedDataParallel (include/fsdp/fsdp.h): builds the units of one
// wrapped model (decomposition, the cross-rank structure check, the device and process groups,
// materializing deferred models, casting buffers), owns them with their communication context
// and runtime, and answers the public API (metrics, clipping, units, traces).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/nn/module.h>

#include "comm/comm_context.h"
#include "fsdp/fsdp.h"
#include "engine/runtime.h"
#include "engine/unit.h"
#include "engine/unit_decomposition.h"
#include "wrap/row_sharded.h"
#include "wrap/tensor_parallel_summon.h"

namespace fsdp::detail {

class ShardedRoot {
 public:
  ShardedRoot(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<Mesh> mesh, Options options);
  ShardedRoot(const ShardedRoot&) = delete;
  ShardedRoot& operator=(const ShardedRoot&) = delete;

  Runtime& runtime() { return *runtime_; }
  const Options& options() const { return options_; }
  int shard_size() const { return comm_->mesh().shard_size; }

  Metrics metrics() const;
  void reset_step();
  double clip_grad_norm(double max_norm, const std::vector<at::Tensor>& model_parallel);
  void summon(bool rank0_only, bool writeback);
  // Ends the scope (never throws: a destructor's). With writeback, first compares the ranks' whole
  // parameters: changed on some ranks only, they are discarded on every rank and the next call
  // refuses (throw_pending_refusal).
  void end_summon(bool writeback) noexcept;
  // Throws, once, what end_summon refused (every rank alike); the entry points call it first.
  void throw_pending_refusal();
  // Throws when the model holds a parameter it did not hold when wrapped (forward calls it).
  void check_no_new_parameters() const;
  // Tensor parallelism: every forward's inputs compared across the TP groups (fsdp.h).
  bool checks_inputs() const { return checks_inputs_; }
  void check_inputs(const std::vector<at::Tensor>& inputs);
  std::vector<std::pair<std::string, at::Tensor>> unique_named_parameters() const;
  std::vector<UnitInfo> units() const;
  // The indices of the units named by module path ("" the root unit); every unit for none. Throws
  // for a name that is not a unit, listing those that are.
  std::vector<size_t> unit_indices(const std::vector<std::string>& names) const;
  std::vector<Span> timeline() const { return comm_->timeline().spans(); }
  void write_trace(const std::string& path) const;

  // For checkpoints: the units, their communication, the module and the mesh.
  const std::vector<std::unique_ptr<Unit>>& unit_list() const { return units_; }
  CommContext& comm() { return *comm_; }
  torch::nn::Module& module() { return *module_; }
  Mesh& mesh() { return *mesh_; }
  // Throws, naming `what`, unless the model can be saved or loaded now: every unit at rest
  // (outside forward and backward, no summon scope).
  void check_checkpointable(const char* what);
  // Parameters in no unit (Options::ignored_modules / ignored_parameters), and which of them hold
  // their rank's rows of a table (Options::row_sharded_parameters, checked across the ranks).
  const IgnoredSet& ignored() const { return ignored_; }
  const std::vector<RowShardedTable>& row_sharded() const { return row_sharded_; }

 private:
  void check_tensor_parallel();
  // Every TP rank built the same model: its replicated parameters agree across the TP group.
  void check_tensor_parallel_replicas();
  // Throws when a parameter belongs to another wrapper already (the model wrapped twice).
  void check_not_wrapped_already() const;
  void materialize_buffers();
  void materialize_ignored();
  void broadcast_module_states();
  // Whether every rank holds the same whole parameters at the end of a writeback scope; sets
  // pending_refusal_ when not. A collective over the world (one small all-reduce).
  bool summoned_values_agree();

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<Mesh> mesh_;
  Options options_;
  IgnoredSet ignored_;
  std::vector<RowShardedTable> row_sharded_;
  c10::Device device_{c10::kCPU};
  std::unique_ptr<CommContext> comm_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::shared_ptr<Runtime> runtime_;
  bool summoned_ = false;
  bool checks_inputs_ = false;  // set at wrapping with a TP group of more than one rank
  std::unordered_set<const c10::TensorImpl*> wrapped_params_;  // every parameter at wrapping
  bool summon_writes_ = false;        // the summon scope writes back
  TensorParallelSummon tp_summon_;    // under TP: the split parameters whole inside the scope
  std::string pending_refusal_;       // end_summon's, thrown by the next call
  int64_t alloc_retries_at_reset_ = 0;
  int64_t step_ = 0;
};

// The library's access to a wrapped model's root (the public class keeps it private).
struct RootAccess {
  static ShardedRoot& of(FullyShardedDataParallelBase& model) { return *model.root_; }
};

}  // namespace fsdp::detail
