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

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/mesh.h"
#include "fsdp/metrics.h"
#include "fsdp/options.h"
#include "fsdp/trace.h"
#include "fsdp/unit_info.h"

namespace fsdp {

// Marks `module` (any module inside the model) as its own FSDP unit, in addition to those the
// auto-wrap policy picks. The module keeps its type, its place in the model and its parameter
// names. Takes effect when the root FullyShardedDataParallel is built; the mark ends with the
// module (a new module at the same address is not marked).
void fully_shard(const torch::nn::Module& module);

namespace detail {
class ShardedRoot;
struct RootAccess;  // the library's own view of a wrapped model (checkpoints)

// What FullyShardedDataParallel::forward casts to param_dtype under mixed precision: floating-point
// tensors, also inside the standard containers a forward takes (as PyTorch casts the tensors inside
// lists, tuples and dicts). A container is passed on as a new one; the caller's stays as it was.
template <typename T>
struct CastTensors {
  static constexpr bool holds = false;
};
template <>
struct CastTensors<at::Tensor> {
  static constexpr bool holds = true;
  static at::Tensor apply(const at::Tensor& t, c10::ScalarType dtype) {
    return t.defined() && at::isFloatingType(t.scalar_type()) && t.scalar_type() != dtype ? t.to(dtype) : t;
  }
};
template <typename T>
decltype(auto) cast_tensors(const T& v, c10::ScalarType dtype) {
  if constexpr (CastTensors<T>::holds) {
    return CastTensors<T>::apply(v, dtype);
  } else {
    return (v);
  }
}
template <typename T, typename A>
struct CastTensors<std::vector<T, A>> {
  static constexpr bool holds = CastTensors<T>::holds;
  static std::vector<T, A> apply(const std::vector<T, A>& v, c10::ScalarType dtype) {
    std::vector<T, A> out;
    out.reserve(v.size());
    for (const auto& e : v) out.push_back(cast_tensors(e, dtype));
    return out;
  }
};
template <typename K, typename V, typename C, typename A>
struct CastTensors<std::map<K, V, C, A>> {
  static constexpr bool holds = CastTensors<V>::holds;
  static std::map<K, V, C, A> apply(const std::map<K, V, C, A>& m, c10::ScalarType dtype) {
    std::map<K, V, C, A> out;
    for (const auto& [k, e] : m) out.emplace(k, cast_tensors(e, dtype));
    return out;
  }
};
template <typename K, typename V, typename H, typename E, typename A>
struct CastTensors<std::unordered_map<K, V, H, E, A>> {
  static constexpr bool holds = CastTensors<V>::holds;
  static std::unordered_map<K, V, H, E, A> apply(const std::unordered_map<K, V, H, E, A>& m, c10::ScalarType dtype) {
    std::unordered_map<K, V, H, E, A> out;
    for (const auto& [k, e] : m) out.emplace(k, cast_tensors(e, dtype));
    return out;
  }
};
template <typename A, typename B>
struct CastTensors<std::pair<A, B>> {
  static constexpr bool holds = CastTensors<A>::holds || CastTensors<B>::holds;
  static std::pair<A, B> apply(const std::pair<A, B>& p, c10::ScalarType dtype) {
    return {cast_tensors(p.first, dtype), cast_tensors(p.second, dtype)};
  }
};
template <typename... Ts>
struct CastTensors<std::tuple<Ts...>> {
  static constexpr bool holds = (CastTensors<Ts>::holds || ...);
  static std::tuple<Ts...> apply(const std::tuple<Ts...>& t, c10::ScalarType dtype) {
    return std::apply([&](const auto&... e) { return std::tuple<Ts...>(cast_tensors(e, dtype)...); }, t);
  }
};
template <typename T>
struct CastTensors<std::optional<T>> {
  static constexpr bool holds = CastTensors<T>::holds;
  static std::optional<T> apply(const std::optional<T>& o, c10::ScalarType dtype) {
    return o ? std::optional<T>(cast_tensors(*o, dtype)) : std::nullopt;
  }
};
template <typename T>
struct CastTensors<c10::List<T>> {
  static constexpr bool holds = CastTensors<T>::holds;
  static c10::List<T> apply(const c10::List<T>& l, c10::ScalarType dtype) {
    c10::List<T> out;
    out.reserve(l.size());
    for (size_t i = 0; i < l.size(); ++i) out.push_back(cast_tensors(T(l.get(i)), dtype));
    return out;
  }
};
template <typename K, typename V>
struct CastTensors<c10::Dict<K, V>> {
  static constexpr bool holds = CastTensors<V>::holds;
  static c10::Dict<K, V> apply(const c10::Dict<K, V>& d, c10::ScalarType dtype) {
    c10::Dict<K, V> out;
    for (const auto& e : d) out.insert(e.key(), cast_tensors(V(e.value()), dtype));
    return out;
  }
};
}  // namespace detail

// summon_full_params' choices (see there).
struct SummonOptions {
  bool writeback = true;
  // Other ranks gather one unit at a time and keep their shards. Under tensor parallelism "rank 0"
  // is data-parallel rank 0: the TP ranks of world ranks 0 .. TP-1 all hold the whole parameters.
  bool rank0_only = false;
};

// What a wrapped model offers whatever its type: FullyShardedDataParallel<M> adds the typed
// forward. The wrapped module stays usable as before; its parameters() are this rank's shards.
class FullyShardedDataParallelBase {
 public:
  // Gradient accumulation without communication: backward passes inside a no_sync scope keep
  // unsharded gradients locally; the first backward after it reduces everything at once.
  class NoSync {
   public:
    ~NoSync();
    NoSync(NoSync&& other) noexcept;
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    friend class FullyShardedDataParallelBase;
    explicit NoSync(detail::ShardedRoot* root);
    detail::ShardedRoot* root_;
  };
  NoSync no_sync();

