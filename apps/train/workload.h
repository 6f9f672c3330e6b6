// What fsdp-train trains: a model family with its units, its data and its objective. One per
// family of the paper's evaluation (§5): the GPT (gpt_workload.cpp), T5 (t5_workload.cpp) and the
// DHEN-like recommendation model (dhen_workload.cpp), so that the training loop, the memory plan
// and the checkpoints have one body whatever is trained.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "config.h"
#include "fsdp/mesh.h"
#include "fsdp/options.h"
#include "fsdp/tensor_parallel.h"

namespace train {

// One rank's slice of a step's global batch.
struct Batch {
  std::vector<torch::Tensor> inputs;  // what the model's forward takes, in order
  torch::Tensor targets;
  int64_t samples() const { return targets.size(0); }
};

class Workload {
 public:
  virtual ~Workload() = default;
  // "GPT 'default'", for the log.
  virtual std::string name() const = 0;
  virtual int64_t num_parameters() const = 0;
  // Tokens (or examples) one sequence of a batch counts for the throughput column, and what they
  // are called there ("tok", "samples").
  virtual int64_t tokens_per_sample() const = 0;
  virtual const char* throughput_unit() const { return "tok"; }
  // "16 x 256 tok", "256 samples": a global batch, for the log.
  std::string batch_text(int64_t global_batch) const {
    const std::string n = std::to_string(global_batch), unit = throughput_unit();
    return tokens_per_sample() == 1 ? n + " " + unit : n + " x " + std::to_string(tokens_per_sample()) + " " + unit;
  }
  // What the data is, for the log ("corpus /usr/share/common-licenses (262 K tokens)").
  virtual std::string data_origin() const = 0;

  // The model, initialized from the global RNG (the caller seeds it). Called plain, inside
  // fsdp::deferred_init or inside fsdp::meta_init. `mesh`: the job's ranks, for a model with
  // model-parallel parts (null: one process holding everything, local training and plans).
  // `layers` > 0: only that many of the model's blocks (--simulate-layers' sample; throws where
  // the workload cannot sample).
  virtual std::shared_ptr<torch::nn::Module> build(const std::shared_ptr<fsdp::Mesh>& mesh, int64_t layers = 0) const = 0;
  // The units (auto-wrap policy), what fsdp must leave alone (ignored modules) and the memory
  // budget's activation estimate for `micro_batch` samples in a compute dtype of `element_size`
  // bytes. `model` is the one build() returned.
  virtual void configure(fsdp::Options& options, torch::nn::Module& model, int64_t micro_batch, int64_t element_size,
                         bool checkpointed) const = 0;
  // Activation checkpointing of the model's repeated blocks (--activation-checkpointing).
  virtual void apply_checkpointing(torch::nn::Module& model) const = 0;

  // Samples [begin, end) of step `step`'s global batch: the same global batch on every rank, each
  // keeping its slice. Negative steps are held-out batches (evaluation).
  virtual Batch batch(int64_t step, int64_t global_batch, uint64_t seed, int64_t begin, int64_t end) const = 0;
  // The model's output on `b` (inputs already on the model's device). `input_dtype`: mixed
  // precision's compute dtype, which floating-point inputs are cast to.
  virtual torch::Tensor forward(torch::nn::Module& model, const Batch& b,
                                std::optional<c10::ScalarType> input_dtype) const = 0;
  // The mean loss of `out` (the output of `model`) over the batch.
  virtual torch::Tensor loss(torch::nn::Module& model, const torch::Tensor& out, const Batch& b) const = 0;
  // --tp: which of the model's parameters tensor parallelism splits (fsdp::parallelize). Throws
  // std::invalid_argument for a workload without one.
  virtual std::vector<fsdp::TensorParallelRule> tensor_parallel_plan() const {
    throw std::invalid_argument("--tp: " + name() + " has no tensor-parallel plan (the GPT and T5 have); drop --tp");
  }
  // How many held-out samples an evaluation (--eval-every) reads: a multiple of `global_batch`.
  virtual int64_t eval_samples(int64_t global_batch) const { return global_batch; }
  // Besides the loss, what an evaluation reports (the DHEN's AUC), by name: from every rank's
  // outputs and targets of the held-out batch, concatenated. Empty when nothing more.
  virtual std::map<std::string, double> evaluate(const torch::Tensor& outputs, const torch::Tensor& targets) const {
    (void)outputs;
    (void)targets;
    return {};
  }
  // The whole model's training FLOPs over those of a sample of `layers` blocks: how
  // --simulate-layers scales the sample's step time to the whole model's.
  virtual double flops_scale(int64_t layers) const = 0;
  // The blocks --simulate-layers samples from (0: the workload cannot be sampled).
  virtual int64_t blocks() const { return 0; }
  // As a language model on byte-level text, for the sample at the end of a run (text_sample.cpp):
  // its window in tokens, the model's forward returning logits [B, T, V] of each next token.
  // 0: this workload writes no text (T5, the DHEN-like model, a GPT trained on token ids).
  virtual int64_t text_context() const { return 0; }
  // The classes of those logits (the vocabulary); under --tp the gathered logits of a padded
  // vocabulary hold more, which the sample leaves out.
  virtual int64_t vocabulary() const { return 0; }
  // The parameters outside fsdp that each rank holds its own part of (the DHEN's rows), which
  // clipping's global norm sums over the ranks. Empty for models fsdp holds whole.
  virtual std::vector<torch::Tensor> model_parallel_parameters(torch::nn::Module& model) const {
    (void)model;
    return {};
  }
};

// The workload --model names: a GPT preset, t5-* or dhen-*. Reads the data it needs (the corpus
// for the GPT and T5). Throws std::invalid_argument for an unknown name.
std::unique_ptr<Workload> make_workload(const Config& c);
// The global batch --model trains on when --global-batch-size is not given: 16 sequences for the
// GPT and T5, 256 examples for the DHEN-like model (clicks are small; its stated target is for 256).
int64_t default_global_batch(const std::string& model);
std::unique_ptr<Workload> gpt_workload(const Config& c);
std::unique_ptr<Workload> t5_workload(const Config& c);
std::unique_ptr<Workload> dhen_workload(const Config& c);

}  // namespace train
