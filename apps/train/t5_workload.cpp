// T5 (models/t5.h) as fsdp-train's workload: a sequence-to-sequence objective on the text corpus
// (models::t5_reverse_task: the decoder writes the source sequence reversed, reading it shifted
// right; teacher forcing), the encoder and decoder blocks as units.
#include <stdexcept>

#include "fsdp/activation_checkpoint.h"
#include "models/data.h"
#include "models/gpt.h"
#include "models/t5.h"
#include "workload.h"

namespace train {
namespace {

// The sequence length when --block-size does not give one: long enough that reversing it needs
// the relative position buckets, short enough for this machine's small presets.
constexpr int64_t kDefaultLength = 64;

class T5Workload final : public Workload {
 public:
  explicit T5Workload(const Config& c)
      : data_(models::TokenSource::from_path(c.data)), cfg_(models::T5Config::preset(c.model)), name_(c.model),
        length_(c.block_size > 0 ? c.block_size : kDefaultLength) {
    cfg_.dropout = c.dropout;
    cfg_.tensor_parallel = c.tp;
    sequence_parallel_ = c.sequence_parallel && c.tp > 1;
    if (data_.vocab_size() > cfg_.vocab_size) {
      // The paper's presets have T5's 32128-token vocabulary; a byte corpus fits every preset.
      cfg_.vocab_size = data_.vocab_size();
    }
    if (c.attention != "fused") {
      throw std::invalid_argument("--attention reference: T5 has only the fused form; drop --attention");
    }
  }

  std::string name() const override { return "T5 '" + name_ + "'"; }
  int64_t num_parameters() const override { return cfg_.num_parameters(); }
  // Source and target tokens both count.
  int64_t tokens_per_sample() const override { return 2 * length_; }
  std::string data_origin() const override {
    return "corpus " + data_.origin() + " (" + std::to_string(data_.size()) + " tokens), objective: reverse " +
           std::to_string(length_) + "-token sequences";
  }

  std::shared_ptr<torch::nn::Module> build(const std::shared_ptr<fsdp::Mesh>&, int64_t layers) const override {
    if (layers > 0) throw std::invalid_argument("--simulate-layers samples the GPT's blocks; T5 runs whole");
    return models::T5(cfg_).ptr();
  }
  void configure(fsdp::Options& options, torch::nn::Module&, int64_t micro_batch, int64_t element_size,
                 bool checkpointed) const override {
    options.auto_wrap_policy = fsdp::module_type_policy<models::T5EncoderBlockImpl, models::T5DecoderBlockImpl>();
    options.memory_budget.activation_bytes = cfg_.activation_bytes(micro_batch, length_, length_, element_size, checkpointed);
    options.memory_budget.head_activation_bytes = cfg_.head_activation_bytes(micro_batch, length_, element_size);
  }
  void apply_checkpointing(torch::nn::Module& model) const override {
    fsdp::apply_activation_checkpointing(
        model, [](const torch::nn::Module& m) {
          return dynamic_cast<const models::T5EncoderBlockImpl*>(&m) || dynamic_cast<const models::T5DecoderBlockImpl*>(&m);
        });
  }

  Batch batch(int64_t step, int64_t global_batch, uint64_t seed, int64_t begin, int64_t end) const override {
    auto [src, unused] = data_.batch(step, global_batch, length_, step < 0 ? seed + 1 : seed, begin, end);
    auto [tgt_in, target] = models::t5_reverse_task(src);
    return Batch{{src, tgt_in}, target};
  }
  torch::Tensor forward(torch::nn::Module& model, const Batch& b, std::optional<c10::ScalarType>) const override {
    return static_cast<models::T5Impl&>(model).forward(b.inputs[0], b.inputs[1]);  // token ids: nothing to cast
  }
  torch::Tensor loss(torch::nn::Module& model, const torch::Tensor& out, const Batch& b) const override {
    return static_cast<models::T5Impl&>(model).loss(out, b.targets);  // vocabulary-parallel under --tp
  }
  std::vector<fsdp::TensorParallelRule> tensor_parallel_plan() const override { return models::t5_tensor_parallel_plan(sequence_parallel_); }
  double flops_scale(int64_t) const override { return 0; }

 private:
  models::TokenSource data_;
  models::T5Config cfg_;
  std::string name_;
  int64_t length_;
  bool sequence_parallel_ = false;
};

}  // namespace

std::unique_ptr<Workload> t5_workload(const Config& c) { return std::make_unique<T5Workload>(c); }

}  // namespace train
