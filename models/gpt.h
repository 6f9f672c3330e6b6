// GPT-style decoder and a small irregular MLP, written the ordinary libtorch way (typed members,
// TORCH_MODULE holders). Nothing here knows about fsdp's sharding; the blocks may be checkpointed
// (fsdp/activation_checkpoint.h, plain libtorch autograd), and the GPT trains tensor-parallel
// after gpt_tensor_parallel_plan is applied (its forward calls its linear layers through
// fsdp::column_parallel / row_parallel, which are plain calls otherwise).
#pragma once

#include <torch/torch.h>

#include "fsdp/tensor_parallel.h"

#include <cstdint>
#include <string>

namespace models {

struct GPTConfig {
  int64_t vocab_size = 256;
  int64_t block_size = 128;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t d_model = 256;
  // Attention through libtorch's fused at::scaled_dot_product_attention (flash / memory-efficient
  // kernels on CUDA, a fused kernel on CPU: the T x T scores are never stored). false: written out
  // (matmul, masked_fill, softmax, matmul), the reference it is checked against.
  bool fused_attention = true;
  // Dropout on each block's attention and MLP outputs (before the residual add), as GPT-2 has it;
  // 0 (the default) draws nothing from the random number generator.
  double dropout = 0.0;
  // The tensor-parallel size activation_bytes counts for (gpt_tensor_parallel_plan): each rank
  // holds its heads' and features' share of the split layers' activations and all of the rest.
  int64_t tensor_parallel = 1;
  // (After the presets' five fields, which they set by position.) Grouped-query attention: the key/value heads, each shared by n_head / n_kv_head query heads
  // (0: as many as n_head, multi-head attention with one fused q/k/v layer). Fewer than n_head:
  // q and kv are separate layers, "q" and "kv" (the keys' rows, then the values').
  int64_t n_kv_head = 0;
  // Sequence parallelism under tensor parallelism (fsdp::TensorParallelOptions): the plan declares
  // the norms and row-parallel biases partial, and activation_bytes counts the activations between
  // the split layers as this rank's chunk of the sequence.
  bool sequence_parallel = false;

  // Analytic parameter count of GPT(*this); the tied embedding/head weight is counted once.
  int64_t num_parameters() const;
  // Bytes of activations one training step of a batch of `batch` sequences of `seq_len` tokens
  // holds at its peak (the start of backward), in a compute dtype of `element_size` bytes: what
  // autograd saves for backward, plus the loss's gradient buffers. Counted from forward() below;
  // the memory tests hold it (inside the plan) against the measured peak. `checkpointed`: every
  // block under activation checkpointing (fsdp/activation_checkpoint.h).
  int64_t activation_bytes(int64_t batch, int64_t seq_len, int64_t element_size, bool checkpointed = false) const;
  // Of those, the head's (ln_f's output, the log-softmax's output and, in the loss's backward, the
  // two gradients of that size): what backward frees first (fsdp::MemoryBudget::head_activation_bytes).
  int64_t head_activation_bytes(int64_t batch, int64_t seq_len, int64_t element_size) const;

  // "tiny", "small", "default", "medium", "large" (50 M), "1b", "175b". Throws std::invalid_argument otherwise.
  static GPTConfig preset(const std::string& name);
};

struct CausalSelfAttentionImpl : torch::nn::Module {
  // n_kv_head: GPTConfig::n_kv_head (0: n_head).
  CausalSelfAttentionImpl(int64_t d_model, int64_t n_head, bool fused = true, int64_t n_kv_head = 0);
  // x: [B, T, d_model] -> [B, T, d_model]
  torch::Tensor forward(const torch::Tensor& x);

  int64_t n_head, n_kv_head;
  bool fused;  // GPTConfig::fused_attention
  // Multi-head: qkv. Grouped-query: q and kv (qkv null).
  torch::nn::Linear qkv{nullptr}, q{nullptr}, kv{nullptr}, proj{nullptr};

