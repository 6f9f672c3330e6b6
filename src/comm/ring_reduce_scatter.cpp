#include "comm/ring_reduce_scatter.h"

#include <stdexcept>
#include <string>

#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace fsdp {
namespace {

// The Work of one ring job: done when the executor's thread says so. Its future carries the
// output, as Gloo's collectives' do (the timeline stamps completion through it).
class RingWork : public c10d::Work {
 public:
  explicit RingWork(at::Tensor out)
      : out_(std::move(out)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}
  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  bool wait(std::chrono::milliseconds /*timeout: the executor's send/recv time out*/) override {
    future_->wait();
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    return true;
  }
  std::vector<at::Tensor> result() override { return {out_}; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

  void finish() { future_->markCompleted(c10::IValue(std::vector<at::Tensor>{out_})); }
  void fail(std::exception_ptr e) { future_->setError(std::move(e)); }

 private:
  at::Tensor out_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A tag per job, in a range of its own (the checkpoint's point-to-point gathers tag by unit index
// on the same group), wrapping at 2^30 (harmless: a job's messages are all consumed long before
// the 2^30-th next job on the group starts).
constexpr uint32_t kTagBase = 1u << 30, kTagMask = kTagBase - 1;
}  // namespace

struct RingReduceScatter::Job {
  at::Tensor out, in;
  int tag = 0;
  c10::intrusive_ptr<RingWork> work;
};

bool RingReduceScatter::supports(const GroupPtr& group) {
  return dynamic_cast<c10d::ProcessGroupGloo*>(group.get()) != nullptr;
}

RingReduceScatter::RingReduceScatter(GroupPtr group) : group_(std::move(group)), thread_([this] { run(); }) {}

RingReduceScatter::~RingReduceScatter() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    // A job still waiting on a peer (the job is being torn down after a failure elsewhere): let go.
    for (auto& w : blocking_) w->abort();
  }
  wake_.notify_all();
  thread_.join();
}

WorkPtr RingReduceScatter::enqueue(at::Tensor out, at::Tensor in) {
  const int64_t n = group_->getSize();
  TORCH_CHECK(in.numel() == n * out.numel(), "ring reduce-scatter: input must hold group_size x output");
  TORCH_CHECK(in.is_contiguous() && out.is_contiguous() && in.is_cpu(), "ring reduce-scatter: contiguous CPU tensors");
  auto job = std::make_shared<Job>();
  job->out = std::move(out);
  job->in = std::move(in);
  job->tag = static_cast<int>(kTagBase | (jobs_issued_++ & kTagMask));
  job->work = c10::make_intrusive<RingWork>(job->out);
  WorkPtr work = job->work;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(job));
  }
  wake_.notify_one();
  return work;
}

void RingReduceScatter::run() {
  while (true) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      if (stopping_ && !failed_) {
        failed_ = std::make_exception_ptr(std::runtime_error("ring reduce-scatter: the executor was stopped"));
      }
    }
    if (failed_) {
      job->work->fail(failed_);
      continue;
    }
    try {
      execute(*job);
      job->work->finish();
    } catch (...) {
      failed_ = std::current_exception();
      job->work->fail(failed_);
    }
  }
}

void RingReduceScatter::execute(Job& job) {
  at::NoGradGuard no_grad;
  const int n = static_cast<int>(group_->getSize());
  const int r = static_cast<int>(group_->getRank());
  const int64_t c = job.out.numel();
  auto chunk = [&](int k) { return job.in.narrow(0, static_cast<int64_t>(((k % n) + n) % n) * c, c); };
  if (n == 1 || c == 0) {
    if (!job.out.is_same(job.in)) job.out.copy_(job.in);
    return;
  }
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  // Two buffers for the running sums this rank sends (one may still be on the wire while the next
  // is summed into the other) and one for what it receives.
  at::Tensor sums[2] = {at::empty({c}, job.in.options()), at::empty({c}, job.in.options())};
  at::Tensor received = at::empty({c}, job.in.options());
  at::Tensor to_send = chunk(r - 1);  // step 0: this rank's own part of chunk r-1
  auto track = [&](std::vector<WorkPtr> works) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw std::runtime_error("ring reduce-scatter: the executor was stopped");
    blocking_ = std::move(works);
  };
  auto wait = [&](const WorkPtr& w, const char* what, int peer, int step) {
    bool ok = false;
    try {
      ok = w->wait();
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("ring reduce-scatter ") + what + " rank " + std::to_string(peer) +
                               " (step " + std::to_string(step + 1) + " of " + std::to_string(n - 1) +
                               ") failed: " + e.what());
    }
    if (!ok) throw std::runtime_error(std::string("ring reduce-scatter ") + what + " rank " + std::to_string(peer) + " was aborted");
  };
  for (int s = 0; s + 1 < n; ++s) {
    std::vector<at::Tensor> send_v{to_send}, recv_v{received};
    WorkPtr sent = group_->send(send_v, next, job.tag);
    WorkPtr got = group_->recv(recv_v, prev, job.tag);
    track({sent, got});
    wait(got, "receiving from", prev, s);
    // What arrived is the sum of chunk (r-2-s) over the ranks before this one on the ring; add
    // this rank's part. The last step's chunk is r: the result, straight into `out` (which may be
    // chunk r itself: an element-wise add in place is safe).
    at::Tensor dst = s + 2 == n ? job.out : sums[s % 2];
    at::add_out(dst, received, chunk(r - 2 - s));
    wait(sent, "sending to", next, s);
    to_send = dst;
  }
  track({});
}

}  // namespace fsdp
