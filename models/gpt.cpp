#include "models/gpt.h"

#include "fsdp/activation_checkpoint.h"
#include "fsdp/tensor_parallel.h"

#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

namespace models {

// ---------------------------------------------------------------------------------------------
// GPTConfig

int64_t GPTConfig::num_parameters() const {
  const int64_t d = d_model, kv = n_kv_head == 0 ? n_head : n_kv_head, kv_d = 2 * kv * (d / n_head);
  // ln1 + ln2 (2 * 2d), qkv (3d*d + 3d), proj (d*d + d), fc (4d*d + 4d), proj (d*4d + d); with
  // grouped-query attention q (d*d + d) and kv (kv_d*d + kv_d) instead of qkv.
  const int64_t per_block = 9 * d * d + 10 * d + (kv_d + d) * d + kv_d + d;
  return vocab_size * d          // tok_emb (also the head, tied)
         + block_size * d        // pos_emb
         + n_layer * per_block   // blocks
         + 2 * d;                // ln_f
}

int64_t GPTConfig::activation_bytes(int64_t batch, int64_t seq_len, int64_t element_size, bool checkpointed) const {
  const int64_t tokens = batch * seq_len, d = d_model, T = seq_len;
  // Saved per block, in units of tokens x d: ln1's output (qkv's input) 1, qkv's output (q, k and
  // v are views of it) 3, the attention's output before proj 1, the residual h 1, ln2's output 1,
  // fc's output (gelu's input) 4, gelu's output (proj's input) 4, the block's output (the next
  // block's input) 1. Written-out attention adds the softmax's output, batch x heads x T x T; the
  // fused kernel only a log-sum-exp per row (batch x heads x T, fp32): its output, which its
  // backward keeps, is laid out [B, T, H, hd], so the attention's output before proj is that
  // very tensor (the reshape is a view), counted above.
  const int64_t tp = std::max<int64_t>(1, tensor_parallel), heads = n_head / tp;
  const int64_t attention = fused_attention ? batch * heads * T * 4 / element_size : batch * heads * T * T;
  // Sequence parallelism: the activations between the split layers are this rank's chunk of the
  // sequence (1 / tp), but the split layers' inputs are gathered whole, and autograd keeps those.
  const int64_t chunk = sequence_parallel && tp > 1 ? tp : 1;
  // Dropout keeps a one-byte mask of each of its two outputs.
  const int64_t masks = dropout > 0 ? (2 * tokens * d / chunk + element_size - 1) / element_size : 0;
  // Under tensor parallelism qkv's output, the attention's output, fc's and gelu's (12 of the 16)
  // are split; ln1's, h, ln2's and the block's output are whole on every rank.
  // Grouped-query attention: q's output 1 and the keys and values picked for each query head 2
  // (split, as qkv's 3 were), and kv's own output, 2 x n_kv_head / n_head (split when the TP size
  // divides n_kv_head, whole on every rank when the KV heads are replicated).
  const int64_t kv = n_kv_head == 0 ? n_head : n_kv_head;
  const int64_t kv_out = kv == n_head ? 0 : 2 * tokens * d * kv / n_head / (kv % tp == 0 ? tp : 1);
  // Under sequence parallelism ln1's and ln2's outputs are kept as gathered (whole, the split
  // layers' inputs), h and the block's output as chunks; replicated KV heads gather ln1's output a
  // second time for kv.
  const int64_t whole = chunk == 1 ? 4 * tokens * d
                                   : 2 * tokens * d + 2 * tokens * d / chunk + (kv != n_head && kv % tp != 0 ? tokens * d : 0);
  // In backward a row-parallel layer's gradient arrives as a chunk and is all-gathered: the
  // collective's stacked buffer lives beside the whole gradient it is copied into, one whole
  // tokens x d more than without sequence parallelism, where the gradient passes through.
  const int64_t staging = chunk > 1 ? tokens * d : 0;
  const int64_t per_block = whole + 12 * tokens * d / tp + kv_out + attention + masks;
  // The embeddings' sum (the first block's input), tokens x d (a chunk of it under sequence
  // parallelism), and the head's peak (ln_f's output gathered whole for the head).
  const int64_t head = head_activation_bytes(batch, seq_len, element_size);
  // Checkpointed blocks keep only their input (the previous block's output, counted already), and
  // one block's activations exist again while backward recomputes it.
  if (checkpointed) return ((n_layer + 1) * tokens * d / chunk + per_block + staging) * element_size + head;
  return (n_layer * per_block + tokens * d / chunk + staging) * element_size + head;
}

int64_t GPTConfig::head_activation_bytes(int64_t batch, int64_t seq_len, int64_t element_size) const {
  // ln_f's output (tokens x d) and log_softmax's output (tokens x vocab), and while the loss's
  // backward runs, the gradients of the log-probabilities and of the logits beside it.
  const int64_t tokens = batch * seq_len;
  // Vocabulary-parallel (fsdp::vocab_parallel_cross_entropy): of this rank's classes, two fp32
  // arrays at once (the softmax and, in forward, the fp32 logits or, in backward, the gradient)
  // and, in a half compute dtype, the logits or their gradient beside them.
  if (tensor_parallel > 1) {
    const int64_t per_rank = (vocab_size + tensor_parallel - 1) / tensor_parallel;  // a padded vocabulary rounds up
    return tokens * d_model * element_size + tokens * per_rank * (8 + (element_size == 4 ? 0 : element_size));
  }
  return (tokens * d_model + 3 * tokens * vocab_size) * element_size;
}

GPTConfig GPTConfig::preset(const std::string& name) {
  // {vocab, block, layers, heads, d_model}
  static const std::map<std::string, GPTConfig> presets = {
      {"tiny", {256, 32, 2, 2, 32}},
      {"small", {256, 64, 2, 4, 64}},
      {"default", {256, 128, 4, 4, 256}},
      {"medium", {256, 256, 8, 8, 512}},
      {"large", {256, 256, 16, 8, 512}},
      {"200m", {50000, 256, 12, 16, 1024}},
      {"1b", {50000, 2048, 24, 16, 1792}},
      {"175b", {50000, 2048, 96, 96, 12288}},
  };
  auto it = presets.find(name);
  if (it == presets.end()) {
    std::string valid;
    for (const auto& kv : presets) valid += (valid.empty() ? "" : ", ") + kv.first;
    throw std::invalid_argument("unknown GPT preset '" + name + "'; valid presets: " + valid);
  }
  return it->second;
}

// ---------------------------------------------------------------------------------------------
// Blocks

CausalSelfAttentionImpl::CausalSelfAttentionImpl(int64_t d_model, int64_t n_head_, bool fused_, int64_t n_kv_head_)
    : n_head(n_head_), n_kv_head(n_kv_head_ == 0 ? n_head_ : n_kv_head_), fused(fused_) {
  TORCH_CHECK(n_head > 0 && d_model % n_head == 0, "d_model (", d_model,
              ") must be divisible by n_head (", n_head, ")");
  TORCH_CHECK(n_kv_head > 0 && n_head % n_kv_head == 0, "GPT: n_kv_head (", n_kv_head, ") must divide n_head (", n_head,
              "): each key/value head serves the same number of query heads");
  if (n_kv_head == n_head) {
    qkv = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  } else {
    q = register_module("q", torch::nn::Linear(d_model, d_model));
    kv = register_module("kv", torch::nn::Linear(d_model, 2 * n_kv_head * (d_model / n_head)));
  }
  proj = register_module("proj", torch::nn::Linear(d_model, d_model));
}

// Grouped-query attention. This rank's query heads are [first, first + H) of n_head (all of them
// without TP); query head h uses key/value head h / group. kv is split by heads like q (the rank
// holds the KV heads its query heads use), or replicated when there are fewer KV heads than TP
// ranks: then x enters it through copy_to (its gradient there is this rank's heads' part) and kv's
// own gradient is a part too (gpt_tensor_parallel_plan declares it partial).
torch::Tensor CausalSelfAttentionImpl::grouped_query(const torch::Tensor& x) {
  const int64_t hd = x.size(2) / n_head, group = n_head / n_kv_head;
  const auto q_split = fsdp::tensor_parallel_placement(q->weight);
  const bool kv_split = fsdp::tensor_parallel_placement(kv->weight).has_value();
  const torch::Tensor q_out = fsdp::column_parallel(q, x);
  // The whole sequence (under sequence parallelism x is this rank's chunk of it).
  const int64_t B = q_out.size(0), T = q_out.size(1);
  const int64_t H = q_out.size(-1) / hd;
  TORCH_CHECK(H * hd == q_out.size(-1) && H > 0, "GPT: tensor parallelism splits a query head: the TP size must divide n_head (",
              n_head, ")");
  const int64_t tp_rank = q_split ? q_split->tp->rank() : 0, first = tp_rank * H;
  torch::Tensor kv_out;
  int64_t kv_first = 0;  // the first KV head this rank holds
  if (kv_split || !q_split) {
    kv_out = fsdp::column_parallel(kv, x);
    kv_first = kv_split ? tp_rank * (kv_out.size(-1) / 2 / hd) : 0;
  } else {
    kv_out = kv(q_split->tp->sequence_parallel() ? fsdp::gather_from_sequence_parallel_region(x, q_split->tp, /*into_split_computation=*/true)
                                                  : fsdp::copy_to_tensor_parallel_region(x, q_split->tp));
  }
  const int64_t KV = kv_out.size(-1) / 2 / hd;
  auto heads = [&](const torch::Tensor& t, int64_t n) { return t.reshape({B, T, n, hd}).transpose(1, 2); };
  auto kv_parts = kv_out.chunk(2, /*dim=*/-1);
  // Each query head's KV head, among those this rank holds.
  std::vector<int64_t> index(H);
  for (int64_t j = 0; j < H; ++j) index[j] = (first + j) / group - kv_first;
  TORCH_CHECK(index.front() >= 0 && index.back() < KV, "GPT: this rank's query heads need KV heads it does not hold");
  const torch::Tensor pick = torch::tensor(index, torch::TensorOptions().dtype(torch::kLong).device(x.device()));
  const torch::Tensor k = heads(kv_parts[0], KV).index_select(1, pick), v = heads(kv_parts[1], KV).index_select(1, pick);
  return attend(heads(q_out, H), k, v, B, T);
}

// Attention over q, k, v of [B, H, T, hd], then the output projection (row-parallel under TP).
torch::Tensor CausalSelfAttentionImpl::attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                              int64_t B, int64_t T) {
  const int64_t C = q.size(1) * q.size(3), hd = q.size(3);
  if (fused) {
    auto y = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
    return fsdp::row_parallel(proj, y.transpose(1, 2).reshape({B, T, C}));
  }
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  // Built per call on q's device so the module carries no buffer and works for any T.
  auto mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(/*diagonal=*/1);
  att = att.masked_fill(mask, -std::numeric_limits<double>::infinity());
  att = torch::softmax(att, /*dim=*/-1);
  auto y = torch::matmul(att, v);                  // [B, H, T, hd]
  y = y.transpose(1, 2).reshape({B, T, C});        // reshape copies: y is non-contiguous here
  return fsdp::row_parallel(proj, y);
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  if (!qkv) return grouped_query(x);
  const int64_t hd = x.size(2) / n_head;
  // qkv is column-parallel under tensor parallelism (gpt_tensor_parallel_plan): each rank holds its
  // heads' rows of q, k and v, so C is this rank's share of d_model and H its heads; its output
  // covers the whole sequence (under sequence parallelism x is this rank's chunk of it).
  const torch::Tensor qkv_out = fsdp::column_parallel(qkv, x);
  const int64_t B = qkv_out.size(0), T = qkv_out.size(1);
  const int64_t C = qkv_out.size(-1) / 3, H = C / hd;
  TORCH_CHECK(H * hd == C && H > 0, "GPT: tensor parallelism splits a head (", C, " of the ", x.size(2),
              " features per rank, heads of ", hd, "): the TP size must divide n_head (", n_head, ")");
  auto parts = qkv_out.chunk(3, /*dim=*/-1);
  // [B, T, C] -> [B, H, T, hd]
  auto heads = [&](const torch::Tensor& t) { return t.reshape({B, T, H, hd}).transpose(1, 2); };
  return attend(heads(parts[0]), heads(parts[1]), heads(parts[2]), B, T);
}