  // Every parameter whole, on every rank (or on rank 0 only), for as long as the returned object
  // lives: for evaluation, inspection, export and weight surgery. Outside it a parameter holds this
  // rank's shard (a 1-D slice when F > 1). A collective: every rank calls it, at the same point,
  // outside forward and backward. With `writeback` (the default), in-place changes made to the
  // whole parameters are copied back into the shards when the scope ends; make the same change on
  // every rank: the scope's end compares the ranks' values, and a change made on some ranks only
  // is discarded on every rank and refused by the next call (forward, summon_full_params,
  // unshard, clip_grad_norm_, a checkpoint). Without it, changes are discarded (every strategy).
  // Values are the optimizer's (the master dtype, even with mixed precision); gradients stay
  // sharded. Under tensor parallelism a split parameter is whole too (its TP parts put together,
  // the tensor a FULL checkpoint holds, a padded vocabulary without its padding); with writeback
  // each TP rank keeps its part of what the scope left in it, and a change made on some TP ranks
  // only is discarded on every rank and refused as above. Collective over the TP groups too.
  class FullParams {
   public:
    ~FullParams();
    FullParams(FullParams&& other) noexcept;
    FullParams(const FullParams&) = delete;
    FullParams& operator=(const FullParams&) = delete;
    FullParams& operator=(FullParams&&) = delete;

   private:
    friend class FullyShardedDataParallelBase;
    FullParams(detail::ShardedRoot* root, bool writeback);
    detail::ShardedRoot* root_;
    bool writeback_;
  };
  FullParams summon_full_params(SummonOptions options = {});

  // Units kept gathered, as PyTorch FSDP2's unshard(): while the returned object lives, the
  // parameters of every unit (or of the units named by their module path, "" the root unit) hold
  // their whole values in the compute dtype, through forward and backward. For code that reads
  // parameter storage itself (data_ptr() in a hand-written kernel or a custom autograd Function),
  // which neither way of knowing when a unit runs can see: it would read this rank's 1-D shard, or
  // freed memory. A collective: every rank calls it at the same point, outside backward. Gradients
  // are reduced as usual and reach the parameters when the scope ends: end it before clipping and
  // the optimizer step. Inside it, after a backward, each parameter's .grad is a stand-in that a
  // step or a clip (fsdp's or libtorch's) is refused on; zero_grad() to None drops the gradients,
  // as in local training. Costs the memory of the units it holds.
  class Unsharded {
   public:
    ~Unsharded();
    Unsharded(Unsharded&& other) noexcept;
    Unsharded(const Unsharded&) = delete;
    Unsharded& operator=(const Unsharded&) = delete;
    Unsharded& operator=(Unsharded&&) = delete;

