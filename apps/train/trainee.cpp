#include "trainee.h"

#include <chrono>

namespace train {

std::shared_ptr<void> Trainee::phase(fsdp::StepPhase phase) {
  struct Timed {
    fsdp::PhaseTime& into;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~Timed() {
      into.wall_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
      ++into.count;
    }
  };
  return std::make_shared<Timed>(Timed{timed_phases_[phase]});
}

namespace {

class LocalTrainee final : public Trainee {
 public:
  LocalTrainee(std::shared_ptr<torch::nn::Module> model, std::vector<torch::Tensor> unique)
      : model_(std::move(model)), unique_(std::move(unique)) {}
  void begin_step() override { timed_phases_ = {}; }
  torch::Tensor forward(const std::function<torch::Tensor()>& forward) override { return forward(); }
  std::optional<c10::ScalarType> input_dtype() const override { return std::nullopt; }
  std::shared_ptr<void> no_sync() override { return nullptr; }
  double clip_grad_norm(double max_norm, const std::vector<torch::Tensor>&) override {
    return torch::nn::utils::clip_grad_norm_(unique_, max_norm);  // one process holds every part
  }
  fsdp::Metrics metrics() const override {
    fsdp::Metrics m;
    for (const auto& p : unique_) m.memory.sharded_params += p.numel() * static_cast<int64_t>(p.element_size());
    m.memory.sharded_grads = m.memory.sharded_params;
    m.phases = timed_phases_;
    return m;
  }
  std::string describe() const override { return "local training (no fsdp)"; }
  bool write_trace(const std::string&) const override { return false; }
  bool is_sharded() const override { return false; }
  fsdp::FullyShardedDataParallelBase* wrapped() override { return nullptr; }

 private:
  std::shared_ptr<torch::nn::Module> model_;
  std::vector<torch::Tensor> unique_;
};

class ShardedTrainee final : public Trainee {
 public:
  ShardedTrainee(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<fsdp::Mesh> mesh, fsdp::Options options,
                 std::string strategy)
      : input_dtype_(options.mixed_precision ? std::optional<c10::ScalarType>(options.mixed_precision->param_dtype)
                                             : std::nullopt),
        fsdp_(std::move(model), std::move(mesh), std::move(options)),
        strategy_(std::move(strategy)) {}
  void begin_step() override { fsdp_.reset_step(); }
  torch::Tensor forward(const std::function<torch::Tensor()>& forward) override { return fsdp_.forward_with(forward); }
  std::optional<c10::ScalarType> input_dtype() const override { return input_dtype_; }
  std::shared_ptr<void> no_sync() override {
    return std::make_shared<fsdp::FullyShardedDataParallelBase::NoSync>(fsdp_.no_sync());
  }
  double clip_grad_norm(double max_norm, const std::vector<torch::Tensor>& model_parallel) override {
    return fsdp_.clip_grad_norm_(max_norm, model_parallel);
  }
  fsdp::Metrics metrics() const override { return fsdp_.metrics(); }
  std::string describe() const override {
    return std::to_string(fsdp_.units().size()) + " units, strategy " + strategy_ + " F=" +
           std::to_string(fsdp_.shard_size());
  }
  bool write_trace(const std::string& path) const override {
    fsdp_.write_trace(path);
    return true;
  }
  bool is_sharded() const override { return true; }
  fsdp::FullyShardedDataParallelBase* wrapped() override { return &fsdp_; }
  std::shared_ptr<void> phase(fsdp::StepPhase phase) override {
    return std::make_shared<fsdp::FullyShardedDataParallelBase::PhaseScope>(fsdp_.record_phase(phase));
  }

 private:
  std::optional<c10::ScalarType> input_dtype_;
  fsdp::FullyShardedDataParallel<torch::nn::Module> fsdp_;
  std::string strategy_;
};

}  // namespace

std::unique_ptr<Trainee> local_trainee(std::shared_ptr<torch::nn::Module> model, std::vector<torch::Tensor> unique_params) {
  return std::make_unique<LocalTrainee>(std::move(model), std::move(unique_params));
}

std::unique_ptr<Trainee> sharded_trainee(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<fsdp::Mesh> mesh,
                                         fsdp::Options options, const std::string& strategy) {
  return std::make_unique<ShardedTrainee>(std::move(model), std::move(mesh), std::move(options), strategy);
}

}  // namespace train
