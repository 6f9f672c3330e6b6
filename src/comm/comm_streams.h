// Where collectives are issued from on a device with streams (paper §3.4). On CUDA each kind of
// collective gets its own stream, so an all-gather for the next unit never queues behind the
// computation of this one, and the compute stream never queues behind communication:
//
//   compute ──event──▶ all-gather stream      (the shard is current; freed buffers are done with)
//   compute ──event──▶ reduce-scatter stream  (the gradients are computed)
//   reduce-scatter ──work.wait──▶ all-reduce stream  (hybrid: the shard sum is there)
//   collective ──work.wait──▶ compute         (where the result is consumed)
//
// Buffers are kept alive by the runtime holding them until the consuming wait, and by the
// ordering above, instead of recordStream: a block the caching allocator hands out again on the
// all-gather stream is only written after that stream has waited for everything the compute
// stream had enqueued, which includes every read of the block's previous tenant.
//
// On CPU there are no streams: Gloo runs collectives on its own threads, which overlap with the
// compute thread the same way, and every method here is a no-op.
#pragma once

#include <optional>

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

namespace fsdp {

// WRITE_MERGE: the element-wise max over every rank that merges what a forward wrote into a
// unit's parameters (Runtime::merge_forward_writes); over the world group, on CPU tensors.
enum class CommKind { ALL_GATHER = 0, REDUCE_SCATTER = 1, ALL_REDUCE = 2, SEQUENCE_CHECK = 3, WRITE_MERGE = 4 };

class CommStreams {
 public:
  explicit CommStreams(c10::Device device);
  bool active() const { return active_; }
  const c10::Device& device() const { return device_; }

  // While alive, `kind`'s stream is current, and it has waited for the compute stream.
  class Issue {
   public:
    Issue(const CommStreams& streams, CommKind kind);
    Issue(const Issue&) = delete;
    Issue& operator=(const Issue&) = delete;
   private:
    std::optional<c10::StreamGuard> guard_;
  };

  // An event on the current stream after everything enqueued on it so far (nullopt on CPU). On
  // the compute stream: once it has completed, buffers freed up to now are no longer read by the
  // device. Inside an Issue scope: the collective just issued has completed.
  std::optional<c10::Event> record_current() const;

 private:
  c10::Device device_;
  bool active_ = false;
  std::optional<c10::Stream> streams_[3];
};

}  // namespace fsdp
