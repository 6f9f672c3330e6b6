// A reduce-scatter that moves what a reduce-scatter should on Gloo (issue 26).
//
// ProcessGroupGloo's reduce-scatter all-reduces a copy of its whole input and keeps one chunk: each
// rank sends 2(n-1)/n·M, twice the (n-1)/n·M of a ring reduce-scatter (and of NCCL's), and a third
// of full sharding's bytes on the wire came from that. This is the ring, over Gloo's send/recv:
//
//   n-1 steps; at step s rank r sends to r+1 the running sum of chunk (r-1-s) mod n and receives
//   from r-1 the running sum of chunk (r-2-s) mod n, to which it adds its own; after the last step
//   it holds the whole sum of chunk r. One message of M/n bytes per rank and step.
//
// Summation order: chunk k is summed along the ring starting after its owner,
// ((g[k+1] + g[k+2]) + ...) + g[k] (indices mod n), the same every run and on every rank, but not
// the order Gloo's ring all-reduce used (its chunks start elsewhere) and not rank order: sums can
// differ from the all-reduce's in the last bit (docs/performance.md, "Less on the wire").
//
// The steps need a thread that waits for each receive and adds before sending on: one thread per
// executor, one executor per group (the mesh owns them, next to the groups), running the group's
// reduce-scatters one after another in the order they were issued. Every rank issues a group's
// reduce-scatters in the same order (the runtime's sequence check), so the k-th job of every rank
// meets the k-th of its neighbours; each job's messages carry a tag of its own. A failure (a peer
// gone, a timeout) fails that job's Work and every later one at once.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <ATen/ATen.h>

#include "comm/collectives.h"

namespace fsdp {

class RingReduceScatter {
 public:
  explicit RingReduceScatter(GroupPtr group);
  ~RingReduceScatter();  // aborts a job blocked on a peer, then joins
  RingReduceScatter(const RingReduceScatter&) = delete;
  RingReduceScatter& operator=(const RingReduceScatter&) = delete;

  // out (n elements) <- this rank's chunk of the sum over the group of `in` (G·n elements). `out`
  // may be this rank's slot of `in` (in place). Both must stay alive until the work is waited for.
  WorkPtr enqueue(at::Tensor out, at::Tensor in);

  // Whether `group` is a backend this ring can run on (Gloo: CPU tensors, send/recv).
  static bool supports(const GroupPtr& group);

 private:
  struct Job;
  void run();
  void execute(Job& job);

  GroupPtr group_;
  uint32_t jobs_issued_ = 0;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
  std::exception_ptr failed_;                    // the first failure: later jobs fail with it
  std::vector<WorkPtr> blocking_;                // the send/recv the thread waits on (abort at stop)
  std::thread thread_;
};

}  // namespace fsdp
