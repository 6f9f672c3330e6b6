// What fsdp counts, per rank and per step (issue: instrumentation). Read it with
// FullyShardedDataParallel::metrics(); a step is what lies between two reset_step() calls.
#pragma once

#include <cstdint>

namespace fsdp {

// Bytes a collective moves per rank in the bandwidth-optimal ring convention, where S is the
// unsharded buffer's bytes and G the group's size: all-gather and reduce-scatter (G-1)/G·S,
// all-reduce 2(G-1)/G·S. These are the paper's analytic volumes, not what a backend's particular
// algorithm puts on the wire (Gloo, for one, emulates reduce-scatter with an all-reduce).
struct CommBytes {
  int64_t all_gather = 0;
  int64_t reduce_scatter = 0;
  int64_t all_reduce = 0;
  int64_t all_gather_calls = 0;
  int64_t reduce_scatter_calls = 0;
  int64_t all_reduce_calls = 0;
  // The end-of-backward check that every rank issued the same collectives (16 bytes per backward),
  // counted apart from the strategy's own traffic.
  int64_t sequence_check = 0;
  int64_t sequence_check_calls = 0;
  int64_t total() const { return all_gather + reduce_scatter + all_reduce + sequence_check; }
};

struct MemoryBytes {
  int64_t sharded_params = 0;          // this rank's FlatParameter shards (always resident)
  int64_t sharded_grads = 0;           // this rank's sharded gradients, now
  int64_t unsharded_current = 0;       // unsharded FlatParameter buffers allocated now
  int64_t unsharded_peak = 0;          // their peak since the last reset_step()
  int64_t unsharded_grads_current = 0; // unsharded gradients held now (no_sync accumulation)
  int64_t unsharded_grads_peak = 0;
  // Unsharded gradients that reduce-scatters in flight still read (each freed as soon as its
  // reduce-scatter is done), now and at their peak since the last reset_step(); and, at the end of
  // the last backward (before its final wait), those bytes and how many reductions held them.
  int64_t reducing_grads_current = 0;
  int64_t reducing_grads_peak = 0;
  int64_t reducing_grads_at_backward_end = 0;
  int64_t reductions_in_flight_at_backward_end = 0;
};

// How well communication hid behind computation, since the last reset_step().
struct OverlapStats {
  // Wall time the compute thread was blocked waiting for a collective: the exposed communication.
  // On CUDA the waits are stream-ordered and do not block the CPU, so this counts only the rate
  // limiter; use the trace (or nsys) for device-side exposure there.
  int64_t exposed_all_gather_ns = 0;     // waiting for parameters to arrive
  int64_t exposed_reduce_ns = 0;         // waiting for gradient reductions (mostly at backward's end)
  int64_t rate_limiter_wait_ns = 0;      // blocked by the rate limiter
  int64_t max_all_gathers_in_flight = 0; // the most all-gathers issued and not yet consumed at once
  int64_t sequence_check_ns = 0;         // the end-of-backward check that all ranks issued the same collectives
  int64_t exposed_ns() const { return exposed_all_gather_ns + exposed_reduce_ns + rate_limiter_wait_ns; }  // not the check
};

// The CUDA caching allocator's statistics for the root's device (zeros on CPU), since the last
// reset_step(): the figures that show whether the rate limiter keeps the allocator sane (§3.4).
struct DeviceMemoryStats {
  int64_t allocated_peak = 0;
  int64_t active_peak = 0;
  int64_t reserved_peak = 0;
  int64_t num_alloc_retries = 0;  // cudaMalloc retries after flushing the cache: a bad sign
};

// What knowing when units run cost this step (Options::unit_detection): operator calls that entered
// fsdp. With DISPATCH_KEY only operators that touch a parameter (or a view of one) enter; with
// RECORD_FUNCTION every operator of the root's forward and backward does.
struct DetectionStats {
  int64_t operator_calls_in_passes = 0;  // in the root's forward and backward
  int64_t operator_calls_at_rest = 0;    // outside them (the optimizer's updates, reads of parameters)
};

// What quantized all-gathers (Options::quantize_all_gather) cost in accuracy since the last
// reset_step(), measured on this rank's shards as they were quantized: the largest
// |dequantized - master| of any element, and the largest |master| of the units it was measured on
// (their ratio is the worst error relative to the weights).
struct QuantizationStats {
  int64_t quantized_gathers = 0;
  double max_abs_error = 0.0;
  double max_abs_weight = 0.0;
};

// The phases of a training step (issue 38), Metrics::phases. fsdp marks FORWARD (the root's forward), BACKWARD (from
// backward reaching the root's graph to the end of its reductions, which wait for the end of the
// whole backward pass: a wrapped model whose output feeds another's counts that one's backward too)
// and CLIP (clip_grad_norm_)
// itself; the loop marks OPTIMIZER, and may mark BACKWARD around loss.backward() to include what runs
// before the root's graph (FullyShardedDataParallelBase::record_phase). Phases do not nest: one
// opened inside another is not counted separately.
enum class StepPhase { FORWARD, BACKWARD, CLIP, OPTIMIZER };
inline constexpr int kNumStepPhases = 4;
const char* to_string(StepPhase phase);

// One phase's wall time since the last reset_step(), and the exposed communication inside it (the
// parts of OverlapStats that fell in it): the compute thread blocked on all-gathers, on reductions,
// and by the rate limiter.
struct PhaseTime {
  int64_t wall_ns = 0;
  int64_t exposed_all_gather_ns = 0;
  int64_t exposed_reduce_ns = 0;
  int64_t rate_limiter_wait_ns = 0;
  int64_t count = 0;  // how many times it ran (micro-batches: several forwards and backwards)
  int64_t exposed_ns() const { return exposed_all_gather_ns + exposed_reduce_ns + rate_limiter_wait_ns; }
};

struct StepPhases {
  PhaseTime phase[kNumStepPhases];
  PhaseTime& operator[](StepPhase p) { return phase[static_cast<int>(p)]; }
  const PhaseTime& operator[](StepPhase p) const { return phase[static_cast<int>(p)]; }
  int64_t wall_ns() const {
    int64_t sum = 0;
    for (const auto& p : phase) sum += p.wall_ns;
    return sum;
  }
};

struct Metrics {
  int64_t step = 0;  // number of reset_step() calls so far
  CommBytes comm;    // since the last reset_step()
  MemoryBytes memory;
  OverlapStats overlap;
  DetectionStats detection;
  DeviceMemoryStats device;
  QuantizationStats quantization;
  StepPhases phases;
};

}  // namespace fsdp