   private:
    friend class FullyShardedDataParallelBase;
    Unsharded(detail::ShardedRoot* root, std::vector<size_t> units);
    detail::ShardedRoot* root_;
    std::vector<size_t> units_;
  };
  Unsharded unshard(const std::vector<std::string>& unit_names = {});

  // The model's parameters, each once, in named_parameters() order under its first name. Build
  // optimizers from these: libtorch's own parameters() lists a tied weight under every name it is
  // registered under, and an optimizer given that list steps it twice per step.
  std::vector<at::Tensor> parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;

  // Runs `fn` as the root's forward: units are gathered as `fn`'s operators reach them and (with
  // FULL_SHARD) freed once the next one starts. For a forward that is not ModuleType::forward
  // (a wrapper typed on torch::nn::Module, a forward with more steps around it).
  template <typename Fn>
  decltype(auto) forward_with(Fn&& fn) {
    begin_forward();
    if constexpr (std::is_void_v<std::invoke_result_t<Fn>>) {
      try {
        std::forward<Fn>(fn)();
      } catch (...) {
        end_forward(false);
        throw;
      }
      end_forward(true);
    } else {
      decltype(auto) out = [&]() -> decltype(auto) {
        try {
          return std::forward<Fn>(fn)();
        } catch (...) {
          end_forward(false);
          throw;
        }
      }();
      end_forward(true);
      return out;
    }
  }

  // Clips gradients by their exact global 2-norm (over all ranks' shards) and returns that norm.
  // Parameters in Options::ignored_modules are the caller's: left out unless listed in
  // `model_parallel`, the ignored parameters of which each rank holds its own part (the rows of a
  // row-sharded table): their squares are summed over all ranks into the norm and they are scaled
  // with the rest, so that the norm is local training's. Every rank passes its part (an empty one
  // too). Ignored parameters every rank holds whole belong in none of the two: clip them yourself.
  double clip_grad_norm_(double max_norm, const std::vector<at::Tensor>& model_parallel = {});

  Metrics metrics() const;
  // Starts a new step for metrics() and timeline().
  void reset_step();
  // Counts what runs while the returned object lives as `phase` of the step (Metrics::phases, and
  // a span on the trace's "step phases" track), with the exposed communication inside it. fsdp
  // marks the root's forward, its backward and clip_grad_norm_ itself; mark the optimizer step:
  //   { auto timed = model.record_phase(fsdp::StepPhase::OPTIMIZER); optimizer.step(); }
  // and, to count the loss's own backward before the root's graph too, loss.backward() as
  // BACKWARD. Phases do not nest: inside an open phase another is not counted. The phases belong to
  // this wrapped model, not to a thread: open them on the thread that trains it (a phase another
  // thread holds open swallows the ones fsdp marks meanwhile). Exposed communication is what
  // Metrics::overlap counts (all-gathers, reductions, the rate limiter): clip_grad_norm_'s own norm
  // all-reduce is in CLIP's wall time but not in its exposed figures, and waits outside every phase
  // (summon_full_params, unshard) are in overlap only. A scope that outlives the model closes nothing.
  class PhaseScope {
   public:
    ~PhaseScope();
    PhaseScope(PhaseScope&& other) noexcept;
    PhaseScope(const PhaseScope&) = delete;
    PhaseScope& operator=(const PhaseScope&) = delete;
    PhaseScope& operator=(PhaseScope&&) = delete;

   private:
    friend class FullyShardedDataParallelBase;
    PhaseScope(std::weak_ptr<detail::ShardedRoot> root, StepPhase phase, bool opened)
        : root_(std::move(root)), phase_(phase), opened_(opened) {}
    std::weak_ptr<detail::ShardedRoot> root_;
    StepPhase phase_;
    bool opened_;
  };
  PhaseScope record_phase(StepPhase phase);
  std::vector<UnitInfo> units() const;
  // This rank's spans since the last reset_step(): each unit's forward and backward computation,
  // each collective (issue, start, end) and each blocking wait.
  std::vector<Span> timeline() const;
  // The same as a Chrome trace JSON file (Perfetto, chrome://tracing); call it after a step.
  void write_trace(const std::string& path) const;
  // The sharding factor F.
  int shard_size() const;

