#include "fsdp/activation_checkpoint.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/custom_class.h>

#include "engine/param_key.h"
#include "engine/touch_detection.h"
#include "tensor_parallel/rng_tracker.h"

namespace fsdp {
namespace {

// The default generators a call can draw from (the CPU's, and each CUDA device its inputs are on)
// and their states at the call.
struct RngStates {
  std::vector<std::pair<at::Generator, at::Tensor>> saved;

  static RngStates capture(const std::vector<at::Tensor>& inputs) {
    std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
    for (const auto& t : inputs) {
      if (t.defined() && t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
        devices.push_back(t.device());
      }
    }
    RngStates r;
    for (const c10::Device& d : devices) {
      at::Generator g = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(g.mutex());
      r.saved.emplace_back(g, g.get_state());
    }
    // The TP ranks' own streams (fsdp::seed_tensor_parallel_rng), which dropout on split
    // activations draws from inside a TensorParallelRngScope: recomputed masks must be the same too.
    for (auto& [name, g] : detail::tensor_parallel_generators()) {
      std::lock_guard<std::mutex> lock(g.mutex());
      r.saved.emplace_back(g, g.get_state());
    }
    return r;
  }
  void restore() const {
    for (const auto& [g, state] : saved) {
      at::Generator gen = g;
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
};

// Recomputes under the states saved at the call, and puts the generators back afterwards: the
// rest of backward (and the next iteration) draws what it would have drawn without checkpointing.
class RngFork {
 public:
  explicit RngFork(const RngStates& at_call) {
    std::vector<at::Tensor> none;
    now_ = RngStates::capture(none);
    for (const auto& [g, state] : at_call.saved) {
      if (!g.device().is_cpu()) {
        at::Generator gen = g;
        std::lock_guard<std::mutex> lock(gen.mutex());
        now_.saved.emplace_back(gen, gen.get_state());
      }
    }
    at_call.restore();
  }
  ~RngFork() { now_.restore(); }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngStates now_;
};

struct CheckpointState : torch::CustomClassHolder {
  TensorsFn fn;
  size_t num_inputs = 0;  // the caller's
  bool anchored = false;  // an anchor follows them (see checkpoint())
  RngStates rng;
  // Under fsdp: the nodes that will accumulate the gradients of the parameters the forward
  // touched, kept as a graph through them would keep them (touch_detection.h).
  std::vector<std::shared_ptr<void>> accumulators;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<CheckpointState> state, at::TensorList all) {
    std::vector<at::Tensor> inputs(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(state->num_inputs));
    ctx->save_for_backward(inputs);
    state->rng = RngStates::capture(inputs);
    std::vector<at::Tensor> outputs;
    {
      touch::CheckpointScope scope(touch::CheckpointScope::FORWARD, &state->accumulators);
      outputs = state->fn(inputs);
    }
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    // Fresh leaves with the inputs' values: what the recomputation builds ends at them, and their
    // .grad is what this node returns.
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& saved : ctx->get_saved_variables()) {
      at::Tensor leaf = saved.detach();
      leaf.requires_grad_(saved.requires_grad());
      inputs.push_back(leaf);
    }
    std::vector<at::Tensor> outputs;
    {
      RngFork fork(state->rng);
      at::AutoGradMode grad_mode(true);
      touch::CheckpointScope scope(touch::CheckpointScope::RECOMPUTE);
      outputs = state->fn(inputs);
    }
    TORCH_CHECK(outputs.size() == grad_outputs.size(), "fsdp::checkpoint: the recomputation returned ", outputs.size(),
                " tensors, the forward ", grad_outputs.size(), "; the checkpointed function must do the same when rerun");
    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    // Parameters receive their gradients here, through their own accumulators (and fsdp's hooks).
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    // One slot per argument of forward: none for the state, then the inputs', then the anchor's.
    torch::autograd::variable_list result{at::Tensor()};
    for (const at::Tensor& leaf : inputs) result.push_back(leaf.requires_grad() ? leaf.grad() : at::Tensor());
    if (state->anchored) result.emplace_back();
    // Its graph is spent, unless kept to be backwarded again: as a graph's, they go with it.
    if (!torch::autograd::get_current_graph_task_keep_graph()) state->accumulators.clear();
    return result;
  }
};

std::mutex g_marks_mutex;
// Marked modules, by address; the weak pointer tells a live module from a new one at the same address.
std::unordered_map<const torch::nn::Module*, std::weak_ptr<torch::nn::Module>> g_marks;

}  // namespace

std::vector<torch::Tensor> checkpoint(const TensorsFn& fn, const std::vector<torch::Tensor>& inputs) {
  bool any_requires_grad = false;
  for (const auto& t : inputs) any_requires_grad = any_requires_grad || (t.defined() && t.requires_grad());
  if (!at::GradMode::is_enabled()) return fn(inputs);
  // A parameter passed as an input (a learned gate, T5's position bias): autograd records each
  // input's shape when the function is applied, before `fn` touches anything, and a parameter
  // whose unit is not gathered yet holds this rank's 1-D shard then; the whole gradient backward
  // returns for it would not fit that shape. Touched here first (recording nothing), its unit is
  // gathered and the input is whole, as without fsdp.
  if (touch::in_root_pass()) {
    at::NoGradGuard no_grad;
    for (const auto& t : inputs) {
      if (param_key::has_key(t)) (void)t.alias();
    }
  }
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = fn;
  state->num_inputs = inputs.size();
  std::vector<at::Tensor> all = inputs;
  // When no input needs a gradient, autograd would record no node at all and the parameters
  // inside would get none (torch.utils.checkpoint's re-entrant pitfall): an empty leaf that
  // requires grad makes the node, and it receives no gradient.
  const bool anchored = !any_requires_grad;
  if (anchored) all.push_back(at::empty({0}).requires_grad_(true));
  state->anchored = anchored;
  return CheckpointFunction::apply(state, at::TensorList(all));
}

torch::Tensor checkpoint(const TensorFn& fn, const torch::Tensor& input) {
  // By value: backward calls it again, long after this call has returned.
  auto outputs = checkpoint([fn](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{fn(in[0])}; },
                            std::vector<torch::Tensor>{input});
  return outputs[0];
}

int apply_activation_checkpointing(torch::nn::Module& model, const CheckpointPolicy& policy) {
  std::vector<std::shared_ptr<torch::nn::Module>> modules = model.modules(/*include_self=*/false);
  if (policy(model)) modules.insert(modules.begin(), model.shared_from_this());
  std::lock_guard<std::mutex> lock(g_marks_mutex);
  int marked = 0;
  for (const auto& m : modules) {
    if (m.get() != &model && !policy(*m)) continue;
    g_marks[m.get()] = m;
    ++marked;
  }
  return marked;
}

void remove_activation_checkpointing(torch::nn::Module& model) {
  std::lock_guard<std::mutex> lock(g_marks_mutex);
  g_marks.erase(&model);
  for (const auto& m : model.modules(/*include_self=*/false)) g_marks.erase(m.get());
}

bool is_checkpointed(const torch::nn::Module& module) {
  std::lock_guard<std::mutex> lock(g_marks_mutex);
  auto it = g_marks.find(&module);
  if (it == g_marks.end()) return false;
  if (it->second.lock().get() == &module) return true;
  g_marks.erase(it);  // that module is gone; another now lives at its address
  return false;
}

torch::Tensor checkpointable(const torch::nn::Module& module, const TensorFn& fn, const torch::Tensor& input) {
  return is_checkpointed(module) ? checkpoint(fn, input) : fn(input);
}

std::vector<torch::Tensor> checkpointable(const torch::nn::Module& module, const TensorsFn& fn,
                                          const std::vector<torch::Tensor>& inputs) {
  return is_checkpointed(module) ? checkpoint(fn, inputs) : fn(inputs);
}

}  // namespace fsdp
