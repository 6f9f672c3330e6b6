#include "comm/comm_context.h"

#include "fsdp/options.h"
#include "comm/mesh_state.h"

namespace fsdp {
namespace {
SpanKind span_kind(CommKind kind) {
  switch (kind) {
    case CommKind::ALL_GATHER: return SpanKind::ALL_GATHER;
    case CommKind::REDUCE_SCATTER: return SpanKind::REDUCE_SCATTER;
    case CommKind::ALL_REDUCE: return SpanKind::ALL_REDUCE;
    case CommKind::SEQUENCE_CHECK: return SpanKind::SEQUENCE_CHECK;
    case CommKind::WRITE_MERGE: return SpanKind::ALL_REDUCE;
  }
  return SpanKind::ALL_REDUCE;
}

uint64_t mix(uint64_t h, int64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xff;
    h *= 1099511628211ULL;
  }
  return h;
}
}  // namespace

CommContext::CommContext(c10::Device device, MeshInfo mesh)
    : device_(device), mesh_(std::move(mesh)), streams_(device) {
  // Gloo runs up to this many collectives of one group at once (mesh_state.h); NCCL one per stream.
  timeline_.set_workers_per_group(streams_.active() ? 1 : kGlooThreadsPerGroup);
}

void CommContext::set_param_quantization(AllGatherQuantization mode, int block) {
  quantization_blocks({}, 0, block);  // validates the block
  quantization_ = mode;
  quantization_block_ = block;
}

std::string CommContext::unit_name(int unit) const {
  if (unit < 0 || unit >= static_cast<int>(unit_names_.size())) return "";
  return unit_names_[static_cast<size_t>(unit)].empty() ? "<root>" : unit_names_[static_cast<size_t>(unit)];
}

InFlight CommContext::issue(CommKind kind, Over over, int unit, const char* what,
                            const std::function<Buffers()>& prepare, const InFlight* after, int secondary) {
  const GroupPtr& group = over == Over::SHARD_GROUP ? mesh_.shard_group
                          : over == Over::REPLICAS  ? mesh_.replicate_group
                          : over == Over::SECONDARY ? mesh_.secondary_groups.at(secondary)
                                                    : mesh_.world_group;
  // The world group takes CPU tensors (Gloo) whatever the device: no stream there.
  std::optional<CommStreams::Issue> on_stream;
  if (over != Over::WORLD) on_stream.emplace(streams_, kind);
  // CUDA: ordered after `after` on the device (Work::wait makes the current stream wait; the CPU
  // does not block). On CPU the caller only issues once `after` is done.
  if (after && after->work && streams_.active()) after->work->wait();
  const Buffers b = prepare();
  InFlight f;
  f.kind = kind;
  f.unit = unit;
  f.what = what;
  f.backward_pass = backward_pass_;
  const int64_t before = bytes_.total();
  switch (kind) {
    case CommKind::ALL_GATHER: f.work = all_gather_into(group, b.out, b.in, bytes_); break;
    case CommKind::REDUCE_SCATTER:
      f.work = reduce_scatter_sum(group, b.out, b.in, bytes_, over == Over::SHARD_GROUP ? mesh_.shard_ring.get() : nullptr);
      break;
    case CommKind::ALL_REDUCE: f.work = all_reduce_sum(group, b.out, bytes_); break;
    case CommKind::SEQUENCE_CHECK: f.work = sequence_check_max(group, b.out, bytes_); break;
    case CommKind::WRITE_MERGE: f.work = all_reduce_max(group, b.out, bytes_); break;
  }
  f.log = mesh_.log_of(group);
  // Its number on the group and the model's, in the hash too: two wrapped models of one
  // architecture whose forwards run in another order on one rank issue the same collectives, each
  // model in its own order, but Gloo pairs one model's with the other's (and the sequence checks
  // of the two models pair up the same way: the model's number is what tells them apart).
  const int64_t on_group = f.log ? f.log->record(describe(f, b.out.numel(), b.out.scalar_type())) : -1;
  if (kind != CommKind::SEQUENCE_CHECK) {
    for (int64_t v : {static_cast<int64_t>(kind), static_cast<int64_t>(over), static_cast<int64_t>(unit), b.out.numel(),
                      static_cast<int64_t>(b.out.scalar_type()), on_group, static_cast<int64_t>(mesh_.model)}) {
      sequence_hash_[static_cast<size_t>(over)] = mix(sequence_hash_[static_cast<size_t>(over)], v);
    }
  }
  Span s;
  s.kind = span_kind(kind);
  s.unit = unit;
  s.backward_pass = backward_pass_;
  s.bytes = bytes_.total() - before;
  s.dtype = dtype_name(b.out.scalar_type());
  // Gloo completes a work's future when the data is there; a CUDA future completes on enqueue, so
  // on CUDA the wait stamps the end instead.
  f.span = timeline_.collective(s, group.get(), f.work, /*stamp_completion=*/!streams_.active());
  f.event = streams_.record_current();
  return f;
}

std::string CommContext::describe(const InFlight& f, int64_t numel, c10::ScalarType dtype) const {
  const std::string kind = f.kind == CommKind::ALL_GATHER       ? "all-gather"
                           : f.kind == CommKind::REDUCE_SCATTER ? "reduce-scatter"
                                                                : "all-reduce";
  std::string out = kind + " of ";
  if (f.unit >= 0) out += "unit '" + unit_name(f.unit) + "''s ";
  out += f.what;
  if (numel >= 0) {
    // A unit's collectives run in forward or backward; the others (the gradient norm, the sequence
    // check) between them, where "forward" would mislead.
    const std::string pass = f.unit < 0 ? "" : f.backward_pass ? "backward, " : "forward, ";
    const std::string model = mesh_.model == 0 ? "" : "wrapped model #" + std::to_string(mesh_.model + 1) + ", ";
    out += " (" + model + pass + std::to_string(numel) + " " + dtype_name(dtype) + ")";
  }
  return out;
}

std::string CommContext::describe(const InFlight& f) const {
  return describe(f, -1, c10::ScalarType::Undefined) + " on rank " + std::to_string(mesh_.rank);
}

uint64_t CommContext::take_sequence_hash() {
  uint64_t h = kHashSeed;
  for (uint64_t& g : sequence_hash_) {
    h = mix(h, static_cast<int64_t>(g));
    g = kHashSeed;
  }
  return h;
}

int64_t CommContext::wait(InFlight& f) {
  if (!f.work) return 0;
  // On CUDA wait() only orders the current stream after the collective: nothing blocks.
  const bool blocks = !streams_.active() && !f.work->isCompleted();
  const int64_t t0 = Timeline::now_ns();
  const WorkPtr work = std::move(f.work);
  // A long wait on CPU, or a failed one: ask the group's ranks what they issued (collective_log.h).
  wait_for(work, describe(f).c_str(), compare_when_slow(f.log, blocks));
  timeline_.completed(f.span);
  if (!blocks) return 0;
  const int64_t t1 = Timeline::now_ns();
  timeline_.add(SpanKind::WAIT, f.unit, f.backward_pass, t0, t1, span_kind(f.kind));
  return t1 - t0;
}

bool CommContext::done(const InFlight& f) const {
  if (!f.work) return true;
  if (f.event) return f.event->query();
  return f.work->isCompleted();
}

}  // namespace fsdp
