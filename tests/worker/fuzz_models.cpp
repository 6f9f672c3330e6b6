#include "fuzz_models.h"

namespace worker::fuzz {

torch::Tensor Core::run(const torch::Tensor& x) const {
  return gpt ? std::dynamic_pointer_cast<models::GPTImpl>(module)->forward(x)
             : std::dynamic_pointer_cast<models::UnevenNetImpl>(module)->forward(x);
}

std::pair<torch::Tensor, torch::Tensor> Core::data(int64_t batch, int64_t begin, int64_t end) const {
  if (!gpt) return uneven_batch(batch, begin, end);
  auto [x, y] = corpus().batch(batch, kGlobalBatch, models::GPTConfig::preset("tiny").block_size, 11, begin, end);
  return {x.to(g_device), y.to(g_device)};
}

torch::Tensor Core::loss(const torch::Tensor& out, const torch::Tensor& target) const {
  return gpt ? models::lm_loss(out.to(torch::kFloat), target) : torch::mse_loss(out.to(torch::kFloat), target);
}

fsdp::WrapPolicy Core::policy() const {
  return gpt ? fsdp::module_type_policy<models::BlockImpl>() : fsdp::module_type_policy<torch::nn::LinearImpl>();
}

Core make_core(bool gpt) {
  torch::manual_seed(0);
  Core c;
  c.gpt = gpt;
  if (gpt) c.module = models::GPT(models::GPTConfig::preset("tiny")).ptr();
  else c.module = models::UnevenNet().ptr();
  return c;
}

const char* name_of(OutKind k) {
  switch (k) {
    case OutKind::TENSOR: return "Tensor";
    case OutKind::PAIR: return "std::pair";
    case OutKind::STRUCT: return "struct";
    case OutKind::MAP: return "std::map";
    case OutKind::DICT: return "torch::Dict";
    case OutKind::IVALUE: return "IValue";
    case OutKind::NESTED: return "nested containers";
  }
  return "?";
}

namespace {

// Named as inside FuzzNet ("core." + the core's own name).
std::map<std::string, torch::Tensor> by_name(torch::nn::Module& m, bool grads) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, p] : unique_params(m)) out["core." + name] = grads ? p.grad() : p.detach();
  return out;
}

// Local training: one model on the whole global batch.
class LocalReference final : public Reference {
 public:
  LocalReference(bool gpt, double lr) : core_(make_core(gpt)) {
    for (auto& kv : unique_params(*core_.module)) params_.push_back(kv.second);
    optim_ = std::make_unique<torch::optim::SGD>(params_, torch::optim::SGDOptions(lr).momentum(0.9));
  }
  double forward(int64_t batch, bool grad) override {
    torch::AutoGradMode mode(grad);
    auto [x, y] = core_.data(batch, 0, kGlobalBatch);
    auto loss = core_.loss(core_.run(x), y);
    if (grad) pending_.push_back(loss);
    return loss.item<double>();
  }
  void drop_graph() override { pending_.pop_back(); }
  void backward(bool retain, bool) override {
    torch::Tensor sum = pending_[0];
    for (size_t i = 1; i < pending_.size(); ++i) sum = sum + pending_[i];
    sum.backward({}, retain);
    if (!retain) pending_.clear();
  }
  void zero_grad(bool set_to_none) override { optim_->zero_grad(set_to_none); }
  void step() override { optim_->step(); }
  void clip(double max_norm) override { torch::nn::utils::clip_grad_norm_(params_, max_norm); }
  std::map<std::string, torch::Tensor> params() override { return by_name(*core_.module, false); }
  std::map<std::string, torch::Tensor> grads() override { return by_name(*core_.module, true); }

 private:
  Core core_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<torch::optim::SGD> optim_;
  std::vector<torch::Tensor> pending_;
};

