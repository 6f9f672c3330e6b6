#include "models/t5.h"

#include "fsdp/tensor_parallel.h"

#include "fsdp/activation_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>
#include <unordered_set>

namespace models {

int64_t T5Config::num_parameters() const {
  const int64_t inner = n_head * d_kv;
  const int64_t attention = 4 * d_model * inner, ff = 2 * d_model * d_ff;
  const int64_t encoder = n_layer * (attention + ff + 2 * d_model) + num_buckets * n_head + d_model;
  const int64_t decoder = n_layer * (2 * attention + ff + 3 * d_model) + num_buckets * n_head + d_model;
  return vocab_size * d_model + encoder + decoder;
}

int64_t T5Config::activation_bytes(int64_t batch, int64_t src_len, int64_t tgt_len, int64_t element_size,
                                   bool checkpointed) const {
  const int64_t tp = std::max<int64_t>(1, tensor_parallel);
  const int64_t d = d_model, i = n_head * d_kv / tp, Ts = src_len, Tt = tgt_len, n_head = this->n_head / tp,
                d_ff = this->d_ff / tp;
  const int64_t src = batch * Ts, tgt = batch * Tt;
  // Attention with an additive position bias that needs a gradient runs SDPA's composite path on
  // the CPU: the scores and the probabilities, heads x Tk per query token, are saved.
  // Per source token and encoder block: the norm's output (q, k and v read it) 1 d, q, k, v 3 i,
  // scores and probabilities 2 H Ts, the attention's output and its [B, T, i] copy (o's input) 2 i,
  // the residual h 1 d, the second norm's output 1 d, wi's output (ReLU's, wo's input) d_ff, the
  // block's output (the next block's input) 1 d.
  const int64_t enc_block = src * (4 * d + 5 * i + d_ff + 2 * n_head * Ts);
  // Per target token and decoder block: self-attention as above (norm 1 d, 3 i, 2 H Tt, 2 i,
  // residual 1 d), cross-attention (norm 1 d, q 1 i, 2 H Ts, 2 i, residual 1 d), the feed-forward
  // (norm 1 d, d_ff, output 1 d); and per source token k and v of the encoder's output, 2 i.
  const int64_t dec_block = tgt * (6 * d + 8 * i + d_ff + 2 * n_head * (Tt + Ts)) + src * 2 * i;
  // The embeddings' outputs (each stack's first input) and the encoder's normalized output.
  const int64_t shared = src * 2 * d + tgt * d;
  const int64_t head = head_activation_bytes(batch, tgt_len, element_size);
  // Checkpointed blocks keep their inputs (the stack's hidden states; the bias and the encoder's
  // output are shared), and one block's activations exist again while backward recomputes it.
  if (checkpointed) {
    const int64_t kept = n_layer * (src * d + tgt * d);
    return (shared + kept + std::max(enc_block, dec_block)) * element_size + head;
  }
  return (shared + n_layer * (enc_block + dec_block)) * element_size + head;
}

int64_t T5Config::head_activation_bytes(int64_t batch, int64_t tgt_len, int64_t element_size) const {
  // The final norm's output and its scaled copy (tokens x d), the log-softmax's output (tokens x
  // vocab) and, while the loss's backward runs, the gradients of the log-probabilities and logits.
  const int64_t tokens = batch * tgt_len;
  // Vocabulary-parallel: as models::GPTConfig::head_activation_bytes counts it.
  if (tensor_parallel > 1) {
    return 2 * tokens * d_model * element_size + tokens * (vocab_size / tensor_parallel) * (8 + (element_size == 4 ? 0 : element_size));
  }
  return (2 * tokens * d_model + 3 * tokens * vocab_size) * element_size;
}

T5Config T5Config::preset(const std::string& name) {
  // {vocab, d_model, d_kv, d_ff, heads, layers}
  static const std::map<std::string, T5Config> presets = {
      {"t5-tiny", {256, 32, 8, 128, 4, 2}},
      {"t5-small", {256, 128, 32, 512, 4, 4}},
      {"t5-large", {32128, 1024, 64, 4096, 16, 24}},
      {"t5-3b", {32128, 1024, 128, 16384, 32, 24}},
      {"t5-11b", {32128, 1024, 128, 65536, 128, 24}},
  };
  auto it = presets.find(name);
  if (it == presets.end()) {
    std::string valid;
    for (const auto& kv : presets) valid += (valid.empty() ? "" : ", ") + kv.first;
    throw std::invalid_argument("unknown T5 preset '" + name + "'; valid presets: " + valid);
  }
  return it->second;
}

T5NormImpl::T5NormImpl(int64_t d) { weight = register_parameter("weight", torch::ones({d})); }

torch::Tensor T5NormImpl::forward(const torch::Tensor& x) {
  // In fp32 whatever the compute dtype, as T5 does: the mean of squares underflows in half types.
  const torch::Tensor x32 = x.to(torch::kFloat);
  const torch::Tensor rms = torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + 1e-6);
  return weight * (x32 * rms).to(x.scalar_type());
}

