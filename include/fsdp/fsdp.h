// fsdp: Fully Sharded Data Parallel training for libtorch.
//
//   auto mesh = fsdp::Mesh::create(fsdp::LaunchEnv::from_environment());
//   auto model = MyModel(...);                        // any libtorch model, unmodified
//   fsdp::Options opts;
//   opts.auto_wrap_policy = fsdp::module_type_policy<MyBlockImpl>();
//   fsdp::FullyShardedDataParallel fsdp_model(model, mesh, opts);   // shards in place
//   torch::optim::AdamW optim(model->parameters(), ...);           // steps this rank's shards
//   auto loss = loss_fn(fsdp_model.forward(x), y);                 // called like DDP
//   loss.backward();
//   fsdp_model.clip_grad_norm_(1.0);
//   optim.step();
#pragma once

#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/mesh.h"
#include "fsdp/metrics.h"
#include "fsdp/options.h"
#include "fsdp/trace.h"

namespace fsdp {

class Runtime;

// Marks `module` (any module inside the model) as its own FSDP unit, in addition to those the
// auto-wrap policy picks. The module keeps its type, its place in the model and its parameter
// names. Takes effect when the root FullyShardedDataParallel is built.
void fully_shard(const torch::nn::Module& module);

// What a unit looks like after construction (for accounting, tests and logs).
struct UnitInfo {
  std::string name;                // module path ("" for the root unit)
  std::vector<std::string> fqns;   // its original parameters
  int64_t numel = 0;               // Σ ψ of its parameters
  int64_t padded_numel = 0;        // rounded up to a multiple of F
  int64_t shard_numel = 0;         // = ceil(numel / F), what each rank keeps
  int64_t element_size = 4;
  bool is_root = false;
};

namespace detail {
std::shared_ptr<Runtime> make_runtime(std::shared_ptr<torch::nn::Module> root, std::shared_ptr<Mesh> mesh,
                                      Options options);
void begin_forward(Runtime& rt);
// `outputs` are the tensors the root's forward returned; ok=false when forward threw.
void end_forward(Runtime& rt, const std::vector<at::Tensor>& outputs, bool ok);
Metrics metrics(const Runtime& rt);
void reset_step(Runtime& rt);
void set_no_sync(Runtime& rt, bool on);
double clip_grad_norm(Runtime& rt, double max_norm);
std::vector<UnitInfo> units(const Runtime& rt);
int shard_size(const Runtime& rt);
std::vector<Span> timeline(const Runtime& rt);
void write_trace(const Runtime& rt, const std::string& path);
// Mixed precision's param_dtype, which floating-point forward inputs are cast to.
std::optional<c10::ScalarType> input_dtype(const Runtime& rt);

template <typename T>
decltype(auto) cast_input(const std::optional<c10::ScalarType>& dtype, T&& arg) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    if (dtype && arg.defined() && at::isFloatingType(arg.scalar_type()) && arg.scalar_type() != *dtype) {
      return at::Tensor(arg.to(*dtype));
    }
    return at::Tensor(std::forward<T>(arg));
  } else {
    return std::forward<T>(arg);
  }
}

inline void collect(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void collect(const std::vector<at::Tensor>& v, std::vector<at::Tensor>& out) {
  out.insert(out.end(), v.begin(), v.end());
}
template <typename... Ts>
void collect(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... e) { (collect(e, out), ...); }, t);
}
template <typename T>
void collect(const T&, std::vector<at::Tensor>&) {}  // non-tensor results carry no gradient
}  // namespace detail

// The root wrapper: owns nothing of the model but its sharding. Build it once, after marking
// inner units, before creating the optimizer. The wrapped module stays usable as before; its
// parameters() are now this rank's shards.
template <typename ModuleType>
class FullyShardedDataParallel {
 public:
  FullyShardedDataParallel(std::shared_ptr<ModuleType> module, std::shared_ptr<Mesh> mesh, Options options = {})
      : module_(std::move(module)),
        runtime_(detail::make_runtime(module_, std::move(mesh), std::move(options))) {}
  FullyShardedDataParallel(const torch::nn::ModuleHolder<ModuleType>& holder, std::shared_ptr<Mesh> mesh,
                           Options options = {})
      : FullyShardedDataParallel(holder.ptr(), std::move(mesh), std::move(options)) {}

  // Runs the model's forward as the root unit: inner units are gathered as they are reached and
  // (with FULL_SHARD) freed once the next one starts.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    detail::begin_forward(*runtime_);
    try {
      // With mixed precision, floating-point inputs are cast to param_dtype (as PyTorch does).
      const auto dtype = detail::input_dtype(*runtime_);
      decltype(auto) out = module_->forward(detail::cast_input(dtype, std::forward<Args>(args))...);
      std::vector<at::Tensor> tensors;
      detail::collect(out, tensors);
      detail::end_forward(*runtime_, tensors, true);
      return out;
    } catch (...) {
      detail::end_forward(*runtime_, {}, false);
      throw;
    }
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) { return forward(std::forward<Args>(args)...); }

  ModuleType* operator->() const { return module_.get(); }
  const std::shared_ptr<ModuleType>& module() const { return module_; }
  std::vector<at::Tensor> parameters() const { return module_->parameters(); }

  // Gradient accumulation without communication: backward passes inside a no_sync scope keep
  // unsharded gradients locally; the first backward after it reduces everything at once.
  class NoSync {
   public:
    explicit NoSync(Runtime& rt) : rt_(&rt) { detail::set_no_sync(rt, true); }
    ~NoSync() { if (rt_) detail::set_no_sync(*rt_, false); }
    NoSync(NoSync&& o) noexcept : rt_(o.rt_) { o.rt_ = nullptr; }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
   private:
    Runtime* rt_;
  };
  NoSync no_sync() { return NoSync(*runtime_); }

  // Clips gradients by their exact global 2-norm (over all ranks' shards) and returns that norm.
  double clip_grad_norm_(double max_norm) { return detail::clip_grad_norm(*runtime_, max_norm); }

  Metrics metrics() const { return detail::metrics(*runtime_); }
  void reset_step() { detail::reset_step(*runtime_); }
  std::vector<UnitInfo> units() const { return detail::units(*runtime_); }
  // This rank's spans since the last reset_step(): each unit's forward and backward computation,
  // each collective (issue, start, end) and each blocking wait.
  std::vector<Span> timeline() const { return detail::timeline(*runtime_); }
  // The same as a Chrome trace JSON file (Perfetto, chrome://tracing); call it after a step.
  void write_trace(const std::string& path) const { detail::write_trace(*runtime_, path); }
  int shard_size() const { return detail::shard_size(*runtime_); }
  Runtime& runtime() { return *runtime_; }

 private:
  std::shared_ptr<ModuleType> module_;
  std::shared_ptr<Runtime> runtime_;
};

template <typename M>
FullyShardedDataParallel(const torch::nn::ModuleHolder<M>&, std::shared_ptr<Mesh>, Options)
    -> FullyShardedDataParallel<M>;
template <typename M>
FullyShardedDataParallel(const torch::nn::ModuleHolder<M>&, std::shared_ptr<Mesh>)
    -> FullyShardedDataParallel<M>;

}  // namespace fsdp
