#include "fuzz_models.h"

#include <sstream>

#include <c10/core/InferenceMode.h>

namespace worker::fuzz {

std::vector<bool> retain_for_each(const std::vector<int>& per_forward) {
  std::vector<bool> retain;
  for (int n : per_forward) {
    for (int i = 0; i < n; ++i) retain.push_back(i + 1 < n);
  }
  return retain;
}

std::string Features::describe() const {
  std::string s = dhen ? "tiny DHEN (rows outside fsdp)" : gpt ? "tiny GPT" : tied ? "tied net (a Linear shared by two units)" : "uneven net";
  s += ", " + optimizer;
  if (max_norm) s += ", max_norm embedding";
  if (frozen_block) s += ", frozen block";
  if (teacher) s += ", nested teacher";
  if (two_roots) s += ", a second wrapped model before it";
  return s;
}

void Features::force(const std::string& names) {
  std::stringstream in(names);
  std::string n;
  while (std::getline(in, n, ',')) {
    if (n == "gpt") { gpt = true; dhen = tied = false; }
    else if (n == "uneven") { gpt = dhen = tied = false; }
    else if (n == "dhen") { dhen = true; gpt = tied = false; }
    else if (n == "tied") { tied = true; gpt = dhen = false; }
    else if (n == "two_roots") two_roots = true;
    else if (n == "sgd" || n == "adam" || n == "adamw") optimizer = n;
    else throw std::invalid_argument("fuzz: unknown feature '" + n + "' in --features");
  }
  if (!gpt) max_norm = teacher = false;
  if (gpt || dhen) two_roots = false;  // their inputs are token ids: no model goes before them
}

TiedBlockImpl::TiedBlockImpl(torch::nn::Linear shared) {
  lin = register_module("lin", shared);
  own = register_module("own", torch::nn::Linear(16, 16));
}
torch::Tensor TiedBlockImpl::forward(const torch::Tensor& x) { return x + torch::tanh(own(torch::tanh(lin(x)))); }

TiedNetImpl::TiedNetImpl() {
  torch::nn::Linear shared(16, 16);
  b0 = register_module("b0", TiedBlock(torch::nn::Linear(16, 16)));
  b1 = register_module("b1", TiedBlock(shared));
  b2 = register_module("b2", TiedBlock(shared));
  head = register_module("head", torch::nn::Linear(16, 16));
}
torch::Tensor TiedNetImpl::forward(const torch::Tensor& x) { return head(b2(b1(b0(x)))); }

torch::nn::Sequential make_second_root() {
  torch::manual_seed(2);
  return torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16));
}

namespace {
const models::DHENConfig& dhen_config() {
  static const models::DHENConfig cfg = models::DHENConfig::preset("dhen-tiny");
  return cfg;
}
models::DHENImpl& dhen_of(const std::shared_ptr<torch::nn::Module>& m) { return *std::dynamic_pointer_cast<models::DHENImpl>(m); }
}  // namespace

torch::Tensor Core::run(const torch::Tensor& x) const {
  if (dhen) {
    // Dense features and ids side by side in one float tensor (ids below 2^24 are exact).
    const int64_t n_dense = dhen_config().n_dense;
    return dhen_of(module).forward(x.narrow(1, 0, n_dense), x.narrow(1, n_dense, x.size(1) - n_dense).to(torch::kLong));
  }
  if (tied) return std::dynamic_pointer_cast<TiedNetImpl>(module)->forward(x);
  return gpt ? std::dynamic_pointer_cast<models::GPTImpl>(module)->forward(x)
             : std::dynamic_pointer_cast<models::UnevenNetImpl>(module)->forward(x);
}

std::pair<torch::Tensor, torch::Tensor> Core::data(int64_t batch, int64_t begin, int64_t end) const {
  if (dhen) {
    static const models::ClickData clicks(dhen_config(), 3);
    auto [dense, ids, labels] = clicks.batch(batch, kGlobalBatch, begin, end);
    return {torch::cat({dense, ids.to(torch::kFloat)}, 1).to(g_device), labels.to(g_device)};
  }
  if (!gpt) return uneven_batch(batch, begin, end);
  auto [x, y] = corpus().batch(batch, kGlobalBatch, models::GPTConfig::preset("tiny").block_size, 11, begin, end);
  return {x.to(g_device), y.to(g_device)};
}

torch::Tensor Core::loss(const torch::Tensor& out, const torch::Tensor& target) const {
  if (dhen) return models::click_loss(out.to(torch::kFloat), target);
  return gpt ? models::lm_loss(out.to(torch::kFloat), target) : torch::mse_loss(out.to(torch::kFloat), target);
}

