// The mechanism behind deferred_init (include/fsdp/deferred_init.h): a boxed fallback for one
// dispatch key that this library includes in the thread's dispatch key set while a model is being
// built. Every operator then reaches the fallback first and is either redirected (a factory: made
// on the meta device), recorded (an in-place op on a deferred tensor), passed through (views of
// deferred tensors, ops on real tensors) or refused (ops that read a deferred tensor's values).
//
// The key is TESTING_ONLY_GenericMode: libtorch's mode key reserved for out-of-tree modes, which
// nothing else in a C++ process registers. It sits above autograd, so operators are seen as
// called, before any autograd or backend kernel.
#include "fsdp/deferred_init.h"
#include "init/deferred_init_internal.h"

#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace fsdp {
namespace {

constexpr c10::DispatchKey kDeferredKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

// One recorded operator: how to call it again on the real tensor.
struct RecordedOp {
  RecordedOp(c10::OperatorHandle op_, std::vector<c10::IValue> args_) : op(std::move(op_)), args(std::move(args_)) {}
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;  // as called; args[0] is replaced by the real target on replay
  bool factory = false;           // the op that created the tensor
  // For in-place ops: the target as a view of the whole deferred tensor.
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  // Random ops: the generator and its state right before the op.
  std::optional<at::Generator> generator;
  at::Tensor rng_state;
};

struct Recipe {
  c10::Storage storage;  // keeps the meta storage (our key) alive while the recipe exists
  std::vector<int64_t> sizes;
  c10::ScalarType dtype;
  int64_t storage_offset = 0;
  bool replayable = true;  // false for meta_init
  std::vector<RecordedOp> ops;
};

std::mutex g_mutex;
std::unordered_map<const c10::StorageImpl*, std::shared_ptr<Recipe>> g_recipes;
thread_local bool t_record = true;
thread_local bool t_active = false;

std::shared_ptr<Recipe> recipe_of(const at::Tensor& t) {
  if (!t.defined() || !t.is_meta() || !t.has_storage()) return nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_recipes.find(t.storage().unsafeGetStorageImpl());
  return it == g_recipes.end() ? nullptr : it->second;
}

bool is_random(const c10::OperatorName& name) {
  static const std::unordered_set<std::string> random_ops = {
      "aten::normal_", "aten::uniform_", "aten::bernoulli_", "aten::random_", "aten::exponential_",
      "aten::geometric_", "aten::cauchy_", "aten::log_normal_", "aten::randn", "aten::rand", "aten::randint",
      "aten::randperm", "aten::normal", "aten::bernoulli", "aten::multinomial", "aten::rand_like",
      "aten::randn_like", "aten::randint_like"};
  return random_ops.count(name.name) > 0;
}

bool is_uninitialized_factory(const c10::OperatorName& name) {
  return name.name == "aten::empty" || name.name == "aten::empty_strided" || name.name == "aten::new_empty" ||
         name.name == "aten::new_empty_strided";
}

// The generator a random op draws from: its "generator" argument, else the default CPU one
// (deferred factories are CPU factories: that is what a normal construction would have used).
at::Generator generator_of(const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args) {
  for (size_t i = 0; i < schema.arguments().size() && i < args.size(); ++i) {
    if (schema.arguments()[i].name() == "generator" && args[i].isGenerator()) return args[i].toGenerator();
  }
  return at::detail::getDefaultCPUGenerator();
}

at::Tensor snapshot(at::Generator& gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void restore(at::Generator& gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

std::string op_text(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.name + (n.overload_name.empty() ? "" : "." + n.overload_name);
}

[[noreturn]] void refuse(const c10::OperatorHandle& op, const std::string& why) {
  throw std::runtime_error("fsdp::deferred_init: the constructor calls " + op_text(op) + ", which " + why +
                           ". Deferred initialization supports constructors that create tensors and initialize "
                           "them in place (empty/zeros/randn..., normal_/uniform_/fill_/zero_/copy_ from a real "
                           "tensor); build this model normally instead.");
}

void call(const c10::OperatorHandle& op, torch::jit::Stack* stack) { op.callBoxed(stack); }

void deferred_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_reentry(kDeferredKey);
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  std::vector<c10::IValue> args(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());

  // Which arguments are deferred tensors?
  bool any_tensor = false;
  std::vector<size_t> deferred;
  for (size_t i = 0; i < args.size(); ++i) {
    auto check = [&](const at::Tensor& t) {
      if (!t.defined()) return;
      any_tensor = true;
      if (recipe_of(t)) deferred.push_back(i);
    };
    if (args[i].isTensor()) {
      check(args[i].toTensor());
    } else if (args[i].isList()) {
      for (const auto& e : args[i].toListRef()) {
        if (e.isTensor()) check(e.toTensor());
      }
    }
  }

  if (deferred.empty()) {
    // A factory (no tensor inputs, a device argument) on the CPU: make it on the meta device.
    std::optional<size_t> device_arg;
    for (size_t i = 0; i < n; ++i) {
      if (schema.arguments()[i].name() == "device") device_arg = i;
    }
    const bool cpu = device_arg && (args[*device_arg].isNone() || args[*device_arg].toDevice().is_cpu());
    const bool returns_tensor = schema.returns().size() == 1 && schema.returns()[0].type()->kind() == c10::TypeKind::TensorType;
    if (any_tensor || !device_arg || !cpu || !returns_tensor) {
      call(op, stack);  // anything else runs as usual
      return;
    }
    auto recipe = std::make_shared<Recipe>();
    recipe->replayable = t_record;
    RecordedOp rec{op, args};
    rec.factory = true;
    if (t_record && is_random(op.operator_name())) {
      // Draw from the generator exactly as the normal construction would, and remember where.
      at::Generator gen = generator_of(schema, args);
      rec.generator = gen;
      rec.rng_state = snapshot(gen);
      torch::jit::Stack real(args.begin(), args.end());
      call(op, &real);  // the values are thrown away; only the generator's advance matters
    }
    (*stack)[stack->size() - n + *device_arg] = c10::IValue(c10::Device(c10::kMeta));
    call(op, stack);
    const at::Tensor out = stack->back().toTensor();
    recipe->storage = out.storage();
    recipe->sizes = out.sizes().vec();
    recipe->dtype = out.scalar_type();
    recipe->storage_offset = out.storage_offset();
    if (t_record) recipe->ops.push_back(std::move(rec));
    std::lock_guard<std::mutex> lock(g_mutex);
    g_recipes[out.storage().unsafeGetStorageImpl()] = recipe;
    return;
  }

  // Views of deferred tensors (select, narrow, view, t, detach...): metadata only, fine on meta.
  const auto& returns = schema.returns();
  const bool view_op = !returns.empty() && returns[0].alias_info() && !returns[0].alias_info()->isWrite();
  if (view_op) {
    call(op, stack);
    return;
  }
  // An in-place op whose target (argument 0) is the only deferred tensor: record it.
  const auto* alias0 = n > 0 ? schema.arguments()[0].alias_info() : nullptr;
  const bool in_place = alias0 && alias0->isWrite() && deferred.size() == 1 && deferred[0] == 0;
  if (!in_place) refuse(op, "reads the values of a deferred tensor");
  const at::Tensor self = args[0].toTensor();
  auto recipe = recipe_of(self);
  if (recipe->replayable && t_record) {
    RecordedOp rec{op, args};
    rec.sizes = self.sizes().vec();
    rec.strides = self.strides().vec();
    rec.offset = self.storage_offset() - recipe->storage_offset;
    if (is_random(op.operator_name())) {
      at::Generator gen = generator_of(schema, args);
      rec.generator = gen;
      rec.rng_state = snapshot(gen);
      // Advance the generator as the real op would: same op, same layout, on a throw-away.
      at::Tensor scratch = at::empty(recipe->sizes, at::TensorOptions().dtype(recipe->dtype));
      torch::jit::Stack real(args.begin(), args.end());
      real[0] = scratch.as_strided(rec.sizes, rec.strides, rec.offset);
      call(op, &real);
    }
    rec.args[0] = c10::IValue();  // do not keep the meta tensor itself
    recipe->ops.push_back(std::move(rec));
  }
  call(op, stack);  // on meta: updates nothing but metadata
}

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&deferred_fallback>());
}

}  // namespace

