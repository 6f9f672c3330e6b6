// A DHEN-like click-through-rate model (Zhang et al. 2022, "DHEN: A Deep and Hierarchical
// Ensemble Network for Large-Scale Click-Through Rate Prediction"), shaped as in the paper's
// evaluation: sparse embeddings, model-parallel outside FSDP (models/row_sharded_embedding.h),
// feeding stacked dense interaction layers (DHENLayer, the FSDP unit) that FSDP shards.
//
//   tokens X [B, T = n_sparse + 1, dim]: the n_sparse embeddings and dense_proj(dense features)
//   n_layer x DHENLayer: an ensemble of attention, DCN-style cross and MLP on the same X, mixed
//   head: flatten [B, T * dim] -> Linear -> ReLU -> Linear -> logits [B]
#pragma once

#include "models/row_sharded_embedding.h"

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <string>

namespace models {

struct DHENConfig {
  int64_t n_dense = 8;   // dense (float) features
  int64_t n_sparse = 8;  // embedding tables, one categorical feature each
  int64_t rows = 1000;   // rows per table
  int64_t dim = 32;      // embedding and token width
  int64_t n_layer = 2;
  int64_t n_head = 2;    // attention heads; must divide dim
  int64_t d_hidden = 64; // the layers' MLP and the head's hidden width
  double dropout = 0.0;  // on each layer's mixed output, before the residual

  int64_t tokens() const { return n_sparse + 1; }
  // Analytic parameter counts of DHEN(*this): all = embedding (the whole logical table, all
  // ranks together) + dense (dense_proj, the layers and the head: what FSDP shards).
  int64_t num_parameters() const;
  int64_t embedding_parameters() const;
  int64_t dense_parameters() const;
  // Bytes autograd saves for backward in one training step of `batch` samples (this rank's
  // slice), in a compute dtype of `element_size` bytes; index tensors count 8 bytes and
  // LayerNorm / attention statistics 4 (fp32). Counted tensor by tensor from DHENImpl::forward
  // (dhen.cpp says which); the loss's own few [batch] tensors are left out. `checkpointed`: every
  // DHENLayer under activation checkpointing (each keeps only its input; one layer's activations
  // exist again while backward recomputes it).
  int64_t activation_bytes(int64_t batch, int64_t element_size, bool checkpointed = false) const;

  // "dhen-tiny" (tests), "dhen-small" (training default on a CPU), "dhen-medium" (the paper's
  // Figs. 7a / 8a here: 3.9 M dense, 6.7 M embedding parameters), "dhen-large" (2.8 M dense,
  // 333 M embedding parameters: tables bigger than the dense part, as in the paper). Throws
  // std::invalid_argument listing the valid names otherwise.
  static DHENConfig preset(const std::string& name);
};

// One DHEN layer: three interaction modules applied to the same X [B, T, dim], their outputs
// concatenated on the feature axis and mixed: X_out = LayerNorm(X + dropout(mix([attn, cross, mlp]))).
struct DHENLayerImpl : torch::nn::Module {
  DHENLayerImpl(int64_t dim, int64_t n_head, int64_t d_hidden, double dropout = 0.0);
  torch::Tensor forward(const torch::Tensor& x);

  int64_t n_head;
  double dropout;
  // Registration order: the declaration order below.
  torch::nn::Linear qkv{nullptr}, attn_out{nullptr};  // (i) multi-head self-attention over T tokens
  torch::nn::Linear cross{nullptr};                    // (ii) x * cross(x) + x, per token
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};        // (iii) per-token MLP
  torch::nn::Linear mix{nullptr};                      // 3 * dim -> dim
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(DHENLayer);

struct DHENImpl : torch::nn::Module {
  // Initialization is deterministic from the global torch RNG (torch::manual_seed first) and
  // identical at every world size: the whole sparse table is drawn first (then each rank keeps
  // its rows), then the dense modules with libtorch's default Linear initialization in
  // registration order, LayerNorms at ones / zeros. group null: one process holds everything.
  explicit DHENImpl(const DHENConfig& cfg, c10::intrusive_ptr<c10d::Backend> group = {}, int rank = 0,
                    int world_size = 1);
  // dense: float [B, n_dense]; ids: int64 [B, n_sparse] (ids[b][t] in [0, rows)) -> logits [B].
  // With a group of W > 1 this is a collective (the embedding's all-to-all), in backward too.
  torch::Tensor forward(const torch::Tensor& dense, const torch::Tensor& ids);

  DHENConfig cfg;
  // Registration order (and hence named_parameters() order) is the declaration order below.
  RowShardedEmbedding sparse{nullptr};
  torch::nn::Linear dense_proj{nullptr};  // n_dense -> dim: the dense features' token
  torch::nn::ModuleList layers{nullptr};  // of DHENLayer
  torch::nn::Sequential head{nullptr};    // Linear(T * dim, d_hidden), ReLU, Linear(d_hidden, 1)
};
TORCH_MODULE(DHEN);

// Mean binary cross entropy of logits [B] against labels [B] (float 0 / 1).
torch::Tensor click_loss(const torch::Tensor& logits, const torch::Tensor& labels);

}  // namespace models
