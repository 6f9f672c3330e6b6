#include "checkpoint/optimizer_state.h"

#include <stdexcept>
#include <tuple>

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "fsdp/fused_optimizer.h"

namespace fsdp {
namespace {

// One optimizer class: its options and per-parameter state types, and how to read and write
// each named tensor. `Traits` supplies name, keys, tensor access, step access and the options'
// fields; the rest is the same for every class.
template <typename OptionsT, typename StateT, typename Traits>
class Adapter final : public OptimizerStateAdapter {
 public:
  std::string name() const override { return Traits::kName; }
  std::vector<std::string> tensor_keys() const override { return Traits::keys(); }

  ParamOptimState get(torch::optim::Optimizer& optimizer, const at::Tensor& param) const override {
    ParamOptimState out;
    auto it = optimizer.state().find(param.unsafeGetTensorImpl());
    if (it == optimizer.state().end()) return out;
    auto& s = static_cast<StateT&>(*it->second);
    out.present = true;
    out.step = Traits::step(s);
    for (const auto& key : Traits::keys()) {
      const at::Tensor& t = Traits::tensor(s, key);
      if (t.defined()) out.tensors[key] = t;
    }
    return out;
  }

  void set(torch::optim::Optimizer& optimizer, const at::Tensor& param, const ParamOptimState& state) const override {
    auto& map = optimizer.state();
    if (!state.present) {
      map.erase(param.unsafeGetTensorImpl());
      return;
    }
    auto s = std::make_unique<StateT>();
    Traits::set_step(*s, state.step);
    for (const auto& [key, t] : state.tensors) Traits::set_tensor(*s, key, t);
    map[param.unsafeGetTensorImpl()] = std::move(s);
  }

  nlohmann::json group_options(torch::optim::OptimizerParamGroup& group) const override {
    return Traits::to_json(static_cast<OptionsT&>(group.options()));
  }

