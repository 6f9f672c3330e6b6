// The loop fuzzer's models and references (fuzz.cpp drives them).
//
// FuzzNet<Out>: the tiny GPT (typed members, a tied weight) or the uneven net (an unused
// parameter), behind a forward that returns `Out`: a Tensor, a std::pair, a struct, a std::map, a
// torch::Dict, an IValue tuple, or nested containers. Whether backward will come must not depend
// on that type. A seed's Features add what a user's model may do: an embedding that renormalizes
// its rows in forward (max_norm: an in-place write to a parameter), a frozen block that a loop
// unfreezes later, a teacher wrapped on its own and called inside the forward (nested roots), and
// the optimizer (SGD with momentum, Adam, AdamW).
//
// References: what the same sequence of calls does without fsdp.
//   LocalReference   local training, one model on the whole global batch (the oracle), in fp32;
//                    also the independent oracle of mixed-precision runs, at a looser tolerance.
//   ReplayReference  mixed precision: the casts fsdp makes, replayed on W local working copies
//                    (forward and backward of rank r's slice in param_dtype, gradients cast to
//                    reduce_dtype, divided by W, summed over ranks, cast to the fp32 master),
//                    no_sync accumulating in fp32 as fsdp does.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "worker.h"

namespace worker::fuzz {

// For each of `losses` pending losses, left by forwards that left `per_forward` each (in order):
// whether its backward must retain the graph (a later loss of the same forward still needs it).
// Losses of different forwards are backwarded without it: each forward's graph is its own.
std::vector<bool> retain_for_each(const std::vector<int>& per_forward);

// What a seed's model and loop are made of, beyond the calls.
struct Features {
  bool gpt = true;
  // The tiny DHEN-like model instead: its embedding rows sharded across the ranks outside fsdp
  // (Options::ignored_modules, the rows' own all-to-all), which clipping's norm must count.
  bool dhen = false;
  std::string optimizer = "sgd";  // sgd (momentum 0.9), adam, adamw
  bool max_norm = false;          // GPT: tok_emb renormalizes the rows it reads (max_norm 0.1) in forward
  bool frozen_block = false;      // the toggle module starts frozen (requires_grad false at wrapping)
  bool teacher = false;           // GPT: a teacher's detached logits (its own wrapper) join the output
  // The tied net instead (TiedNet): its second and third blocks (units of their own) share one
  // Linear, so a unit's weight is used by another unit, neither of them the root.
  bool tied = false;
  // A second model wrapped on its own (a GAN's generator before its discriminator): its output is
  // the core's input, computed outside the core's forward, and both train. fp32, float inputs
  // (uneven or tied net) only: the mixed-precision replay has no second root.
  bool two_roots = false;
  std::string describe() const;
  // Forces features named in a comma-separated list (--features): gpt, uneven, dhen, tied,
  // two_roots, sgd, adam, adamw.
  void force(const std::string& names);
};

// A block of the tied net: a Linear (its own, or shared with another block) and its own Linear.
struct TiedBlockImpl : torch::nn::Module {
  explicit TiedBlockImpl(torch::nn::Linear lin);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear lin{nullptr}, own{nullptr};
};
TORCH_MODULE(TiedBlock);
// [N, 16] -> [N, 16]: b0, then b1 and b2 sharing one Linear (the same holder in both), then a head.
struct TiedNetImpl : torch::nn::Module {
  TiedNetImpl();
  torch::Tensor forward(const torch::Tensor& x);
  TiedBlock b0{nullptr}, b1{nullptr}, b2{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TiedNet);

// The second root of Features::two_roots: [N, 16] -> [N, 16], two Linear units. Built from
// torch::manual_seed(2).
torch::nn::Sequential make_second_root();

// The network inside every FuzzNet, and what its loss is.
struct Core {
  bool gpt = true;
  bool dhen = false;
  bool tied = false;
  std::shared_ptr<torch::nn::Module> module;
  torch::Tensor run(const torch::Tensor& x) const;
  // Inputs and targets of rows [begin, end) of global batch `batch`.
  std::pair<torch::Tensor, torch::Tensor> data(int64_t batch, int64_t begin, int64_t end) const;
  torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& target) const;
  // A second loss on the same output (a second tower's, an auxiliary term).
  torch::Tensor aux_loss(const torch::Tensor& out) const;
  fsdp::WrapPolicy policy() const;
  // The module a loop freezes and unfreezes (a unit: the GPT's first block, the uneven net's c, the
  // DHEN's first layer).
  torch::nn::Module& toggle_module() const;
  // The DHEN's rows outside fsdp (fsdp leaves them alone; clipping counts them); none otherwise.
  std::vector<std::shared_ptr<torch::nn::Module>> ignored() const;
  std::vector<torch::Tensor> model_parallel() const;
  // This rank's rows of the DHEN's table as [first row, count]; {0, 0} otherwise.
  std::pair<int64_t, int64_t> rows() const;
};
// Built from torch::manual_seed(seed): 0 for the model, 1 for a teacher. `mesh`: the ranks the
// DHEN's rows are sharded over (null: one process holds the whole table, as the references do).
Core make_core(const Features& f, uint64_t seed = 0, const std::shared_ptr<fsdp::Mesh>& mesh = nullptr);
// The teacher's logits, detached and scaled, that a student's output adds (both sides alike).
torch::Tensor with_teacher(const torch::Tensor& student, const torch::Tensor& teacher_logits);

struct TwoHeads {
  torch::Tensor logits, aux;
};

// The output kinds, and how a loss is read back from each.
enum class OutKind { TENSOR, PAIR, STRUCT, MAP, DICT, IVALUE, NESTED };
constexpr int kOutKinds = 7;
const char* name_of(OutKind k);

template <typename Out>
Out pack(const torch::Tensor& t) {
  if constexpr (std::is_same_v<Out, torch::Tensor>) {
    return t;
  } else if constexpr (std::is_same_v<Out, std::pair<torch::Tensor, int64_t>>) {
    return {t, 7};
  } else if constexpr (std::is_same_v<Out, TwoHeads>) {
    return {t, t.detach()};
  } else if constexpr (std::is_same_v<Out, std::map<std::string, torch::Tensor>>) {
    return {{"aux", t.detach() * 2}, {"out", t}};
  } else if constexpr (std::is_same_v<Out, c10::Dict<std::string, torch::Tensor>>) {
    c10::Dict<std::string, torch::Tensor> d;
    d.insert("out", t);
    return d;
  } else if constexpr (std::is_same_v<Out, c10::IValue>) {
    return c10::ivalue::Tuple::create({c10::IValue(std::string("tag")), c10::IValue(t)});
  } else {
    return Out{{"heads", {t.detach(), t}}};
  }
}

template <typename Out>
torch::Tensor unpack(const Out& o) {
  if constexpr (std::is_same_v<Out, torch::Tensor>) {
    return o;
  } else if constexpr (std::is_same_v<Out, std::pair<torch::Tensor, int64_t>>) {
    return o.first;
  } else if constexpr (std::is_same_v<Out, TwoHeads>) {
    return o.logits;
  } else if constexpr (std::is_same_v<Out, std::map<std::string, torch::Tensor>>) {
    return o.at("out");
  } else if constexpr (std::is_same_v<Out, c10::Dict<std::string, torch::Tensor>>) {
    return o.at("out");
  } else if constexpr (std::is_same_v<Out, c10::IValue>) {
    return o.toTupleRef().elements()[1].toTensor();
  } else {
    return o.front().second.back();
  }
}

template <typename Out>
struct FuzzNetImpl : torch::nn::Module {
  FuzzNetImpl(const Features& f, const std::shared_ptr<fsdp::Mesh>& mesh) : core(make_core(f, 0, mesh)) {
    register_module("core", core.module);
  }
  // `teacher`: the teacher's logits for x (a nested wrapped model's forward), or null.
  Out forward(const torch::Tensor& x) {
    // The teacher first: the student's own operators must still reach fsdp after a nested root's
    // forward has ended.
    const torch::Tensor t = teacher ? teacher(x) : torch::Tensor();
    torch::Tensor out = core.run(x);
    if (teacher) out = with_teacher(out, t);
    return pack<Out>(out);
  }
  Core core;
  std::function<torch::Tensor(const torch::Tensor&)> teacher;
};

using NestedOut = std::vector<std::pair<std::string, std::vector<torch::Tensor>>>;

// Which forward a call makes.
enum class ForwardKind {
  GRAD,        // with grad mode, one loss
  TWO_LOSSES,  // with grad mode, a main and an auxiliary loss on the same output
  NO_GRAD,     // under NoGradGuard
  INFERENCE,   // under c10::InferenceMode
};

// What the fuzzer compares fsdp against. Every call mirrors one the fuzzer makes on fsdp.
class Reference {
 public:
  virtual ~Reference() = default;
  // The global batch's mean loss for `batch` (as the mean of the ranks' slice means), keeping the
  // graph(s) for a later backward with grad mode; TWO_LOSSES returns the main loss.
  virtual double forward(int64_t batch, ForwardKind kind) = 0;
  virtual void drop_graph() = 0;  // the last forward's losses are never backwarded
  virtual void drop_all_graphs() = 0;
  // Backward of the sum of the pending losses; they stay pending when `retain`.
  virtual void backward(bool retain, bool no_sync) = 0;
  // Each pending loss backwarded on its own, in order (graphs retained until the last).
  virtual void backward_each() = 0;
  // Backward of the pending sum with a hook on parameter `fqn` that throws; the pending losses go.
  virtual void backward_throwing_at(const std::string& fqn) = 0;
  virtual void zero_grad(bool set_to_none) = 0;
  virtual void step() = 0;
  virtual void clip(double max_norm) = 0;
  virtual void toggle_frozen() = 0;
  // Parameter values and gradients by name (undefined gradient: None).
  virtual std::map<std::string, torch::Tensor> params() = 0;
  virtual std::map<std::string, torch::Tensor> grads() = 0;
};

std::unique_ptr<Reference> make_reference(const Features& f, int world_size,
                                          const std::optional<fsdp::MixedPrecision>& mp, double lr);
// The optimizer a seed's loop uses, over `params`.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, const std::vector<torch::Tensor>& params,
                                                        double lr);

}  // namespace worker::fuzz
