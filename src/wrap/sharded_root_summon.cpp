// summon_full_params scopes (sharded_root.h): the whole parameters gathered on every unit (and
// under TP, the split ones whole), and at the scope's end the writeback compared across the ranks,
// discarded everywhere when it differs and refused by the next call (throw_pending_refusal).
#include "wrap/sharded_root.h"

#include <stdexcept>
#include <string>

namespace fsdp::detail {

void ShardedRoot::summon(bool rank0_only, bool writeback) {
  runtime_->check_not_failed();
  throw_pending_refusal();
  TORCH_CHECK(!summoned_, "fsdp: summon_full_params is already active for this model; end the first scope first");
  TORCH_CHECK(!(rank0_only && writeback), "fsdp: summon_full_params(rank0_only, writeback) cannot write back: only "
                                          "rank 0 holds the whole parameters. Pass writeback = false.");
  TORCH_CHECK(runtime_->at_rest(), "fsdp: summon_full_params must be called outside forward and backward, not "
                                   "between a forward and its backward");
  TORCH_CHECK(!runtime_->any_pinned(), "fsdp: summon_full_params inside an unshard() scope: the scope holds units "
                                       "gathered for forward and backward. End the unshard() scope first (let the "
                                       "object unshard() returned go out of scope), then summon.");
  const bool keep = !rank0_only || mesh_->rank() == 0;
  for (auto& u : units_) u->handle().summon(keep);
  if (options_.tensor_parallel && options_.tensor_parallel->size() > 1) {
    // Whole tensors, not this TP rank's parts (wrap/tensor_parallel_summon.h).
    try {
      tp_summon_.begin(*module_, keep);
    } catch (...) {
      for (auto& u : units_) u->handle().end_summon(false);
      throw;
    }
  }
  summoned_ = true;
  summon_writes_ = writeback;
  runtime_->set_summoned(true);
}

void ShardedRoot::end_summon(bool writeback) noexcept {
  // Each rank writes back only its own shard of what it holds: a change made on some ranks only
  // would land half-applied (F = W: the elements the changing ranks own) or on some replicas only
  // (F < W), and training would go on from parameters no single process has. Compared first.
  const bool asked = writeback && summon_writes_;
  writeback = asked;
  const bool split = tp_summon_.active();
  if (asked && split) {
    // Under TP each rank holds every parameter whole: compared across the TP ranks too (a change
    // made on some TP ranks only would leave the replicated copies and the parts apart).
    try {
      const std::string name = tp_summon_.differing(*module_);
      if (!name.empty()) {
        writeback = false;
        pending_refusal_ =
            "fsdp: summon_full_params: the whole parameters written back when the scope ended differ across the "
            "tensor-parallel ranks (parameter '" + name + "', and maybe more): a change made on some TP ranks only "
            "would have left the replicated copies and the split parts apart. The changes were discarded on every "
            "rank: the model is as it was before the scope. Make the same change on every rank.";
      }
    } catch (const std::exception& e) {
      writeback = false;
      pending_refusal_ = std::string("fsdp: summon_full_params: the check that every TP rank wrote back the same "
                                     "values failed, so nothing was written back: ") + e.what();
    }
  }
  tp_summon_.end(writeback);
  if (writeback && mesh_->world_size() > 1) writeback = summoned_values_agree();
  if (asked && split) {
    // The data-parallel check ran per TP place: every rank keeps or discards together.
    try {
      if (tp_summon_.verdicts_differ(writeback)) {
        writeback = false;
        if (pending_refusal_.empty()) {
          pending_refusal_ = "fsdp: summon_full_params: the whole parameters written back differ across the ranks of "
                             "another tensor-parallel place's data-parallel group; the changes were discarded on every "
                             "rank. Make the same change on every rank.";
        }
      }
    } catch (const std::exception& e) {
      writeback = false;
      pending_refusal_ = std::string("fsdp: summon_full_params: the writeback check failed: ") + e.what();
    }
  }
  for (auto& u : units_) u->handle().end_summon(writeback);
  summoned_ = false;
  summon_writes_ = false;
  runtime_->set_summoned(false);
}

bool ShardedRoot::summoned_values_agree() {
  try {
    std::vector<int64_t> sums;
    for (const auto& u : units_) {
      for (int64_t h : u->handle().summoned_checksums()) sums.push_back(h & ((1LL << 62) - 1));
    }
    if (sums.empty()) return true;
    // max(h) and max(-h) per parameter in one all-reduce: equal on every rank exactly when they cancel.
    const int64_t n = static_cast<int64_t>(sums.size());
    at::Tensor t = at::empty({2 * n}, at::kLong);
    for (int64_t i = 0; i < n; ++i) {
      t[i] = sums[static_cast<size_t>(i)];
      t[n + i] = -sums[static_cast<size_t>(i)];
    }
    InFlight f = comm_->issue(CommKind::SEQUENCE_CHECK, Over::WORLD, -1, "the summon_full_params writeback check",
                              [&] { return Buffers{t, at::Tensor()}; });
    comm_->wait(f);
    const auto* v = t.data_ptr<int64_t>();
    int64_t i = 0;
    while (i < n && v[i] + v[n + i] == 0) ++i;
    if (i == n) return true;
    std::string fqn, unit;
    for (const auto& u : units_) {
      const auto& entries = u->handle().layout().entries();
      if (i < static_cast<int64_t>(entries.size())) {
        fqn = entries[static_cast<size_t>(i)].fqn;
        unit = u->name();
        break;
      }
      i -= static_cast<int64_t>(entries.size());
    }
    pending_refusal_ =
        "fsdp: summon_full_params: the whole parameters written back when the scope ended differ across ranks "
        "(parameter '" + fqn + "' of unit '" + unit + "', and maybe more): each rank would have kept its own "
        "change in its own shard, and training would have gone on from parameters no single process holds. The "
        "changes were discarded on every rank: the model is as it was before the scope. Make the same change on "
        "every rank (compute or load the values on every rank, or broadcast rank 0's first), or use "
        "summon_full_params({.writeback = false}) to change nothing.";
  } catch (const std::exception& e) {
    pending_refusal_ = std::string("fsdp: summon_full_params: the check that every rank wrote back the same values "
                                   "failed, so nothing was written back: ") + e.what();
  }
  return false;
}

void ShardedRoot::throw_pending_refusal() {
  if (pending_refusal_.empty()) return;
  const std::string what = std::move(pending_refusal_);
  pending_refusal_.clear();
  throw Refusal(what);
}

}  // namespace fsdp::detail