torch::Tensor Core::aux_loss(const torch::Tensor& out) const { return out.to(torch::kFloat).square().mean() * 0.01; }

fsdp::WrapPolicy Core::policy() const {
  if (dhen) return fsdp::module_type_policy<models::DHENLayerImpl>();
  if (tied) return fsdp::module_type_policy<TiedBlockImpl>();
  return gpt ? fsdp::module_type_policy<models::BlockImpl>() : fsdp::module_type_policy<torch::nn::LinearImpl>();
}

std::vector<std::shared_ptr<torch::nn::Module>> Core::ignored() const {
  if (!dhen) return {};
  return {dhen_of(module).sparse.ptr()};
}

std::vector<torch::Tensor> Core::model_parallel() const {
  if (!dhen) return {};
  return {dhen_of(module).sparse->weight};
}

std::pair<int64_t, int64_t> Core::rows() const {
  if (!dhen) return {0, 0};
  return {dhen_of(module).sparse->row_begin(), dhen_of(module).sparse->local_rows()};
}

torch::nn::Module& Core::toggle_module() const {
  if (dhen) return *dhen_of(module).layers[0];
  if (tied) return *std::dynamic_pointer_cast<TiedNetImpl>(module)->b1;  // holds the shared Linear
  if (gpt) return *std::dynamic_pointer_cast<models::GPTImpl>(module)->blocks[0];
  return *std::dynamic_pointer_cast<models::UnevenNetImpl>(module)->c;
}

Core make_core(const Features& f, uint64_t seed, const std::shared_ptr<fsdp::Mesh>& mesh) {
  torch::manual_seed(seed);
  Core c;
  c.gpt = f.gpt && !f.dhen && !f.tied;
  c.dhen = f.dhen;
  c.tied = f.tied && !f.dhen;
  if (c.tied) {
    c.module = TiedNet().ptr();
  } else if (f.dhen) {
    if (mesh && mesh->world_size() > 1) {
      c.module = models::DHEN(dhen_config(), mesh->world(), mesh->rank(), mesh->world_size()).ptr();
    } else {
      c.module = models::DHEN(dhen_config()).ptr();
    }
  } else if (f.gpt) {
    auto gpt = models::GPT(models::GPTConfig::preset("tiny"));
    if (f.max_norm && seed == 0) gpt->tok_emb->options.max_norm(0.1);  // below the initial rows' norms (about 0.11)
    c.module = gpt.ptr();
  } else {
    c.module = models::UnevenNet().ptr();
  }
  if (f.frozen_block && seed == 0) {
    for (auto& p : c.toggle_module().parameters()) p.requires_grad_(false);
  }
  return c;
}

torch::Tensor with_teacher(const torch::Tensor& student, const torch::Tensor& teacher_logits) {
  return student + teacher_logits.detach().to(student.scalar_type()) * 0.1;
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

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, const std::vector<torch::Tensor>& params,
                                                        double lr) {
  if (kind == "adam") return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(lr * 0.1));
  if (kind == "adamw") {
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(lr * 0.1).weight_decay(0.01));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(lr).momentum(0.9));
}

namespace {

// Named as inside FuzzNet ("core." + the core's own name).
std::map<std::string, torch::Tensor> by_name(torch::nn::Module& m, bool grads) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, p] : unique_params(m)) out["core." + name] = grads ? p.grad() : p.detach();
  return out;
}

std::vector<torch::Tensor> params_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& kv : unique_params(m)) out.push_back(kv.second);
  return out;
}

// Backward of `losses`' sum, with a hook on `hooked` (when defined) that throws, as a user's would;
// the exception is the one the fuzzer expects, and is swallowed here.
void backward_throwing(const std::vector<torch::Tensor>& losses, torch::Tensor hooked) {
  torch::Tensor sum = losses[0];
  for (size_t i = 1; i < losses.size(); ++i) sum = sum + losses[i];
  const unsigned handle =
      hooked.register_hook([](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("fuzz: hook throws"); });
  try {
    sum.backward();
  } catch (const std::exception& e) {
    if (std::string(e.what()).find("fuzz: hook throws") == std::string::npos) {
      hooked.remove_hook(handle);
      throw;
    }
  }
  hooked.remove_hook(handle);
}