T5AttentionImpl::T5AttentionImpl(const T5Config& c, bool relative_bias, bool causal_)
    : n_head(c.n_head), d_kv(c.d_kv), causal(causal_), num_buckets(c.num_buckets), max_distance(c.max_distance) {
  const int64_t inner = c.n_head * c.d_kv;
  auto linear = [&](int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); };
  q = register_module("q", linear(c.d_model, inner));
  k = register_module("k", linear(c.d_model, inner));
  v = register_module("v", linear(c.d_model, inner));
  o = register_module("o", linear(inner, c.d_model));
  if (relative_bias) relative_attention_bias = register_module("relative_attention_bias", torch::nn::Embedding(c.num_buckets, c.n_head));
}

torch::Tensor T5AttentionImpl::position_bias(int64_t Tq, int64_t Tk, c10::Device device) const {
  TORCH_CHECK(relative_attention_bias, "T5: position_bias on a layer without the bucket embedding");
  auto opts = torch::TensorOptions().dtype(torch::kLong).device(device);
  const torch::Tensor rel = torch::arange(Tk, opts).unsqueeze(0) - torch::arange(Tq, opts).unsqueeze(1);  // key - query
  // Buckets: half of them for exact small distances, the rest logarithmic up to max_distance;
  // the encoder tells before from after (half the buckets each), the decoder sees only the past.
  int64_t buckets = num_buckets;
  torch::Tensor n = -rel, bucket = torch::zeros_like(rel);
  if (!causal) {
    buckets /= 2;
    bucket = bucket + (n < 0).to(torch::kLong) * buckets;
    n = n.abs();
  } else {
    n = n.clamp_min(0);
  }
  const int64_t exact = buckets / 2;
  const torch::Tensor large =
      (exact + (torch::log(n.to(torch::kFloat) / exact) / std::log(double(max_distance) / exact) * (buckets - exact))
                   .to(torch::kLong))
          .clamp_max(buckets - 1);
  bucket = bucket + torch::where(n < exact, n, large);
  // Under tensor parallelism the table is split by heads (t5_tensor_parallel_plan): each rank looks
  // up its own heads' biases, which its attention adds to its own heads' scores: a use of a split
  // parameter fsdp is told about.
  fsdp::TensorParallelLayerScope own_heads;
  torch::Tensor bias = torch::embedding(relative_attention_bias->weight, bucket).permute({2, 0, 1}).unsqueeze(0);  // [1, H, Tq, Tk]
  if (causal) {
    const torch::Tensor future = torch::ones({Tq, Tk}, torch::TensorOptions().dtype(torch::kBool).device(device)).triu(1);
    bias = bias.masked_fill(future, -std::numeric_limits<double>::infinity());
  }
  return bias;
}

torch::Tensor T5AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& kv, const torch::Tensor& bias) {
  // q, k and v are column-parallel under tensor parallelism (t5_tensor_parallel_plan): H is this
  // rank's heads; o is row-parallel. Their outputs cover the whole sequences (under sequence
  // parallelism x and kv are this rank's chunks of them).
  const torch::Tensor qx = fsdp::column_parallel(q, x), kx = fsdp::column_parallel(k, kv), vx = fsdp::column_parallel(v, kv);
  const int64_t B = qx.size(0), Tq = qx.size(1), Tk = kx.size(1);
  const int64_t H = qx.size(-1) / d_kv;
  TORCH_CHECK(H * d_kv == qx.size(-1) && H > 0, "T5: tensor parallelism splits a head: the TP size must divide n_head (",
              n_head, ")");
  auto heads = [&](const torch::Tensor& t, int64_t T) { return t.reshape({B, T, H, d_kv}).transpose(1, 2); };
  const torch::Tensor qh = heads(qx, Tq), kh = heads(kx, Tk), vh = heads(vx, Tk);
  std::optional<torch::Tensor> mask;
  if (bias.defined()) mask = bias.to(qh.scalar_type());
  // T5 does not scale its scores (the 1/sqrt(d_kv) is folded into its initialization).
  const torch::Tensor y = at::scaled_dot_product_attention(qh, kh, vh, mask, /*dropout_p=*/0.0, /*is_causal=*/false,
                                                           /*scale=*/1.0);
  return fsdp::row_parallel(o, y.transpose(1, 2).reshape({B, Tq, H * d_kv}));
}