DeferredInitGuard::DeferredInitGuard(bool record) : previous_record_(t_record), previous_active_(t_active) {
  t_record = record;
  t_active = true;
  c10::impl::tls_set_dispatch_key_included(kDeferredKey, true);
}
DeferredInitGuard::~DeferredInitGuard() {
  t_record = previous_record_;
  t_active = previous_active_;
  c10::impl::tls_set_dispatch_key_included(kDeferredKey, previous_active_);
}

bool is_deferred(const at::Tensor& t) { return recipe_of(t) != nullptr; }

NotDeferred::NotDeferred() : previous_included_(c10::impl::tls_is_dispatch_key_included(kDeferredKey)) {
  // Only deferred_init's recording mode lets go; meta_init keeps making meta tensors.
  if (t_active && t_record) c10::impl::tls_set_dispatch_key_included(kDeferredKey, false);
}
NotDeferred::~NotDeferred() { c10::impl::tls_set_dispatch_key_included(kDeferredKey, previous_included_); }

namespace {

// Runs the recipe's recorded ops into `out`, a real contiguous tensor of the recipe's shape.
void replay(const Recipe& recipe, at::Tensor& out) {
  at::NoGradGuard no_grad;
  // Replaying sets the generators to recorded states; the caller's stream of random numbers
  // continues afterwards as if nothing happened.
  std::vector<std::pair<at::Generator, at::Tensor>> saved;
  auto save = [&](const at::Generator& g) {
    for (auto& s : saved) if (s.first == g) return;
    at::Generator gen = g;
    saved.emplace_back(gen, snapshot(gen));
  };
  for (const RecordedOp& rec : recipe.ops) {
    if (rec.generator) {
      save(*rec.generator);
      at::Generator gen = *rec.generator;
      restore(gen, rec.rng_state);
    }
    torch::jit::Stack stack(rec.args.begin(), rec.args.end());
    if (rec.factory) {
      if (is_uninitialized_factory(rec.op.operator_name())) continue;  // empty: whatever bytes were there
      rec.op.callBoxed(&stack);
      out.copy_(stack.back().toTensor());
    } else {
      stack[0] = out.as_strided(rec.sizes, rec.strides, out.storage_offset() + rec.offset);
      rec.op.callBoxed(&stack);
    }
  }
  for (auto& [gen, state] : saved) restore(gen, state);
}

}  // namespace