// Local training: one model on the whole global batch.
class LocalReference final : public Reference {
 public:
  LocalReference(const Features& f, double lr) : features_(f), core_(make_core(f)) {
    if (f.teacher) teacher_ = make_core(f, 1);
    auto params = params_of(*core_.module);
    if (f.two_roots) {
      second_ = make_second_root();
      for (auto& p : params_of(*second_)) params.push_back(p);
    }
    optim_ = make_optimizer(f.optimizer, params, lr);
  }
  double forward(int64_t batch, ForwardKind kind) override {
    const bool grad = kind == ForwardKind::GRAD || kind == ForwardKind::TWO_LOSSES;
    auto [x, y] = core_.data(batch, 0, kGlobalBatch);
    std::optional<c10::InferenceMode> inference;
    if (kind == ForwardKind::INFERENCE) inference.emplace();
    torch::AutoGradMode mode(grad);
    torch::Tensor out = core_.run(second_ ? second_->forward(x) : x);
    if (teacher_) {
      torch::NoGradGuard no_grad;
      const torch::Tensor t = teacher_->run(x);
      torch::AutoGradMode back(grad);
      out = with_teacher(out, t);
    }
    auto loss = core_.loss(out, y);
    const double value = loss.item<double>();
    if (grad) {
      pending_.push_back(loss);
      forwards_.push_back(1);
      if (kind == ForwardKind::TWO_LOSSES) {
        pending_.push_back(core_.aux_loss(out));
        forwards_.back() = 2;
      }
    }
    return value;
  }
  void drop_graph() override {
    for (int i = 0; i < forwards_.back(); ++i) pending_.pop_back();
    forwards_.pop_back();
  }
  void drop_all_graphs() override {
    pending_.clear();
    forwards_.clear();
  }
  void backward(bool retain, bool) override {
    torch::Tensor sum = pending_[0];
    for (size_t i = 1; i < pending_.size(); ++i) sum = sum + pending_[i];
    sum.backward({}, retain);
    if (!retain) drop_all_graphs();
  }
  void backward_each() override {
    const std::vector<bool> retain = retain_for_each(forwards_);
    for (size_t i = 0; i < pending_.size(); ++i) pending_[i].backward({}, retain[i]);
    drop_all_graphs();
  }
  void backward_throwing_at(const std::string& fqn) override {
    backward_throwing(pending_, named(fqn));
    drop_all_graphs();
  }
  void zero_grad(bool set_to_none) override { optim_->zero_grad(set_to_none); }
  void step() override { optim_->step(); }
  void clip(double max_norm) override {
    torch::nn::utils::clip_grad_norm_(params_of(*core_.module), max_norm);
    if (second_) torch::nn::utils::clip_grad_norm_(params_of(*second_), max_norm);  // each model its own
  }
  void toggle_frozen() override {
    for (auto& p : core_.toggle_module().parameters()) p.requires_grad_(!p.requires_grad());
  }
  std::map<std::string, torch::Tensor> params() override { return with_second(by_name(*core_.module, false), false); }
  std::map<std::string, torch::Tensor> grads() override { return with_second(by_name(*core_.module, true), true); }

 private:
  torch::Tensor named(const std::string& fqn) {
    for (auto& [name, p] : unique_params(*core_.module)) {
      if ("core." + name == fqn) return p;
    }
    throw std::invalid_argument("fuzz: no parameter " + fqn);
  }
  // The second model's parameters (or gradients) as "second.<name>", beside the core's.
  std::map<std::string, torch::Tensor> with_second(std::map<std::string, torch::Tensor> out, bool grads) {
    if (second_) {
      for (const auto& item : second_->named_parameters()) {
        out["second." + item.key()] = grads ? item.value().grad() : item.value().detach();
      }
    }
    return out;
  }
  Features features_;
  Core core_;
  torch::nn::Sequential second_{nullptr};
  std::optional<Core> teacher_;
  std::unique_ptr<torch::optim::Optimizer> optim_;
  std::vector<torch::Tensor> pending_;
  std::vector<int> forwards_;  // how many pending losses each forward left
};

