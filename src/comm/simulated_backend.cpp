#include "comm/simulated_backend.h"

#include <ATen/core/ivalue.h>

namespace fsdp::detail {
namespace {

// A collective that is over when it is issued; its future carries its outputs, as Gloo's does.
class DoneWork : public c10d::Work {
 public:
  explicit DoneWork(std::vector<at::Tensor> outputs) : outputs_(std::move(outputs)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto f = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    f->markCompleted(c10::IValue(outputs_));
    return f;
  }

 private:
  std::vector<at::Tensor> outputs_;
};

c10::intrusive_ptr<c10d::Work> done(std::vector<at::Tensor> outputs = {}) {
  return c10::make_intrusive<DoneWork>(std::move(outputs));
}

// What a reduction over `size` ranks that all hold `t` gives.
void reduce_equal(at::Tensor& t, c10d::ReduceOp op, int size) {
  if (op == c10d::ReduceOp::SUM) {
    if (t.scalar_type() == at::kBool) return;  // a logical or of equal flags
    t.mul_(size);
  } else if (op == c10d::ReduceOp::PRODUCT) {
    t.pow_(size);
  }
  // AVG, MIN, MAX, BAND, BOR, BXOR (of equal values: the value, or 0 for an even xor, not used)
}

}  // namespace

SimulatedBackend::SimulatedBackend(int rank, int size) : c10d::Backend(rank, size) {}

c10::intrusive_ptr<c10d::Work> SimulatedBackend::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions&) {
  return done(tensors);
}

c10::intrusive_ptr<c10d::Work> SimulatedBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  for (auto& t : tensors) reduce_equal(t, opts.reduceOp, getSize());
  return done(tensors);
}

c10::intrusive_ptr<c10d::Work> SimulatedBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  for (auto& t : tensors) reduce_equal(t, opts.reduceOp, getSize());
  return done(tensors);
}

c10::intrusive_ptr<c10d::Work> SimulatedBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions&) {
  TORCH_CHECK(outputs.size() == inputs.size(), "fsdp simulated all-gather: one output list per input");
  std::vector<at::Tensor> flat;
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (auto& o : outputs[i]) {
      o.copy_(inputs[i]);
      flat.push_back(o);
    }
  }
  return done(flat);
}

c10::intrusive_ptr<c10d::Work> SimulatedBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions&) {
  TORCH_CHECK(output.numel() == input.numel() * getSize(), "fsdp simulated all-gather: output must hold size x input");
  output.view({getSize(), input.numel()}).copy_(input.reshape({1, input.numel()}).expand({getSize(), input.numel()}));
  return done({output});
}

c10::intrusive_ptr<c10d::Work> SimulatedBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(input.numel() == output.numel() * getSize(), "fsdp simulated reduce-scatter: input must hold size x output");
  output.copy_(input.reshape({-1}).narrow(0, getRank() * output.numel(), output.numel()).view_as(output));
  reduce_equal(output, opts.reduceOp, getSize());
  return done({output});
}

c10::intrusive_ptr<c10d::Work> SimulatedBackend::barrier(const c10d::BarrierOptions&) { return done(); }

c10::intrusive_ptr<c10d::Work> SimulatedBackend::send(std::vector<at::Tensor>& tensors, int, int) { return done(tensors); }

c10::intrusive_ptr<c10d::Work> SimulatedBackend::recv(std::vector<at::Tensor>& tensors, int, int) { return done(tensors); }

}  // namespace fsdp::detail
