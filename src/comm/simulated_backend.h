// Stand-in collectives for one rank of a job whose other ranks do not exist (Mesh::simulated):
// a pre-flight check runs rank r of a W-rank job in one process, on one device, and measures that
// rank's real memory peaks and compute time. Each collective writes outputs of the right size and
// completes at once, as if every other rank held what this rank holds:
//   all-gather       every chunk of the output is this rank's input
//   reduce-scatter   this rank's chunk of the input, times the group size for a sum (the sum of
//                    group-size equal contributions), unchanged for avg/min/max
//   all-reduce       times the group size for a sum, unchanged otherwise
//   broadcast, barrier, send, recv: nothing moves
// So values keep their magnitudes (a gradient averaged over W equal ranks is this rank's), and
// checks that compare ranks (fingerprints, the collective sequence, the memory budget) agree.
// c10d's own FakeProcessGroup leaves outputs unwritten and its header needs Python's.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace fsdp::detail {

class SimulatedBackend : public c10d::Backend {
 public:
  SimulatedBackend(int rank, int size);
  const std::string getBackendName() const override { return "fsdp-simulated"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
};

}  // namespace fsdp::detail