  void set_group_options(torch::optim::OptimizerParamGroup& group, const nlohmann::json& j) const override {
    try {
      Traits::from_json(static_cast<OptionsT&>(group.options()), j);
    } catch (const nlohmann::json::exception& e) {
      throw std::invalid_argument(std::string("fsdp: the checkpoint's ") + Traits::kName +
                                  " hyper-parameters are incomplete or malformed: " + e.what() + " in " + j.dump());
    }
  }
};

const at::Tensor& pick(const std::string& key, std::initializer_list<std::pair<const char*, const at::Tensor*>> m) {
  for (const auto& [k, t] : m) {
    if (key == k) return *t;
  }
  throw std::invalid_argument("fsdp: unknown optimizer state tensor \"" + key + "\"");
}

// Adam and AdamW keep the same state and options (weight decay differs only in how it is applied).
template <typename OptionsT, typename StateT, const char* Name>
struct AdamTraits {
  static constexpr const char* kName = Name;
  static std::vector<std::string> keys() { return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}; }
  static const at::Tensor& tensor(const StateT& s, const std::string& key) {
    return pick(key, {{"exp_avg", &s.exp_avg()}, {"exp_avg_sq", &s.exp_avg_sq()}, {"max_exp_avg_sq", &s.max_exp_avg_sq()}});
  }
  static void set_tensor(StateT& s, const std::string& key, const at::Tensor& t) {
    if (key == "exp_avg") s.exp_avg(t);
    else if (key == "exp_avg_sq") s.exp_avg_sq(t);
    else s.max_exp_avg_sq(t);
  }
  static int64_t step(const StateT& s) { return s.step(); }
  static void set_step(StateT& s, int64_t v) { s.step(v); }
  static nlohmann::json to_json(const OptionsT& o) {
    return {{"lr", o.lr()}, {"betas", {std::get<0>(o.betas()), std::get<1>(o.betas())}}, {"eps", o.eps()},
            {"weight_decay", o.weight_decay()}, {"amsgrad", o.amsgrad()}};
  }
  static void from_json(OptionsT& o, const nlohmann::json& j) {
    o.lr(j.at("lr").get<double>());
    o.betas(std::make_tuple(j.at("betas").at(0).get<double>(), j.at("betas").at(1).get<double>()));
    o.eps(j.at("eps").get<double>());
    o.weight_decay(j.at("weight_decay").get<double>());
    o.amsgrad(j.at("amsgrad").get<bool>());
  }
};

constexpr char kAdam[] = "Adam";
constexpr char kAdamW[] = "AdamW";

struct SGDTraits {
  static constexpr const char* kName = "SGD";
  using S = torch::optim::SGDParamState;
  using O = torch::optim::SGDOptions;
  static std::vector<std::string> keys() { return {"momentum_buffer"}; }
  static const at::Tensor& tensor(const S& s, const std::string& key) {
    return pick(key, {{"momentum_buffer", &s.momentum_buffer()}});
  }
  static void set_tensor(S& s, const std::string&, const at::Tensor& t) { s.momentum_buffer(t); }
  static int64_t step(const S&) { return 0; }
  static void set_step(S&, int64_t) {}
  static nlohmann::json to_json(const O& o) {
    return {{"lr", o.lr()}, {"momentum", o.momentum()}, {"dampening", o.dampening()},
            {"weight_decay", o.weight_decay()}, {"nesterov", o.nesterov()}};
  }
  static void from_json(O& o, const nlohmann::json& j) {
    o.lr(j.at("lr").get<double>());
    o.momentum(j.at("momentum").get<double>());
    o.dampening(j.at("dampening").get<double>());
    o.weight_decay(j.at("weight_decay").get<double>());
    o.nesterov(j.at("nesterov").get<bool>());
  }
};

struct RMSpropTraits {
  static constexpr const char* kName = "RMSprop";
  using S = torch::optim::RMSpropParamState;
  using O = torch::optim::RMSpropOptions;
  static std::vector<std::string> keys() { return {"square_avg", "momentum_buffer", "grad_avg"}; }
  static const at::Tensor& tensor(const S& s, const std::string& key) {
    return pick(key, {{"square_avg", &s.square_avg()}, {"momentum_buffer", &s.momentum_buffer()}, {"grad_avg", &s.grad_avg()}});
  }
  static void set_tensor(S& s, const std::string& key, const at::Tensor& t) {
    if (key == "square_avg") s.square_avg(t);
    else if (key == "momentum_buffer") s.momentum_buffer(t);
    else s.grad_avg(t);
  }
  static int64_t step(const S& s) { return s.step(); }
  static void set_step(S& s, int64_t v) { s.step(v); }
  static nlohmann::json to_json(const O& o) {
    return {{"lr", o.lr()}, {"alpha", o.alpha()}, {"eps", o.eps()}, {"weight_decay", o.weight_decay()},
            {"momentum", o.momentum()}, {"centered", o.centered()}};
  }
  static void from_json(O& o, const nlohmann::json& j) {
    o.lr(j.at("lr").get<double>());
    o.alpha(j.at("alpha").get<double>());
    o.eps(j.at("eps").get<double>());
    o.weight_decay(j.at("weight_decay").get<double>());
    o.momentum(j.at("momentum").get<double>());
    o.centered(j.at("centered").get<bool>());
  }
};

struct AdagradTraits {
  static constexpr const char* kName = "Adagrad";
  using S = torch::optim::AdagradParamState;
  using O = torch::optim::AdagradOptions;
  static std::vector<std::string> keys() { return {"sum"}; }
  static const at::Tensor& tensor(const S& s, const std::string& key) { return pick(key, {{"sum", &s.sum()}}); }
  static void set_tensor(S& s, const std::string&, const at::Tensor& t) { s.sum(t); }
  static int64_t step(const S& s) { return s.step(); }
  static void set_step(S& s, int64_t v) { s.step(v); }
  static nlohmann::json to_json(const O& o) {
    return {{"lr", o.lr()}, {"lr_decay", o.lr_decay()}, {"weight_decay", o.weight_decay()},
            {"initial_accumulator_value", o.initial_accumulator_value()}, {"eps", o.eps()}};
  }
  static void from_json(O& o, const nlohmann::json& j) {
    o.lr(j.at("lr").get<double>());
    o.lr_decay(j.at("lr_decay").get<double>());
    o.weight_decay(j.at("weight_decay").get<double>());
    o.initial_accumulator_value(j.at("initial_accumulator_value").get<double>());
    o.eps(j.at("eps").get<double>());
  }
};

}  // namespace

std::unique_ptr<OptimizerStateAdapter> OptimizerStateAdapter::for_optimizer(torch::optim::Optimizer& optimizer) {
  using namespace torch::optim;
  // Exact classes only: a subclass may keep state these adapters do not know.
  const std::type_info& t = typeid(optimizer);
  // fsdp's fused optimizers keep libtorch's state and options classes under the same keys: their
  // checkpoints are AdamW's and SGD's, and load into either.
  if (t == typeid(AdamW) || t == typeid(FusedAdamW)) {
    return std::make_unique<Adapter<AdamWOptions, AdamWParamState, AdamTraits<AdamWOptions, AdamWParamState, kAdamW>>>();
  }
  if (t == typeid(Adam)) {
    return std::make_unique<Adapter<AdamOptions, AdamParamState, AdamTraits<AdamOptions, AdamParamState, kAdam>>>();
  }
  if (t == typeid(SGD) || t == typeid(FusedSGD)) return std::make_unique<Adapter<SGDOptions, SGDParamState, SGDTraits>>();
  if (t == typeid(RMSprop)) return std::make_unique<Adapter<RMSpropOptions, RMSpropParamState, RMSpropTraits>>();
  if (t == typeid(Adagrad)) return std::make_unique<Adapter<AdagradOptions, AdagradParamState, AdagradTraits>>();
  throw std::invalid_argument(std::string("fsdp: checkpoints support the optimizers SGD, Adam, AdamW, RMSprop and "
                                          "Adagrad of torch::optim, and fsdp::FusedAdamW and fsdp::FusedSGD; this one (") + t.name() +
                              ") is not supported. Save its state yourself, or checkpoint the model only (pass no "
                              "optimizer).");
}

}  // namespace fsdp