void materialize_into(const at::Tensor& t, at::Tensor out) {
  auto recipe = recipe_of(t);
  TORCH_CHECK(recipe, "fsdp: materialize_into: the tensor was not made by deferred_init");
  TORCH_CHECK(recipe->replayable, "fsdp: this model was built with meta_init, for planning only; build it with "
                                  "deferred_init to materialize it");
  TORCH_CHECK(out.sizes() == t.sizes() && out.scalar_type() == t.scalar_type(),
              "fsdp: materialize_into: the output must have the tensor's shape and dtype");
  // Recorded views are relative to the deferred tensor, which factories make contiguous.
  TORCH_CHECK(out.is_contiguous(), "fsdp: materialize_into needs a contiguous output");
  const bool whole = t.storage_offset() == recipe->storage_offset && t.sizes().vec() == recipe->sizes && t.is_contiguous();
  if (whole) {
    replay(*recipe, out);
    return;
  }
  // A part of a bigger deferred tensor (a view the constructor registered, e.g. this rank's rows
  // of a table drawn whole): its values are those of the whole tensor's construction, whose random
  // draws are one stream that a part cannot be drawn from alone. So the whole is replayed into a
  // scratch tensor (what a normal construction holds too) and the part copied out.
  at::Tensor scratch = at::empty(recipe->sizes, out.options());
  replay(*recipe, scratch);
  at::NoGradGuard no_grad;
  out.copy_(scratch.as_strided(t.sizes(), t.strides(), t.storage_offset() - recipe->storage_offset));
}

void adopt(at::Tensor& t, const at::Tensor& value) {
  auto recipe = recipe_of(t);
  // Keep the TensorImpl (the parameter's identity: modules, optimizers and hooks hold it) and its
  // autograd state; take value's storage, sizes, device and dispatch keys.
  t.unsafeGetTensorImpl()->shallow_copy_from(value.getIntrusivePtr());
  // The recipe goes with the last tensor of its storage (several parameters may be parts of one
  // deferred tensor; each is materialized from the recipe).
  if (recipe && recipe->storage.use_count() == 1) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_recipes.erase(recipe->storage.unsafeGetStorageImpl());
  }
}

}  // namespace fsdp