// fsdp's casts replayed: an fp32 master and W working copies in param_dtype, one per rank.
class ReplayReference final : public Reference {
 public:
  ReplayReference(bool gpt, int W, fsdp::MixedPrecision mp, double lr) : master_(make_core(gpt)), mp_(mp), W_(W) {
    for (auto& kv : unique_params(*master_.module)) {
      names_.push_back(kv.first);
      params_.push_back(kv.second);
    }
    optim_ = std::make_unique<torch::optim::SGD>(params_, torch::optim::SGDOptions(lr).momentum(0.9));
    for (int r = 0; r < W; ++r) {
      workers_.push_back(make_core(gpt));
      std::vector<torch::Tensor> wp;
      for (auto& kv : unique_params(*workers_.back().module)) wp.push_back(kv.second);
      worker_params_.push_back(wp);
      accum_.emplace_back(params_.size());
    }
    pending_.resize(static_cast<size_t>(W));
    recast();
  }
  double forward(int64_t batch, bool grad) override {
    torch::AutoGradMode mode(grad);
    const int64_t per = kGlobalBatch / W_;
    double sum = 0;
    for (int r = 0; r < W_; ++r) {
      auto [x, y] = workers_[static_cast<size_t>(r)].data(batch, r * per, (r + 1) * per);
      if (x.is_floating_point()) x = x.to(mp_.param_dtype);  // as the root's forward casts inputs
      auto loss = workers_[static_cast<size_t>(r)].loss(workers_[static_cast<size_t>(r)].run(x), y);
      if (grad) pending_[static_cast<size_t>(r)].push_back(loss);
      sum += loss.item<double>();
    }
    return sum / W_;
  }
  void drop_graph() override {
    for (auto& p : pending_) p.pop_back();
  }
  void backward(bool retain, bool no_sync) override {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> reduced(params_.size());
    for (int r = 0; r < W_; ++r) {
      auto& pend = pending_[static_cast<size_t>(r)];
      {
        torch::AutoGradMode on(true);
        torch::Tensor sum = pend[0];
        for (size_t i = 1; i < pend.size(); ++i) sum = sum + pend[i];
        sum.backward({}, retain);
      }
      if (!retain) pend.clear();
      auto& wp = worker_params_[static_cast<size_t>(r)];
      for (size_t i = 0; i < params_.size(); ++i) {
        const torch::Tensor g = wp[i].grad();
        wp[i].mutable_grad().reset();
        auto& acc = accum_[static_cast<size_t>(r)][i];
        if (no_sync) {  // fsdp keeps the unsharded sum in the master dtype
          if (g.defined()) acc = acc.defined() ? acc + g.to(mp_.reduce_dtype).to(torch::kFloat) : g.to(mp_.reduce_dtype).to(torch::kFloat);
          continue;
        }
        if (!g.defined() && !acc.defined()) continue;
        auto flat = g.defined() ? g.to(mp_.reduce_dtype) : torch::zeros_like(acc, torch::TensorOptions().dtype(mp_.reduce_dtype));
        if (acc.defined()) flat.add_(acc);
        acc = torch::Tensor();
        auto part = flat / W_;
        reduced[i] = reduced[i].defined() ? reduced[i] + part : part;
      }
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!reduced[i].defined()) continue;
      auto g = reduced[i].to(torch::kFloat);
      if (params_[i].grad().defined()) params_[i].mutable_grad().add_(g); else params_[i].mutable_grad() = g;
    }
  }
  void zero_grad(bool set_to_none) override {
    optim_->zero_grad(set_to_none);
    // The unsynchronized (no_sync) sums are gradients too: locally they would be on the parameters.
    for (auto& per_rank : accum_) {
      for (auto& a : per_rank) {
        if (!a.defined()) continue;
        if (set_to_none) a = torch::Tensor(); else a.zero_();
      }
    }
  }
  void step() override {
    optim_->step();
    recast();
  }
  void clip(double max_norm) override { torch::nn::utils::clip_grad_norm_(params_, max_norm); }
  std::map<std::string, torch::Tensor> params() override { return by_name(*master_.module, false); }
  std::map<std::string, torch::Tensor> grads() override { return by_name(*master_.module, true); }

 private:
  void recast() {
    torch::NoGradGuard no_grad;
    for (auto& wp : worker_params_) {
      for (size_t i = 0; i < params_.size(); ++i) wp[i].set_data(params_[i].detach().to(mp_.param_dtype));
    }
  }
  Core master_;
  fsdp::MixedPrecision mp_;
  int W_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<torch::optim::SGD> optim_;
  std::vector<Core> workers_;
  std::vector<std::vector<torch::Tensor>> worker_params_;
  std::vector<std::vector<torch::Tensor>> accum_;    // per rank, per parameter: no_sync sums (fp32)
  std::vector<std::vector<torch::Tensor>> pending_;  // per rank: losses not backwarded yet
};

}  // namespace

std::unique_ptr<Reference> make_reference(bool gpt, int world_size, const std::optional<fsdp::MixedPrecision>& mp,
                                          double lr) {
  if (!mp) return std::make_unique<LocalReference>(gpt, lr);
  return std::make_unique<ReplayReference>(gpt, world_size, *mp, lr);
}

}  // namespace worker::fuzz