 private:
  torch::Tensor grouped_query(const torch::Tensor& x);
  torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t B, int64_t T);
};
TORCH_MODULE(CausalSelfAttention);

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(int64_t d_model);
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear fc{nullptr}, proj{nullptr};
};
TORCH_MODULE(MLP);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d_model, int64_t n_head, bool fused_attention = true, double dropout = 0.0, int64_t n_kv_head = 0);
  torch::Tensor forward(const torch::Tensor& x);

  double dropout;  // GPTConfig::dropout

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(Block);

// Output projection that shares its weight with an existing tensor (weight tying). The tensor is
// registered as this module's own parameter "weight", so the owning model's named_parameters()
// lists it twice (e.g. "tok_emb.weight" and "head.weight") with one and the same TensorImpl.
struct TiedLMHeadImpl : torch::nn::Module {
  explicit TiedLMHeadImpl(torch::Tensor tied_weight);  // [vocab, d_model]
  // x: [..., d_model] -> [..., vocab]
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight;
};
TORCH_MODULE(TiedLMHead);

struct GPTImpl : torch::nn::Module {
  // Parameters are initialized deterministically from the global torch RNG: call
  // torch::manual_seed(...) before constructing to get reproducible weights.
  explicit GPTImpl(const GPTConfig& cfg);
  // idx: int64 [B, T] with T <= block_size -> logits [B, T, vocab_size] (under tensor
  // parallelism [B, T, vocab_size / TP]: this rank's classes, rounded up with a padded vocabulary).
  torch::Tensor forward(const torch::Tensor& idx);
  // The mean cross entropy of forward()'s logits: lm_loss, or its vocabulary-parallel form when
  // the plan split the vocabulary (no rank gathers the whole logits).
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) const;

  GPTConfig cfg;
  // Registration order (and hence named_parameters() order) is the declaration order below.
  torch::nn::Embedding tok_emb{nullptr}, pos_emb{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  TiedLMHead head{nullptr};
};
TORCH_MODULE(GPT);

// Tensor parallelism for GPT (fsdp::parallelize after construction): the vocabulary (embedding
// and tied head) split by rows; q/k/v by heads and the MLP's first layer by features
// (column-parallel); the attention's and MLP's output projections by input features
// (row-parallel). LayerNorms, biases of row-parallel layers and the position embedding replicated.
// The TP size must divide n_head; a vocabulary it does not divide is padded (vocab_parallel_rule:
// the logits of the last rank end with padding columns, which the loss leaves out and
// fsdp::gather_vocab_parallel_logits drops). Grouped-query attention: q split by heads; kv
// split by heads when the TP size divides n_kv_head, else (fewer KV heads than TP ranks, the TP
// size a multiple of them) replicated, each rank using the KV heads of its query heads, its
// gradient a part of the whole one (fsdp::partial_gradient_rule). Throws std::invalid_argument
// for a TP size that fits neither. With cfg.sequence_parallel (the TensorParallel made with
// sequence_parallel on) the LayerNorms and the row-parallel biases are partial_gradient_rule
// parameters too: they see this rank's chunk of the sequence.
std::vector<fsdp::TensorParallelRule> gpt_tensor_parallel_plan(const GPTConfig& cfg = {}, int64_t tp = 1);

// Mean cross entropy over all positions. logits [B, T, V], targets int64 [B, T].
torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets);

// Number of distinct parameter elements of a module (shared tensors counted once).
int64_t count_unique_parameters(const torch::nn::Module& module);

// A deliberately irregular MLP for testing: tiny and odd-sized parameters (3, 1, 40 ...), a
// LayerNorm, and a registered parameter that forward() never uses (so it never gets a gradient).
struct UnevenNetImpl : torch::nn::Module {
  UnevenNetImpl();
  // x: [N, 16] -> [N, 16]
  torch::Tensor forward(const torch::Tensor& x);

  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  torch::nn::LayerNorm n{nullptr};
  torch::nn::Linear d{nullptr};
  torch::Tensor unused;  // shape {5}, registered as parameter "unused"
};
TORCH_MODULE(UnevenNet);

}  // namespace models