T5FeedForwardImpl::T5FeedForwardImpl(const T5Config& c) {
  wi = register_module("wi", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, c.d_ff).bias(false)));
  wo = register_module("wo", torch::nn::Linear(torch::nn::LinearOptions(c.d_ff, c.d_model).bias(false)));
  drop = register_module("drop", torch::nn::Dropout(c.dropout));
}

torch::Tensor T5FeedForwardImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = torch::relu(fsdp::column_parallel(wi, x));
  if (drop->options.p() > 0 && drop->is_training()) {
    // Under tensor parallelism h is this rank's features: masks from its own stream.
    const auto split = fsdp::tensor_parallel_placement(wi->weight);
    fsdp::TensorParallelRngScope features(split ? split->tp : nullptr);
    h = drop(h);
  }
  return fsdp::row_parallel(wo, h);
}

// A block's dropout on its sublayers' outputs: whole on every TP rank (the default generator,
// seeded alike across the TP group), or under sequence parallelism this rank's chunk of the
// sequence (its own stream).
static torch::Tensor block_dropout(torch::nn::Dropout& drop, const T5FeedForward& ff, const torch::Tensor& t) {
  if (drop->options.p() == 0 || !drop->is_training()) return t;
  fsdp::TensorParallelRngScope chunk(fsdp::sequence_parallel_of(ff->wi->weight));
  return drop(t);
}

T5EncoderBlockImpl::T5EncoderBlockImpl(const T5Config& c, bool first) {
  ln_attn = register_module("ln_attn", T5Norm(c.d_model));
  attn = register_module("attn", T5Attention(c, first, /*causal=*/false));
  ln_ff = register_module("ln_ff", T5Norm(c.d_model));
  ff = register_module("ff", T5FeedForward(c));
  drop = register_module("drop", torch::nn::Dropout(c.dropout));
}

torch::Tensor T5EncoderBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& bias) {
  const torch::Tensor n = ln_attn(x);
  const torch::Tensor h = x + block_dropout(drop, ff, attn(n, n, bias));
  return h + block_dropout(drop, ff, ff(ln_ff(h)));
}

T5DecoderBlockImpl::T5DecoderBlockImpl(const T5Config& c, bool first) {
  ln_self = register_module("ln_self", T5Norm(c.d_model));
  self_attn = register_module("self_attn", T5Attention(c, first, /*causal=*/true));
  ln_cross = register_module("ln_cross", T5Norm(c.d_model));
  cross_attn = register_module("cross_attn", T5Attention(c, false, /*causal=*/false));
  ln_ff = register_module("ln_ff", T5Norm(c.d_model));
  ff = register_module("ff", T5FeedForward(c));
  drop = register_module("drop", torch::nn::Dropout(c.dropout));
}

torch::Tensor T5DecoderBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& memory, const torch::Tensor& self_bias) {
  const torch::Tensor n = ln_self(x);
  torch::Tensor h = x + block_dropout(drop, ff, self_attn(n, n, self_bias));
  h = h + block_dropout(drop, ff, cross_attn(ln_cross(h), memory, torch::Tensor()));  // no position bias across stacks
  return h + block_dropout(drop, ff, ff(ln_ff(h)));
}

T5Impl::T5Impl(const T5Config& c) : cfg(c) {
  TORCH_CHECK(cfg.vocab_size > 0 && cfg.d_model > 0 && cfg.n_head > 0 && cfg.d_kv > 0 && cfg.n_layer > 0, "invalid T5Config");
  shared = register_module("shared", torch::nn::Embedding(cfg.vocab_size, cfg.d_model));
  encoder = register_module("encoder", torch::nn::ModuleList());
  decoder = register_module("decoder", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.n_layer; ++i) encoder->push_back(T5EncoderBlock(cfg, i == 0));
  for (int64_t i = 0; i < cfg.n_layer; ++i) decoder->push_back(T5DecoderBlock(cfg, i == 0));
  enc_norm = register_module("enc_norm", T5Norm(cfg.d_model));
  dec_norm = register_module("dec_norm", T5Norm(cfg.d_model));
  // T5's initialization (Mesh TensorFlow's), from the global RNG in registration order: the
  // embedding N(0, 1); q N(0, (d_model d_kv)^-1/2) (the unscaled scores' factor), k, v and the
  // bucket embedding N(0, d_model^-1/2), o N(0, (H d_kv)^-1/2); wi N(0, d_model^-1/2), wo
  // N(0, d_ff^-1/2). Norm weights stay 1.
  torch::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> norms;
  for (const auto& m : modules(/*include_self=*/false)) {
    if (auto* n = m->as<T5NormImpl>()) norms.insert(n->weight.unsafeGetTensorImpl());
  }
  const double d = static_cast<double>(cfg.d_model), inner = static_cast<double>(cfg.n_head * cfg.d_kv);
  for (auto& np : named_parameters(/*recurse=*/true)) {
    torch::Tensor& p = np.value();
    if (norms.count(p.unsafeGetTensorImpl())) continue;
    const std::string& name = np.key();
    auto ends = [&](const std::string& s) { return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0; };
    double std = 1.0;
    if (ends(".q.weight")) std = 1.0 / std::sqrt(d * static_cast<double>(cfg.d_kv));
    else if (ends(".k.weight") || ends(".v.weight") || ends("relative_attention_bias.weight") || ends(".wi.weight")) std = 1.0 / std::sqrt(d);
    else if (ends(".o.weight")) std = 1.0 / std::sqrt(inner);
    else if (ends(".wo.weight")) std = 1.0 / std::sqrt(static_cast<double>(cfg.d_ff));
    torch::nn::init::normal_(p, 0.0, std);
  }
}