MLPImpl::MLPImpl(int64_t d_model) {
  fc = register_module("fc", torch::nn::Linear(d_model, 4 * d_model));
  proj = register_module("proj", torch::nn::Linear(4 * d_model, d_model));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  return fsdp::row_parallel(proj, torch::gelu(fsdp::column_parallel(fc, x)));
}

BlockImpl::BlockImpl(int64_t d_model, int64_t n_head, bool fused_attention, double dropout_, int64_t n_kv_head)
    : dropout(dropout_) {
  TORCH_CHECK(dropout >= 0 && dropout < 1, "GPT dropout must be in [0, 1), got ", dropout);
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  attn = register_module("attn", CausalSelfAttention(d_model, n_head, fused_attention, n_kv_head));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  mlp = register_module("mlp", MLP(d_model));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  // Under sequence parallelism the block's outputs are this rank's chunk of the sequence: masks
  // from this TP rank's own stream. Otherwise they are whole on every TP rank: the default
  // generator, seeded alike across the TP group (fsdp::seed_tensor_parallel_rng).
  auto drop = [&](const torch::Tensor& t) {
    if (dropout == 0 || !is_training()) return t;
    fsdp::TensorParallelRngScope chunk(fsdp::sequence_parallel_of(mlp->fc->weight));
    return torch::dropout(t, dropout, is_training());
  };
  auto h = x + drop(attn(ln1(x)));
  return h + drop(mlp(ln2(h)));
}