// fsdp's casts replayed: an fp32 master and W working copies in param_dtype, one per rank.
class ReplayReference final : public Reference {
 public:
  ReplayReference(const Features& f, int W, fsdp::MixedPrecision mp, double lr) : master_(make_core(f)), mp_(mp), W_(W) {
    params_ = params_of(*master_.module);
    optim_ = make_optimizer(f.optimizer, params_, lr);
    for (int r = 0; r < W; ++r) {
      workers_.push_back(make_core(f));
      worker_params_.push_back(params_of(*workers_.back().module));
      accum_.emplace_back(params_.size());
    }
    pending_.resize(static_cast<size_t>(W));
    recast();
  }
  double forward(int64_t batch, ForwardKind kind) override {
    const bool grad = kind == ForwardKind::GRAD || kind == ForwardKind::TWO_LOSSES;
    const int64_t per = kGlobalBatch / W_;
    double sum = 0;
    for (int r = 0; r < W_; ++r) {
      Core& w = workers_[static_cast<size_t>(r)];
      auto [x, y] = w.data(batch, r * per, (r + 1) * per);
      if (x.is_floating_point()) x = x.to(mp_.param_dtype);  // as the root's forward casts inputs
      std::optional<c10::InferenceMode> inference;
      if (kind == ForwardKind::INFERENCE) inference.emplace();
      torch::AutoGradMode mode(grad);
      const torch::Tensor out = w.run(x);
      auto loss = w.loss(out, y);
      if (grad) {
        pending_[static_cast<size_t>(r)].push_back(loss);
        if (kind == ForwardKind::TWO_LOSSES) pending_[static_cast<size_t>(r)].push_back(w.aux_loss(out));
      }
      sum += loss.item<double>();
    }
    if (grad) forwards_.push_back(kind == ForwardKind::TWO_LOSSES ? 2 : 1);
    return sum / W_;
  }
  void drop_graph() override {
    for (auto& p : pending_) {
      for (int i = 0; i < forwards_.back(); ++i) p.pop_back();
    }
    forwards_.pop_back();
  }
  void drop_all_graphs() override {
    for (auto& p : pending_) p.clear();
    forwards_.clear();
  }
  void backward(bool retain, bool no_sync) override {
    run_backward(no_sync, [&](std::vector<torch::Tensor>& pend, int) {
      torch::Tensor sum = pend[0];
      for (size_t i = 1; i < pend.size(); ++i) sum = sum + pend[i];
      sum.backward({}, retain);
    });
    if (!retain) drop_all_graphs();
  }
  void backward_each() override {
    // fsdp reduces after each backward: replay each as a backward of its own.
    const size_t n = pending_[0].size();
    const std::vector<bool> retain = retain_for_each(forwards_);
    for (size_t i = 0; i < n; ++i) {
      run_backward(false, [&](std::vector<torch::Tensor>& pend, int) { pend[i].backward({}, retain[i]); });
    }
    drop_all_graphs();
  }
  void backward_throwing_at(const std::string& fqn) override {
    run_backward(false, [&](std::vector<torch::Tensor>& pend, int r) { backward_throwing(pend, named(r, fqn)); });
    drop_all_graphs();
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
  void toggle_frozen() override {
    for (auto& p : master_.toggle_module().parameters()) p.requires_grad_(!p.requires_grad());
    for (auto& w : workers_) {
      for (auto& p : w.toggle_module().parameters()) p.requires_grad_(!p.requires_grad());
    }
  }
  std::map<std::string, torch::Tensor> params() override { return by_name(*master_.module, false); }
  std::map<std::string, torch::Tensor> grads() override { return by_name(*master_.module, true); }

 private:
  torch::Tensor named(int r, const std::string& fqn) {
    for (auto& [name, p] : unique_params(*workers_[static_cast<size_t>(r)].module)) {
      if ("core." + name == fqn) return p;
    }
    throw std::invalid_argument("fuzz: no parameter " + fqn);
  }
  // One backward on every working copy, then fsdp's reduction of what each accumulated.
  template <typename Fn>
  void run_backward(bool no_sync, Fn&& backward_of_rank) {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> reduced(params_.size());
    for (int r = 0; r < W_; ++r) {
      {
        torch::AutoGradMode on(true);
        backward_of_rank(pending_[static_cast<size_t>(r)], r);
      }
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
  void recast() {
    torch::NoGradGuard no_grad;
    for (auto& wp : worker_params_) {
      for (size_t i = 0; i < params_.size(); ++i) wp[i].set_data(params_[i].detach().to(mp_.param_dtype));
    }
  }
  Core master_;
  fsdp::MixedPrecision mp_;
  int W_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<torch::optim::Optimizer> optim_;
  std::vector<Core> workers_;
  std::vector<std::vector<torch::Tensor>> worker_params_;
  std::vector<std::vector<torch::Tensor>> accum_;    // per rank, per parameter: no_sync sums (fp32)
  std::vector<std::vector<torch::Tensor>> pending_;  // per rank: losses not backwarded yet
  std::vector<int> forwards_;                        // how many pending losses each forward left
};

}  // namespace

std::unique_ptr<Reference> make_reference(const Features& f, int world_size,
                                          const std::optional<fsdp::MixedPrecision>& mp, double lr) {
  if (!mp) return std::make_unique<LocalReference>(f, lr);
  return std::make_unique<ReplayReference>(f, world_size, *mp, lr);
}

}  // namespace worker::fuzz
