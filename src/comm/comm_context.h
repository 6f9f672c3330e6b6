// The one seam through which every collective of a wrapped model is issued and waited for
// (paper §3.3–3.4), like c10d's ProcessGroupNCCL::collective and FSDP2's FSDPCommContext: it owns
// the communication streams and the timeline, counts the bytes, names the unit in every error.
//
//   InFlight f = comm.issue(CommKind::ALL_GATHER, Over::SHARD_GROUP, unit, "parameters",
//                           [&] { ...; return Buffers{out, in}; });
//   ...                                  // other work overlaps the collective
//   comm.wait(f);                        // where the result is consumed
//
// `prepare` runs with the collective's stream current (CUDA), after that stream has waited for
// the compute stream: buffers allocated there are reused in that stream's order, which is what
// lets us avoid recordStream (comm_streams.h). On CPU there are no streams and Gloo's threads do
// the overlapping.
#pragma once

#include <array>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include "comm/collectives.h"
#include "comm/comm_streams.h"
#include "comm/mesh_info.h"
#include "comm/quantized_all_gather.h"
#include "observe/timeline.h"

namespace fsdp {

// Which group a collective runs over.
enum class Over {
  SHARD_GROUP,
  REPLICAS,
  WORLD,
  SECONDARY,  // hpZ: the N-rank group backward gathers a unit over from its secondary shards
};

// The buffers of one collective: all-gather out <- in; reduce-scatter out <- in; all-reduce in
// place on `out` (in is ignored).
struct Buffers {
  at::Tensor out, in;
};

// A collective in flight. Whoever holds it holds its buffers' users' obligation to wait for it.
struct InFlight {
  WorkPtr work;
  size_t span = 0;                  // its span in the timeline
  std::optional<c10::Event> event;  // CUDA: recorded on its stream after issue (completion query)
  CommKind kind = CommKind::ALL_GATHER;
  int unit = -1;
  const char* what = "";            // the payload, for errors: "parameters", "gradients", ...
  bool backward_pass = false;
  CollectiveLog* log = nullptr;     // its group's (CPU groups): what a long wait compares
  explicit operator bool() const { return work != nullptr; }
};

class CommContext {
 public:
  CommContext(c10::Device device, MeshInfo mesh);

  const MeshInfo& mesh() const { return mesh_; }
  const CommStreams& streams() const { return streams_; }
  Timeline& timeline() { return timeline_; }
  const Timeline& timeline() const { return timeline_; }
  CommBytes& bytes() { return bytes_; }
  const CommBytes& bytes() const { return bytes_; }
  // Unit names for errors and traces (index -> name; "" is the root unit).
  void set_unit_names(std::vector<std::string> names) { unit_names_ = std::move(names); }
  std::string unit_name(int unit) const;
  // How units' parameters travel in their all-gathers for compute (quantized_all_gather.h):
  // NONE, or quantized in blocks of `block` elements. Throws std::invalid_argument for a bad block.
  void set_param_quantization(AllGatherQuantization mode, int block);
  AllGatherQuantization param_quantization() const { return quantization_; }
  QuantizationTally& quantization_tally() { return quantization_tally_; }
  const QuantizationTally& quantization_tally() const { return quantization_tally_; }
  int quantization_block() const { return quantization_block_; }
  // Which pass spans are labeled with (the runtime flips it when backward starts and ends).
  void set_backward_pass(bool on) { backward_pass_ = on; }
  bool backward_pass() const { return backward_pass_; }

  // Issues `kind` over `over` for `unit` (-1: not about one unit), moving `what` (a string
  // literal naming the payload for errors). `after` (CUDA): a collective this one must follow on
  // the device (the all-reduce of a reduce-scatter's output).
  // `secondary`: with Over::SECONDARY, the hpZ group's size N (MeshInfo::secondary_groups).
  InFlight issue(CommKind kind, Over over, int unit, const char* what, const std::function<Buffers()>& prepare,
                 const InFlight* after = nullptr, int secondary = 0);
  // Waits where the result is consumed: on CPU the calling thread blocks; on CUDA the current
  // stream waits on the device and the CPU does not. Records the completion and any blocking
  // wait in the timeline; returns the nanoseconds the calling thread was blocked. A failure
  // becomes an error naming the collective and the unit. Idempotent.
  int64_t wait(InFlight& f);
  // Whether it has finished, without blocking.
  bool done(const InFlight& f) const;

  // A hash of the collectives issued since the last call (kind, group, unit, size, dtype), which
  // must be equal on every rank: a difference means ranks took different paths. One running hash
  // per group: a group's collectives must come in the same order on every rank, but how two
  // groups' interleave depends on timing (on CPU a replica all-reduce is issued when its
  // reduce-scatter is seen done, between two other units' reduce-scatters on one rank and after
  // both on another).
  uint64_t take_sequence_hash();

 private:
  // What the collective is, as every rank of its group says it (no rank number).
  std::string describe(const InFlight& f, int64_t numel, c10::ScalarType dtype) const;
  std::string describe(const InFlight& f) const;

  c10::Device device_;
  MeshInfo mesh_;
  CommStreams streams_;
  Timeline timeline_;
  CommBytes bytes_;
  std::vector<std::string> unit_names_;
  bool backward_pass_ = false;
  AllGatherQuantization quantization_ = AllGatherQuantization::NONE;
  int quantization_block_ = 64;
  QuantizationTally quantization_tally_;
  static constexpr uint64_t kHashSeed = 1469598103934665603ULL;
  std::array<uint64_t, 4> sequence_hash_{kHashSeed, kHashSeed, kHashSeed, kHashSeed};  // by Over
};

}  // namespace fsdp