 protected:
  FullyShardedDataParallelBase(std::shared_ptr<torch::nn::Module> module, std::shared_ptr<Mesh> mesh,
                               Options options);
  // Mixed precision's param_dtype, which floating-point forward inputs are cast to.
  std::optional<c10::ScalarType> input_dtype() const;
  // With tensor parallelism, every forward's inputs are checked: the TP ranks of a data-parallel
  // group must give forward the same inputs (the same rows of the batch, in the same order).
  // Compares the forward's tensor arguments across the TP groups (a checksum each, one all-gather
  // over the job) and throws on every rank, naming the argument, when they differ. Tensors inside
  // other types, and forward_with's callable, are not seen here: the vocabulary-parallel embedding
  // and cross entropy check their ids and targets themselves.
  bool checks_inputs() const;
  void check_inputs(const std::vector<at::Tensor>& inputs);

 private:
  friend struct detail::RootAccess;
  void begin_forward();
  void end_forward(bool ok);  // ok = false: the forward threw
  std::shared_ptr<detail::ShardedRoot> root_;
};

// The root wrapper: owns nothing of the model but its sharding. Build it once, after marking
// inner units, before creating the optimizer.
template <typename ModuleType>
class FullyShardedDataParallel : public FullyShardedDataParallelBase {
 public:
  FullyShardedDataParallel(std::shared_ptr<ModuleType> module, std::shared_ptr<Mesh> mesh, Options options = {})
      : FullyShardedDataParallelBase(module, std::move(mesh), std::move(options)), module_(std::move(module)) {}
  FullyShardedDataParallel(const torch::nn::ModuleHolder<ModuleType>& holder, std::shared_ptr<Mesh> mesh,
                           Options options = {})
      : FullyShardedDataParallel(holder.ptr(), std::move(mesh), std::move(options)) {}

  // Runs the model's forward as the root unit. With mixed precision, floating-point tensor
  // arguments are cast to param_dtype first, also those inside std::vector, std::map,
  // std::unordered_map, std::pair, std::tuple, std::optional, c10::List and c10::Dict arguments
  // (as PyTorch casts those inside lists, tuples and dicts; the container is passed as a new one).
  // Tensors inside your own types are yours to cast: an operator that meets one beside a unit's
  // parameters of another dtype is refused by name.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    if (checks_inputs()) check_inputs({tensor_argument(args)...});
    const auto dtype = input_dtype();
    return forward_with([&]() -> decltype(auto) { return module_->forward(cast_input(dtype, std::forward<Args>(args))...); });
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) { return forward(std::forward<Args>(args)...); }

  ModuleType* operator->() const { return module_.get(); }
  const std::shared_ptr<ModuleType>& module() const { return module_; }

 private:
  template <typename T>
  static at::Tensor tensor_argument(const T& arg) {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      return arg;
    } else {
      return at::Tensor();
    }
  }
  template <typename T>
  static decltype(auto) cast_input(const std::optional<c10::ScalarType>& dtype, T&& arg) {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      if (dtype && arg.defined() && at::isFloatingType(arg.scalar_type()) && arg.scalar_type() != *dtype) {
        return at::Tensor(arg.to(*dtype));
      }
      return at::Tensor(std::forward<T>(arg));
    } else if constexpr (detail::CastTensors<std::decay_t<T>>::holds) {
      if (!dtype) return std::decay_t<T>(std::forward<T>(arg));
      return detail::CastTensors<std::decay_t<T>>::apply(arg, *dtype);
    } else {
      return std::forward<T>(arg);
    }
  }

  std::shared_ptr<ModuleType> module_;
};

template <typename M>
FullyShardedDataParallel(const torch::nn::ModuleHolder<M>&, std::shared_ptr<Mesh>, Options)
    -> FullyShardedDataParallel<M>;
template <typename M>
FullyShardedDataParallel(const torch::nn::ModuleHolder<M>&, std::shared_ptr<Mesh>)
    -> FullyShardedDataParallel<M>;

}  // namespace fsdp