TiedLMHeadImpl::TiedLMHeadImpl(torch::Tensor tied_weight) {
  TORCH_CHECK(tied_weight.defined() && tied_weight.dim() == 2, "TiedLMHead needs a 2-D weight");
  // register_parameter stores the very same tensor (no copy), which is what makes it tied.
  weight = register_parameter("weight", tied_weight, /*requires_grad=*/tied_weight.requires_grad());
}

// Column-parallel over the vocabulary when the tied embedding is split by rows.
torch::Tensor TiedLMHeadImpl::forward(const torch::Tensor& x) { return fsdp::column_parallel(x, weight); }

// ---------------------------------------------------------------------------------------------
// GPT

GPTImpl::GPTImpl(const GPTConfig& c) : cfg(c) {
  TORCH_CHECK(cfg.vocab_size > 0 && cfg.block_size > 0 && cfg.n_layer >= 0 && cfg.d_model > 0,
              "invalid GPTConfig");
  tok_emb = register_module("tok_emb", torch::nn::Embedding(cfg.vocab_size, cfg.d_model));
  pos_emb = register_module("pos_emb", torch::nn::Embedding(cfg.block_size, cfg.d_model));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.n_layer; ++i) blocks->push_back(Block(cfg.d_model, cfg.n_head, cfg.fused_attention, cfg.dropout, cfg.n_kv_head));
  ln_f = register_module("ln_f",
                         torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.d_model})));
  head = register_module("head", TiedLMHead(tok_emb->weight));

  // Deterministic init from the global RNG. The default libtorch init already consumed RNG draws
  // during construction; re-initialising everything here in one fixed order makes the result
  // depend only on the seed and this order. First classify each parameter by its owning module.
  enum class Kind { Normal, Zero, One };
  std::unordered_map<const c10::TensorImpl*, Kind> kind;
  for (const auto& m : modules(/*include_self=*/false)) {
    if (auto* ln = m->as<torch::nn::LayerNormImpl>()) {
      if (ln->weight.defined()) kind[ln->weight.unsafeGetTensorImpl()] = Kind::One;
      if (ln->bias.defined()) kind[ln->bias.unsafeGetTensorImpl()] = Kind::Zero;
    } else if (auto* lin = m->as<torch::nn::LinearImpl>()) {
      kind[lin->weight.unsafeGetTensorImpl()] = Kind::Normal;
      if (lin->bias.defined()) kind[lin->bias.unsafeGetTensorImpl()] = Kind::Zero;
    } else if (auto* emb = m->as<torch::nn::EmbeddingImpl>()) {
      kind[emb->weight.unsafeGetTensorImpl()] = Kind::Normal;
    }
  }
  torch::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> done;  // the tied weight is listed twice
  for (auto& np : named_parameters(/*recurse=*/true)) {
    auto& p = np.value();
    const auto* impl = p.unsafeGetTensorImpl();
    if (!done.insert(impl).second) continue;
    auto it = kind.find(impl);
    const Kind k = it == kind.end() ? Kind::Normal : it->second;
    switch (k) {
      case Kind::Normal: torch::nn::init::normal_(p, 0.0, 0.02); break;
      case Kind::Zero: torch::nn::init::zeros_(p); break;
      case Kind::One: torch::nn::init::ones_(p); break;
    }
  }
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) {
  TORCH_CHECK(idx.dim() == 2, "GPT expects idx of shape [B, T], got ", idx.sizes());
  const int64_t T = idx.size(1);
  TORCH_CHECK(T <= cfg.block_size, "sequence length ", T, " exceeds block_size ", cfg.block_size);
  auto pos = torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(idx.device()));
  // A vocabulary-parallel lookup when the plan split tok_emb (tok_emb(idx) otherwise).
  auto x = fsdp::vocab_parallel_embedding(idx, tok_emb->weight) + pos_emb(pos);  // [B, T, d] + [T, d]
  // Sequence parallelism: from here to the head each rank holds its chunk of the sequence.
  if (auto sp = fsdp::sequence_parallel_of(tok_emb->weight)) x = fsdp::scatter_to_sequence_parallel_region(x, sp);
  for (size_t i = 0; i < blocks->size(); ++i) {
    BlockImpl* block = blocks[i]->as<BlockImpl>();
    // Recomputed in backward when fsdp::apply_activation_checkpointing marked the block.
    x = fsdp::checkpointable(*block, [block](const torch::Tensor& h) { return block->forward(h); }, x);
  }
  return head(ln_f(x));
}

