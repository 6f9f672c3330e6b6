// T5 (Raffel et al., 2020), the encoder-decoder of the paper's evaluation (§5: 611M, 2.28B and
// 11.3B), written the ordinary libtorch way: an encoder and a decoder of blocks with pre-norm
// (RMS) residual sublayers, relative position buckets shared by every layer of a stack,
// cross-attention in the decoder, a ReLU feed-forward, no biases, and an embedding shared by both
// stacks and tied to the output projection (scaled by d_model^-1/2, as T5 v1.0 does). Attention
// goes through at::scaled_dot_product_attention with the position bias as an additive mask (T5
// does not scale scores: scale 1). Nothing here knows about sharding; the blocks may be
// checkpointed (fsdp/activation_checkpoint.h, plain libtorch autograd).
#pragma once

#include <torch/torch.h>

#include "fsdp/tensor_parallel.h"

#include <cstdint>
#include <string>

namespace models {

struct T5Config {
  int64_t vocab_size = 256;
  int64_t d_model = 64;
  int64_t d_kv = 16;      // per head
  int64_t d_ff = 256;
  int64_t n_head = 4;
  int64_t n_layer = 2;    // encoder blocks, and as many decoder blocks
  int64_t num_buckets = 32;
  int64_t max_distance = 128;
  double dropout = 0.0;
  // The tensor-parallel size activation_bytes counts for (t5_tensor_parallel_plan): heads and
  // feed-forward features split, the d_model-wide activations whole on every rank.
  int64_t tensor_parallel = 1;

  int64_t num_parameters() const;
  // Bytes of activations one training step of `batch` pairs of a `src_len`-token source and a
  // `tgt_len`-token target holds at its peak (the start of backward), in a compute dtype of
  // `element_size` bytes, counted from forward() below tensor by tensor (what autograd saves), and
  // checked against the measured peak in docs/performance.md. `checkpointed`: every block under
  // activation checkpointing. The head's share: head_activation_bytes.
  int64_t activation_bytes(int64_t batch, int64_t src_len, int64_t tgt_len, int64_t element_size,
                           bool checkpointed = false) const;
  int64_t head_activation_bytes(int64_t batch, int64_t tgt_len, int64_t element_size) const;
  // "t5-tiny", "t5-small" (this machine), "t5-large" (737.7 M), "t5-3b" (2.85 B), "t5-11b"
  // (11.3 B: the paper's largest T5). Throws std::invalid_argument otherwise.
  static T5Config preset(const std::string& name);
};

// RMS layer norm without a bias or a mean (T5LayerNorm).
struct T5NormImpl : torch::nn::Module {
  explicit T5NormImpl(int64_t d);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
};
TORCH_MODULE(T5Norm);

struct T5AttentionImpl : torch::nn::Module {
  T5AttentionImpl(const T5Config& c, bool relative_bias, bool causal);
  // x attends to kv (x itself for self-attention); `bias`: [1 or B, H, Tq, Tk] added to scores.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& kv, const torch::Tensor& bias);
  // The position bias of this stack ([1, H, Tq, Tk], with the causal mask folded in for a
  // decoder); only the first layer of a stack has the bucket embedding.
  torch::Tensor position_bias(int64_t Tq, int64_t Tk, c10::Device device) const;
  int64_t n_head, d_kv;
  bool causal;
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  torch::nn::Embedding relative_attention_bias{nullptr};
  int64_t num_buckets, max_distance;
};
TORCH_MODULE(T5Attention);

struct T5FeedForwardImpl : torch::nn::Module {
  explicit T5FeedForwardImpl(const T5Config& c);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear wi{nullptr}, wo{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(T5FeedForward);

struct T5EncoderBlockImpl : torch::nn::Module {
  T5EncoderBlockImpl(const T5Config& c, bool first);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias);
  T5Norm ln_attn{nullptr}, ln_ff{nullptr};
  T5Attention attn{nullptr};
  T5FeedForward ff{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(T5EncoderBlock);

struct T5DecoderBlockImpl : torch::nn::Module {
  T5DecoderBlockImpl(const T5Config& c, bool first);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& memory, const torch::Tensor& self_bias);
  T5Norm ln_self{nullptr}, ln_cross{nullptr}, ln_ff{nullptr};
  T5Attention self_attn{nullptr}, cross_attn{nullptr};
  T5FeedForward ff{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(T5DecoderBlock);

struct T5Impl : torch::nn::Module {
  // Initialized deterministically from the global torch RNG (torch::manual_seed before building).
  explicit T5Impl(const T5Config& cfg);
  // src: int64 [B, Ts], tgt_in: int64 [B, Tt] (the decoder's input: targets shifted right)
  // -> logits [B, Tt, vocab].
  torch::Tensor forward(const torch::Tensor& src, const torch::Tensor& tgt_in);
  // The mean cross entropy of forward()'s logits (vocabulary-parallel when the plan split it).
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) const;

  T5Config cfg;
  torch::nn::Embedding shared{nullptr};
  torch::nn::ModuleList encoder{nullptr}, decoder{nullptr};
  T5Norm enc_norm{nullptr}, dec_norm{nullptr};
};
TORCH_MODULE(T5);

// Tensor parallelism for T5 (fsdp::parallelize after construction): the shared embedding and tied
// output by vocabulary rows; q, k, v and wi column-parallel (by heads, by features); o and wo
// row-parallel; each stack's bucket embedding by heads (its columns). The TP size must divide
// n_head, d_ff and vocab_size.
// With `sequence_parallel` (the TensorParallel made with it on) the norms are
// partial_gradient_rule parameters: they see this rank's chunks of the sequences.
std::vector<fsdp::TensorParallelRule> t5_tensor_parallel_plan(bool sequence_parallel = false);

// The seq2seq objective fsdp's tests and programs train T5 with: the decoder reproduces the source
// sequence reversed, reading it shifted right behind token 0 (teacher forcing). Returns
// {decoder input, targets} for `src` [B, T].
std::pair<torch::Tensor, torch::Tensor> t5_reverse_task(const torch::Tensor& src);

}  // namespace models
