// A DDP-style baseline, written for the paper's Fig. 6a: fsdp with F = 1 (NO_SHARD) against plain
// data parallelism on the same model (the paper finds them within 0.7-1.1 %). Every rank holds the
// whole model; gradients are averaged the way PyTorch's DDP does it: parameters in reverse
// registration order (roughly the order backward produces their gradients) grouped into buckets of
// about 25 MiB (the first 1 MiB), each bucket all-reduced asynchronously as soon as backward has produced all of its
// gradients, and waited for when backward ends. Nothing of fsdp is involved but the mesh's world
// group, so the comparison is fsdp's machinery against none.
#include <stdexcept>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "trainee.h"

namespace train {
namespace {

constexpr int64_t kBucketBytes = 25 * 1024 * 1024;     // DDP's bucket_cap_mb default
constexpr int64_t kFirstBucketBytes = 1024 * 1024;     // DDP's first bucket: small, so a reduction starts early

class DDPTrainee final : public Trainee {
 public:
  DDPTrainee(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<fsdp::Mesh> mesh, std::vector<torch::Tensor> unique)
      : model_(std::move(model)), mesh_(std::move(mesh)), unique_(std::move(unique)) {
    std::vector<torch::Tensor> order;
    for (auto it = unique_.rbegin(); it != unique_.rend(); ++it) {
      if (it->requires_grad()) order.push_back(*it);
    }
    int64_t bytes = 0;
    for (const auto& p : order) {
      const int64_t size = p.numel() * static_cast<int64_t>(p.element_size());
      const int64_t cap = buckets_.size() <= 1 ? kFirstBucketBytes : kBucketBytes;
      if (buckets_.empty() || (bytes + size > cap && !buckets_.back().params.empty())) {
        buckets_.emplace_back();
        bytes = 0;
      }
      const size_t b = buckets_.size() - 1, slot = buckets_.back().params.size();
      buckets_.back().params.push_back(p);
      buckets_.back().grads.emplace_back();
      bytes += size;
      hooks_.emplace_back(p, p.register_hook([this, b, slot](const torch::Tensor& g) {
        ready(b, slot, g);
        return g;
      }));
    }
  }
  ~DDPTrainee() override {
    for (auto& [p, handle] : hooks_) p.remove_hook(handle);
  }

  void begin_step() override {
    all_reduced_bytes_ = 0;
    timed_phases_ = {};
  }
  torch::Tensor forward(const std::function<torch::Tensor()>& forward) override { return forward(); }
  std::optional<c10::ScalarType> input_dtype() const override { return std::nullopt; }
  std::shared_ptr<void> no_sync() override {
    quiet_ = true;
    return std::shared_ptr<void>(nullptr, [this](void*) { quiet_ = false; });
  }
  void finish_backward() override {
    if (quiet_) return;  // accumulating locally: the next backward outside no_sync reduces the sum
    // A bucket some of whose parameters got no gradient (unused in this forward) goes now, with
    // zeros for them, as DDP's find_unused_parameters does.
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (!buckets_[b].work && buckets_[b].ready > 0) launch(b);
    }
    const double W = static_cast<double>(mesh_->world_size());
    for (auto& bk : buckets_) {
      if (!bk.work) continue;
      if (!bk.work->wait()) throw std::runtime_error("DDP baseline: a gradient all-reduce failed");
      bk.flat.div_(W);
      int64_t offset = 0;
      for (auto& p : bk.params) {
        torch::Tensor avg = bk.flat.narrow(0, offset, p.numel()).view(p.sizes());
        offset += p.numel();
        if (p.grad().defined()) p.mutable_grad().copy_(avg);
        else p.mutable_grad() = avg.clone();
      }
      bk.work.reset();
      bk.ready = 0;
      for (auto& g : bk.grads) g = torch::Tensor();
    }
  }
  double clip_grad_norm(double max_norm, const std::vector<torch::Tensor>&) override {
    // Every rank holds the whole model here (the DHEN's whole tables too: the baseline is built
    // without the mesh), and after finish_backward every gradient is the averaged one, the same on
    // every rank: the local norm is the global one.
    return torch::nn::utils::clip_grad_norm_(unique_, max_norm);
  }
  fsdp::Metrics metrics() const override {
    fsdp::Metrics m;
    for (const auto& p : unique_) m.memory.sharded_params += p.numel() * static_cast<int64_t>(p.element_size());
    m.memory.sharded_grads = m.memory.sharded_params;
    m.comm.all_reduce = all_reduced_bytes_;  // the tensors' bytes, as fsdp counts its own all-reduces
    m.phases = timed_phases_;
    return m;
  }
  std::string describe() const override {
    return "DDP-style baseline (no fsdp): the whole model on every rank, gradients all-reduced in " +
           std::to_string(buckets_.size()) + " bucket(s) (the first up to 1 MiB, then 25 MiB) during backward";
  }
  bool write_trace(const std::string&) const override { return false; }
  bool is_sharded() const override { return false; }
  fsdp::FullyShardedDataParallelBase* wrapped() override { return nullptr; }

 private:
  struct Bucket {
    std::vector<torch::Tensor> params, grads;  // grads: this step's local gradient of each, once ready
    size_t ready = 0;
    torch::Tensor flat;
    c10::intrusive_ptr<c10d::Work> work;
  };

  // Backward produced parameter `slot` of bucket `b`'s gradient `g` (before autograd adds it to
  // .grad, which may hold micro-batches accumulated under no_sync).
  void ready(size_t b, size_t slot, const torch::Tensor& g) {
    if (quiet_) return;
    Bucket& bk = buckets_[b];
    const torch::Tensor& p = bk.params[slot];
    if (!bk.grads[slot].defined()) ++bk.ready;
    bk.grads[slot] = p.grad().defined() ? p.grad() + g : g;
    if (bk.ready == bk.params.size()) launch(b);
  }
  void launch(size_t b) {
    Bucket& bk = buckets_[b];
    std::vector<torch::Tensor> pieces;
    for (size_t i = 0; i < bk.params.size(); ++i) {
      pieces.push_back(bk.grads[i].defined() ? bk.grads[i].reshape(-1) : torch::zeros({bk.params[i].numel()}, bk.params[i].options()));
    }
    bk.flat = torch::cat(pieces);
    std::vector<torch::Tensor> one{bk.flat};
    bk.work = mesh_->world()->allreduce(one);
    all_reduced_bytes_ += bk.flat.numel() * static_cast<int64_t>(bk.flat.element_size());
  }

  std::shared_ptr<torch::nn::Module> model_;
  std::shared_ptr<fsdp::Mesh> mesh_;
  std::vector<torch::Tensor> unique_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<torch::Tensor, unsigned>> hooks_;
  bool quiet_ = false;
  int64_t all_reduced_bytes_ = 0;  // this step's
};

}  // namespace

std::unique_ptr<Trainee> ddp_trainee(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<fsdp::Mesh> mesh,
                                     std::vector<torch::Tensor> unique_params) {
  return std::make_unique<DDPTrainee>(std::move(model), std::move(mesh), std::move(unique_params));
}

}  // namespace train