torch::Tensor T5Impl::forward(const torch::Tensor& src, const torch::Tensor& tgt_in) {
  TORCH_CHECK(src.dim() == 2 && tgt_in.dim() == 2, "T5 expects src [B, Ts] and tgt_in [B, Tt]");
  const c10::Device dev = src.device();
  torch::Tensor x = fsdp::vocab_parallel_embedding(src, shared->weight);  // shared(src) when not split
  // Sequence parallelism: between the split layers each rank holds its chunk of each sequence.
  const auto sp = fsdp::sequence_parallel_of(shared->weight);
  if (sp) x = fsdp::scatter_to_sequence_parallel_region(x, sp);
  const torch::Tensor enc_bias = encoder[0]->as<T5EncoderBlockImpl>()->attn->position_bias(src.size(1), src.size(1), dev);
  // Each block through fsdp::checkpointable: recomputed in backward when marked
  // (--activation-checkpointing), called plainly otherwise. The lambdas hold the blocks by value:
  // backward calls them again.
  for (size_t i = 0; i < encoder->size(); ++i) {
    auto block = encoder[i]->as<T5EncoderBlock>();
    x = fsdp::checkpointable(
        *block, [block](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{block->forward(in[0], in[1])}; },
        {x, enc_bias})[0];
  }
  const torch::Tensor memory = enc_norm(x);
  torch::Tensor y = fsdp::vocab_parallel_embedding(tgt_in, shared->weight);
  if (sp) y = fsdp::scatter_to_sequence_parallel_region(y, sp);
  const torch::Tensor dec_bias =
      decoder[0]->as<T5DecoderBlockImpl>()->self_attn->position_bias(tgt_in.size(1), tgt_in.size(1), dev);
  for (size_t i = 0; i < decoder->size(); ++i) {
    auto block = decoder[i]->as<T5DecoderBlock>();
    y = fsdp::checkpointable(
        *block,
        [block](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{block->forward(in[0], in[1], in[2])}; },
        {y, memory, dec_bias})[0];
  }
  // The tied output projection, scaled as T5 v1.0 scales it.
  return fsdp::column_parallel(dec_norm(y) * (1.0 / std::sqrt(static_cast<double>(cfg.d_model))), shared->weight);
}

torch::Tensor T5Impl::loss(const torch::Tensor& logits, const torch::Tensor& targets) const {
  return fsdp::vocab_parallel_cross_entropy(logits, targets, shared->weight);
}

std::vector<fsdp::TensorParallelRule> t5_tensor_parallel_plan(bool sequence_parallel) {
  std::vector<fsdp::TensorParallelRule> plan = {{"shared.weight", {0, 1}}, {"**.relative_attention_bias.weight", {1, 1}}};
  for (const auto& rules : {fsdp::column_parallel_rule("**.q", 1, false), fsdp::column_parallel_rule("**.k", 1, false),
                            fsdp::column_parallel_rule("**.v", 1, false), fsdp::row_parallel_rule("**.o"),
                            fsdp::column_parallel_rule("**.wi", 1, false), fsdp::row_parallel_rule("**.wo")})
    plan.insert(plan.end(), rules.begin(), rules.end());
  // Under sequence parallelism the norms see this rank's chunks of the sequences: partial gradients.
  if (sequence_parallel) {
    for (const char* p : {"**.ln_*.weight", "enc_norm.weight", "dec_norm.weight"}) plan.push_back(fsdp::partial_gradient_rule(p));
  }
  return plan;
}

std::pair<torch::Tensor, torch::Tensor> t5_reverse_task(const torch::Tensor& src) {
  const torch::Tensor target = src.flip({1});
  const torch::Tensor start = torch::zeros({src.size(0), 1}, src.options());
  return {torch::cat({start, target.narrow(1, 0, target.size(1) - 1)}, 1), target};
}

}  // namespace models
