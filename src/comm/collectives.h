// The collectives FSDP uses, as stateless free functions over c10d backends. Each one counts its
// analytic ring volume into the caller's CommBytes and returns the c10d Work, so the caller
// decides where to wait (the runtime waits where the result is consumed).
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "fsdp/metrics.h"

namespace fsdp {

using GroupPtr = c10::intrusive_ptr<c10d::Backend>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// out (G·n elements) <- concatenation of every rank's `in` (n elements), in group-rank order.
WorkPtr all_gather_into(const GroupPtr& group, at::Tensor out, at::Tensor in, CommBytes& stats);
class RingReduceScatter;
// out (n elements) <- this rank's chunk of the sum over ranks of `in` (G·n elements). With `ring`
// (CPU groups, ring_reduce_scatter.h) the ring moves (G-1)/G of the input per rank; without it,
// Gloo's own reduce-scatter moves twice that (an all-reduce of the whole input).
WorkPtr reduce_scatter_sum(const GroupPtr& group, at::Tensor out, at::Tensor in, CommBytes& stats,
                           RingReduceScatter* ring = nullptr);
// t <- sum over ranks of t, in place.
WorkPtr all_reduce_sum(const GroupPtr& group, at::Tensor t, CommBytes& stats);
// t <- element-wise max over ranks of t, in place; counted as the sequence check's bytes.
WorkPtr sequence_check_max(const GroupPtr& group, at::Tensor t, CommBytes& stats);
// t <- element-wise max over ranks of t, in place; counted as an all-reduce.
WorkPtr all_reduce_max(const GroupPtr& group, at::Tensor t, CommBytes& stats);

// What a wait that takes long does: every `every` (0: nothing) it runs `check`, which returns why
// the wait can never end (an error message) or "" when it does not know of a reason.
struct SlowWaitCheck {
  std::chrono::milliseconds every{0};
  std::function<std::string()> check;
};

// Waits and turns a backend failure (a peer that died, a timeout) into an error that names the
// collective, instead of the backend's bare message. With `slow`, a wait that finds a reason to
// never end throws that reason (std::runtime_error) instead of waiting for the timeout, and a
// failure asks `slow.check` too (a peer that found the reason has left).
void wait_for(const WorkPtr& work, const char* what, const SlowWaitCheck& slow = {});

}  // namespace fsdp
