// The loop fuzzer's models and references (fuzz.cpp drives them).
//
// FuzzNet<Out>: the tiny GPT (typed members, a tied weight) or the uneven net (an unused
// parameter), behind a forward that returns `Out`: a Tensor, a std::pair, a struct, a std::map, a
// torch::Dict, an IValue tuple, or nested containers. Whether backward will come must not depend
// on that type.
//
// References: what the same sequence of calls does without fsdp.
//   LocalReference   fp32: local training, one model on the whole global batch (the oracle).
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

// The network inside every FuzzNet, and what its loss is.
struct Core {
  bool gpt = true;
  std::shared_ptr<torch::nn::Module> module;
  torch::Tensor run(const torch::Tensor& x) const;
  // Inputs and targets of rows [begin, end) of global batch `batch`.
  std::pair<torch::Tensor, torch::Tensor> data(int64_t batch, int64_t begin, int64_t end) const;
  torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& target) const;
  fsdp::WrapPolicy policy() const;
};
Core make_core(bool gpt);  // built from torch::manual_seed(0)

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
  explicit FuzzNetImpl(bool gpt) : core(make_core(gpt)) { register_module("core", core.module); }
  Out forward(const torch::Tensor& x) { return pack<Out>(core.run(x)); }
  Core core;
};

using NestedOut = std::vector<std::pair<std::string, std::vector<torch::Tensor>>>;

// What the fuzzer compares fsdp against. Every call mirrors one the fuzzer makes on fsdp.
class Reference {
 public:
  virtual ~Reference() = default;
  // The global batch's mean loss for `batch` (as the mean of the ranks' slice means), keeping the
  // graph for a later backward when `grad`.
  virtual double forward(int64_t batch, bool grad) = 0;
  virtual void drop_graph() = 0;  // the last forward's graph is never backwarded
  // Backward of the sum of the pending losses; they stay pending when `retain`.
  virtual void backward(bool retain, bool no_sync) = 0;
  virtual void zero_grad(bool set_to_none) = 0;
  virtual void step() = 0;
  virtual void clip(double max_norm) = 0;
  // Parameter values and gradients by name (undefined gradient: None).
  virtual std::map<std::string, torch::Tensor> params() = 0;
  virtual std::map<std::string, torch::Tensor> grads() = 0;
};

std::unique_ptr<Reference> make_reference(bool gpt, int world_size, const std::optional<fsdp::MixedPrecision>& mp,
                                          double lr);

}  // namespace worker::fuzz