torch::Tensor GPTImpl::loss(const torch::Tensor& logits, const torch::Tensor& targets) const {
  return fsdp::vocab_parallel_cross_entropy(logits, targets, tok_emb->weight);
}

std::vector<fsdp::TensorParallelRule> gpt_tensor_parallel_plan(const GPTConfig& cfg, int64_t tp) {
  // The tied head with it; padded when the TP size does not divide the vocabulary (GPT-2's 50257).
  std::vector<fsdp::TensorParallelRule> plan = {fsdp::vocab_parallel_rule("tok_emb.weight")};
  auto add = [&](const std::vector<fsdp::TensorParallelRule>& rules) { plan.insert(plan.end(), rules.begin(), rules.end()); };
  const int64_t kv_heads = cfg.n_kv_head == 0 ? cfg.n_head : cfg.n_kv_head;
  if (kv_heads == cfg.n_head) {
    add(fsdp::column_parallel_rule("blocks.*.attn.qkv", /*parts=*/3));
  } else {
    add(fsdp::column_parallel_rule("blocks.*.attn.q"));
    if (tp <= 1 || kv_heads % tp == 0) {
      add(fsdp::column_parallel_rule("blocks.*.attn.kv", /*parts=*/2));  // keys' rows, then values'
    } else if (tp % kv_heads == 0) {
      add({fsdp::partial_gradient_rule("blocks.*.attn.kv.weight"), fsdp::partial_gradient_rule("blocks.*.attn.kv.bias")});
    } else {
      throw std::invalid_argument("GPT: " + std::to_string(kv_heads) + " key/value heads neither split over " +
                                  std::to_string(tp) + " TP ranks nor replicate evenly on them: choose a TP size that "
                                  "divides n_kv_head or that n_kv_head divides");
    }
  }
  add(fsdp::row_parallel_rule("blocks.*.attn.proj"));
  add(fsdp::column_parallel_rule("blocks.*.mlp.fc"));
  add(fsdp::row_parallel_rule("blocks.*.mlp.proj"));
  if (cfg.sequence_parallel && tp > 1) {
    // Applied to this rank's chunk of the sequence: each rank's gradient is its chunk's share.
    for (const char* p : {"blocks.*.ln1.*", "blocks.*.ln2.*", "ln_f.*", "blocks.*.attn.proj.bias", "blocks.*.mlp.proj.bias"})
      plan.push_back(fsdp::partial_gradient_rule(p));
  }
  return plan;
}

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

int64_t count_unique_parameters(const torch::nn::Module& module) {
  std::unordered_set<const c10::TensorImpl*> seen;
  int64_t n = 0;
  for (const auto& p : module.parameters(/*recurse=*/true))
    if (seen.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
  return n;
}

// ---------------------------------------------------------------------------------------------
// UnevenNet

UnevenNetImpl::UnevenNetImpl() {
  a = register_module("a", torch::nn::Linear(16, 3));
  b = register_module("b", torch::nn::Linear(3, 1));
  c = register_module("c", torch::nn::Linear(1, 40));
  n = register_module("n", torch::nn::LayerNorm(torch::nn::LayerNormOptions({40})));
  d = register_module("d", torch::nn::Linear(40, 16));
  unused = register_parameter("unused", torch::randn({5}));
}

torch::Tensor UnevenNetImpl::forward(const torch::Tensor& x) {
  auto h = torch::tanh(a(x));
  h = torch::tanh(b(h));
  h = torch::tanh(n(c(h)));
  return d(h);
}

}  // namespace models
