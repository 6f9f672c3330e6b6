// The DHEN-like recommendation model (models/dhen.h) as fsdp-train's workload: click prediction on
// synthetic data with a known rule (models/click_data.h). As in the paper's DHEN (§2.3, §5), the
// embedding tables are sharded row-wise across ranks and exchanged with all-to-all, outside fsdp
// (Options::ignored_modules, declared in Options::row_sharded_parameters: checkpoints save the
// table whole); fsdp shards the dense interaction layers (the units) and the rest.
#include <cstdio>
#include <stdexcept>

#include "models/click_data.h"
#include "models/dhen.h"
#include "fsdp/activation_checkpoint.h"
#include "workload.h"

namespace train {
namespace {

// The held-out sample the Bayes-optimal figures are computed on.
constexpr int64_t kStatsSamples = 65536;

models::DHENConfig with_dropout(models::DHENConfig cfg, double dropout) {
  cfg.dropout = dropout;
  return cfg;
}

class DHENWorkload final : public Workload {
 public:
  explicit DHENWorkload(const Config& c)
      : cfg_(with_dropout(models::DHENConfig::preset(c.model), c.dropout)), data_(cfg_, c.seed), name_(c.model) {
    if (c.data != models::kDefaultCorpus) {
      throw std::invalid_argument("--data: " + c.model + " trains on synthetic clicks (models/click_data.h), not on "
                                  "a corpus; drop --data");
    }
    if (c.block_size > 0) throw std::invalid_argument("--block-size: " + c.model + " has no sequences; drop it");
  }

  std::string name() const override { return "DHEN-like '" + name_ + "'"; }
  int64_t num_parameters() const override { return cfg_.num_parameters(); }
  int64_t tokens_per_sample() const override { return 1; }  // examples: the throughput column counts samples
  const char* throughput_unit() const override { return "samples"; }
  std::string data_origin() const override {
    const models::ClickDataStats s = data_.stats(kStatsSamples);
    char text[512];
    std::snprintf(text, sizeof(text),
                  "synthetic clicks (%lld embedding rows over %lld tables, %lld dense features; %.3f clicked); "
                  "held-out Bayes-optimal loss %.4f and AUC %.4f, predicting the base rate %.4f",
                  static_cast<long long>(cfg_.rows * cfg_.n_sparse), static_cast<long long>(cfg_.n_sparse),
                  static_cast<long long>(cfg_.n_dense), s.base_rate, s.bayes_loss, s.bayes_auc, s.constant_loss);
    return text;
  }

  std::shared_ptr<torch::nn::Module> build(const std::shared_ptr<fsdp::Mesh>& mesh, int64_t layers) const override {
    if (layers > 0) throw std::invalid_argument("--simulate-layers samples the GPT's blocks; the DHEN-like model runs whole");
    if (mesh && mesh->world_size() > 1) return models::DHEN(cfg_, mesh->world(), mesh->rank(), mesh->world_size()).ptr();
    return models::DHEN(cfg_).ptr();
  }
  // Each rank's rows of the tables: clipping's norm sums them over the ranks.
  std::vector<torch::Tensor> model_parallel_parameters(torch::nn::Module& model) const override {
    return {static_cast<models::DHENImpl&>(model).sparse->weight};
  }
  void configure(fsdp::Options& options, torch::nn::Module& model, int64_t micro_batch, int64_t element_size,
                 bool checkpointed) const override {
    options.auto_wrap_policy = fsdp::module_type_policy<models::DHENLayerImpl>();
    // The tables are this rank's rows, exchanged by the model's own all-to-all: not fsdp's. Declared
    // as rows [row_begin, row_begin + local_rows) of the one logical table (all tables
    // concatenated), so that checkpoints save the table whole and a load at another world size
    // gives each rank its new rows.
    const models::RowShardedEmbedding& sparse = static_cast<models::DHENImpl&>(model).sparse;
    options.ignored_modules = {sparse.ptr()};
    options.ignored_parameters.clear();
    options.row_sharded_parameters = {{sparse->weight, sparse->row_begin(), sparse->num_tables * sparse->rows}};
    // The layers' activations; checkpointed layers keep their input and recompute one at a time
    // (an upper bound: the estimate without checkpointing).
    (void)checkpointed;
    options.memory_budget.activation_bytes = cfg_.activation_bytes(micro_batch, element_size);
    options.memory_budget.head_activation_bytes = 0;
  }
  void apply_checkpointing(torch::nn::Module& model) const override {
    fsdp::apply_activation_checkpointing(model, fsdp::checkpoint_modules_of_type<models::DHENLayerImpl>());
  }

  Batch batch(int64_t step, int64_t global_batch, uint64_t, int64_t begin, int64_t end) const override {
    // The data's seed is fixed at construction (the hidden rule is a function of it).
    auto [dense, ids, labels] = data_.batch(step, global_batch, begin, end);
    return Batch{{dense, ids}, labels};
  }
  torch::Tensor forward(torch::nn::Module& model, const Batch& b, std::optional<c10::ScalarType> input_dtype) const override {
    const torch::Tensor dense = input_dtype ? b.inputs[0].to(*input_dtype) : b.inputs[0];
    return static_cast<models::DHENImpl&>(model).forward(dense, b.inputs[1]);
  }
  torch::Tensor loss(torch::nn::Module&, const torch::Tensor& out, const Batch& b) const override { return models::click_loss(out, b.targets); }
  // An AUC needs more samples than a training batch to be worth printing.
  int64_t eval_samples(int64_t global_batch) const override { return 32 * global_batch; }
  std::map<std::string, double> evaluate(const torch::Tensor& outputs, const torch::Tensor& targets) const override {
    return {{"auc", models::auc(outputs, targets)}};
  }
  double flops_scale(int64_t) const override { return 0; }

 private:
  models::DHENConfig cfg_;
  models::ClickData data_;
  std::string name_;
};

}  // namespace

std::unique_ptr<Workload> dhen_workload(const Config& c) { return std::make_unique<DHENWorkload>(c); }

}  // namespace train
