// The GPT (models/gpt.h) as fsdp-train's workload: next-token prediction on a text corpus, the
// blocks as units.
#include "fsdp/activation_checkpoint.h"
#include "models/data.h"
#include "models/gpt.h"
#include "workload.h"

namespace train {
namespace {

class GPTWorkload final : public Workload {
 public:
  GPTWorkload(const Config& c) : data_(models::TokenSource::from_path(c.data)), cfg_(model_config(c, data_)), name_(c.model) {}

  std::string name() const override { return "GPT '" + name_ + "'"; }
  int64_t num_parameters() const override { return cfg_.num_parameters(); }
  int64_t tokens_per_sample() const override { return cfg_.block_size; }
  std::string data_origin() const override {
    return "corpus " + data_.origin() + " (" + std::to_string(data_.size()) + " tokens)";
  }

  std::shared_ptr<torch::nn::Module> build(const std::shared_ptr<fsdp::Mesh>&, int64_t layers) const override {
    models::GPTConfig cfg = cfg_;
    if (layers > 0) cfg.n_layer = layers;
    return models::GPT(cfg).ptr();
  }
  void configure(fsdp::Options& options, torch::nn::Module&, int64_t micro_batch, int64_t element_size,
                 bool checkpointed) const override {
    options.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
    options.memory_budget.activation_bytes = cfg_.activation_bytes(micro_batch, cfg_.block_size, element_size, checkpointed);
    options.memory_budget.head_activation_bytes = cfg_.head_activation_bytes(micro_batch, cfg_.block_size, element_size);
  }
  void apply_checkpointing(torch::nn::Module& model) const override {
    fsdp::apply_activation_checkpointing(model, fsdp::checkpoint_modules_of_type<models::BlockImpl>());
  }

  Batch batch(int64_t step, int64_t global_batch, uint64_t seed, int64_t begin, int64_t end) const override {
    // Held-out batches (negative steps) come from another seed's offsets.
    auto [x, y] = data_.batch(step, global_batch, cfg_.block_size, step < 0 ? seed + 1 : seed, begin, end);
    return Batch{{x}, y};
  }
  torch::Tensor forward(torch::nn::Module& model, const Batch& b, std::optional<c10::ScalarType>) const override {
    return static_cast<models::GPTImpl&>(model).forward(b.inputs[0]);  // token ids: nothing to cast
  }
  torch::Tensor loss(torch::nn::Module& model, const torch::Tensor& out, const Batch& b) const override {
    return static_cast<models::GPTImpl&>(model).loss(out, b.targets);  // vocabulary-parallel under --tp
  }
  std::vector<fsdp::TensorParallelRule> tensor_parallel_plan() const override { return models::gpt_tensor_parallel_plan(cfg_, cfg_.tensor_parallel); }

  // Training FLOPs per token (forward and backward: 3 x the forward's 2 per weight, and
  // attention's two T x d products per layer).
  int64_t blocks() const override { return cfg_.n_layer; }
  // Text when the corpus is bytes (a .u16 corpus holds ids of a tokenizer fsdp-train does not know).
  int64_t text_context() const override { return data_.vocab_size() == 256 ? cfg_.block_size : 0; }
  int64_t vocabulary() const override { return cfg_.vocab_size; }
  double flops_scale(int64_t layers) const override {
    auto per_token = [&](double L) {
      const double d = static_cast<double>(cfg_.d_model);
      return 6.0 * (12.0 * L * d * d + static_cast<double>(cfg_.vocab_size) * d) +
             12.0 * L * static_cast<double>(cfg_.block_size) * d;
    };
    return per_token(static_cast<double>(cfg_.n_layer)) / per_token(static_cast<double>(layers));
  }

 private:
  models::TokenSource data_;
  models::GPTConfig cfg_;
  std::string name_;
};

}  // namespace

std::unique_ptr<Workload> gpt_workload(const Config& c) { return std::make_unique<GPTWorkload>(c); }

int64_t default_global_batch(const std::string& model) { return model.rfind("dhen-", 0) == 0 ? 256 : 16; }

std::unique_ptr<Workload> make_workload(const Config& c) {
  if (c.n_kv_head > 0 && (c.model.rfind("t5-", 0) == 0 || c.model.rfind("dhen-", 0) == 0)) {
    throw std::invalid_argument("--n-kv-head: grouped-query attention is the GPT's; " + c.model + " has none. Drop it");
  }
  if (c.vocab_size > 0 && (c.model.rfind("t5-", 0) == 0 || c.model.rfind("dhen-", 0) == 0)) {
    throw std::invalid_argument("--vocab-size sets the GPT's vocabulary; " + c.model + " has its own. Drop it");
  }
  if (c.model.rfind("t5-", 0) == 0) return t5_workload(c);
  if (c.model.rfind("dhen-", 0) == 0) return dhen_workload(c);
  models::GPTConfig::preset(c.model);  // throws, naming the presets, for an unknown name
  return gpt_workload(c);
}

}  // namespace train
