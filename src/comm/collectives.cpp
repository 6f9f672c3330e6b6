#include "comm/collectives.h"

#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>

#include <ATen/core/ivalue.h>

#include "comm/ring_reduce_scatter.h"

namespace fsdp {
namespace {
int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }
}  // namespace

WorkPtr all_gather_into(const GroupPtr& group, at::Tensor out, at::Tensor in, CommBytes& stats) {
  const int64_t g = group->getSize();
  TORCH_CHECK(out.numel() == g * in.numel(), "all_gather_into: output must hold group_size x input");
  stats.all_gather += bytes_of(out) * (g - 1) / g;
  stats.all_gather_calls += 1;
  return group->_allgather_base(out, in);
}

WorkPtr reduce_scatter_sum(const GroupPtr& group, at::Tensor out, at::Tensor in, CommBytes& stats,
                           RingReduceScatter* ring) {
  const int64_t g = group->getSize();
  TORCH_CHECK(in.numel() == g * out.numel(), "reduce_scatter_sum: input must hold group_size x output");
  stats.reduce_scatter += bytes_of(in) * (g - 1) / g;
  stats.reduce_scatter_calls += 1;
  if (ring && in.is_cpu()) return ring->enqueue(std::move(out), std::move(in));
  // Gloo's own (Options::gloo_reduce_scatter = ALL_REDUCE), or NCCL's. In place (`out` is this
  // rank's slot of `in`, as NCCL defines an in-place reduce-scatter) on a CPU group: Gloo's
  // reduce-scatter all-reduces a flattened copy of its whole input (measured on the wire, issue
  // 12), so all-reducing the caller's buffer itself moves the same bytes, gives the same sums, and
  // saves the copy: one unit's unsharded gradients per reduction in flight, not two.
  const bool in_place = out.is_cpu() && in.is_contiguous() && out.is_contiguous() &&
                        out.data_ptr() == static_cast<char*>(in.data_ptr()) + group->getRank() * bytes_of(out);
  if (in_place) {
    std::vector<at::Tensor> tensors{std::move(in)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    return group->allreduce(tensors, opts);
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  return group->_reduce_scatter_base(out, in, opts);
}

WorkPtr all_reduce_sum(const GroupPtr& group, at::Tensor t, CommBytes& stats) {
  const int64_t g = group->getSize();
  stats.all_reduce += 2 * bytes_of(t) * (g - 1) / g;
  stats.all_reduce_calls += 1;
  std::vector<at::Tensor> tensors{std::move(t)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  return group->allreduce(tensors, opts);
}

WorkPtr sequence_check_max(const GroupPtr& group, at::Tensor t, CommBytes& stats) {
  const int64_t g = group->getSize();
  stats.sequence_check += 2 * bytes_of(t) * (g - 1) / g;
  stats.sequence_check_calls += 1;
  std::vector<at::Tensor> tensors{std::move(t)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  return group->allreduce(tensors, opts);
}

WorkPtr all_reduce_max(const GroupPtr& group, at::Tensor t, CommBytes& stats) {
  const int64_t g = group->getSize();
  stats.all_reduce += 2 * bytes_of(t) * (g - 1) / g;
  stats.all_reduce_calls += 1;
  std::vector<at::Tensor> tensors{std::move(t)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  return group->allreduce(tensors, opts);
}

namespace {
// Waits for `work` `slow.every` at a time, asking `slow.check` between waits. Returns "" once the
// work has completed (its wait() then returns at once), or the reason check gave for it never to.
std::string wait_in_slices(const WorkPtr& work, const SlowWaitCheck& slow) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = work->getFuture();
  } catch (const std::exception&) {
    return "";  // a Work without a future: wait on it whole
  }
  if (!future) return "";
  struct Done {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  // Runs on the backend's thread when the work completes or fails, or here and now if it has.
  future->addCallback([done](c10::ivalue::Future&) {
    {
      std::lock_guard<std::mutex> lock(done->mutex);
      done->done = true;
    }
    done->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(done->mutex);
  while (!done->cv.wait_for(lock, slow.every, [&] { return done->done; })) {
    lock.unlock();
    std::string why = slow.check();
    if (!why.empty()) return why;
    lock.lock();
  }
  return "";
}
}  // namespace

void wait_for(const WorkPtr& work, const char* what, const SlowWaitCheck& slow) {
  if (slow.every.count() > 0 && slow.check && !work->isCompleted()) {
    const std::string why = wait_in_slices(work, slow);
    if (!why.empty()) throw std::runtime_error(why);
  }
  try {
    work->wait();
  } catch (const std::exception& e) {
    // A peer that found the ranks' collectives differ has left: say why, not just that it left.
    const std::string why = slow.check ? slow.check() : "";
    if (!why.empty()) throw std::runtime_error(why + " (Here: " + what + " failed: " + e.what() + ")");
    throw std::runtime_error(std::string("fsdp: ") + what +
                             " failed; a peer rank probably exited or timed out (see its log). "
                             "Backend said: " + e.what());
  }
}

}  // namespace fsdp
