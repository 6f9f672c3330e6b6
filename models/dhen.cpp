#include "models/dhen.h"

#include "fsdp/activation_checkpoint.h"

#include <map>
#include <stdexcept>

namespace models {

// ---------------------------------------------------------------------------------------------
// DHENConfig

int64_t DHENConfig::embedding_parameters() const { return n_sparse * rows * dim; }

int64_t DHENConfig::dense_parameters() const {
  const int64_t d = dim, h = d_hidden;
  // qkv (3d*d + 3d), attn_out (d*d + d), cross (d*d + d), fc1 (d*h + h), fc2 (h*d + d),
  // mix (3d*d + d), norm (2d).
  const int64_t per_layer = 8 * d * d + 2 * d * h + h + 9 * d;
  return n_dense * d + d                      // dense_proj
         + n_layer * per_layer                // layers
         + tokens() * d * h + h + h + 1;      // head: Linear(T*d, h), Linear(h, 1)
}

int64_t DHENConfig::num_parameters() const { return embedding_parameters() + dense_parameters(); }

int64_t DHENConfig::activation_bytes(int64_t batch, int64_t element_size, bool checkpointed) const {
  const int64_t e = element_size, B = batch, T = tokens(), tok = B * T, d = dim, h = d_hidden;
  // The embedding's lookup saves its index, B * n_sparse int64 (one process: index_select's
  // index; W > 1: the permutation and the local rows, about twice that). dense_proj saves its
  // input, the dense features. The first layer's input X (the concatenated tokens), tok x d.
  const int64_t inputs = B * n_sparse * 8 + B * n_dense * e + tok * d * e;
  // Per layer, in units of tok x d unless said: qkv's output 3 (q, k and v are views of it, saved
  // by the fused attention), the attention's output 1 (attn_out's input is a view of it), cross's
  // Linear output 1 (saved by the product with x), the ReLU's output tok x h (saved by the ReLU
  // and fc2), the concatenation 3 (mix's input), the residual sum 1 (LayerNorm's input), the
  // LayerNorm's output 1 (the next layer's or the head's input; x itself, saved by qkv, cross,
  // fc1 and the product, is the previous layer's output). fp32 statistics: the attention's
  // log-sum-exp (B x heads x T), the LayerNorm's mean and rstd (2 x tok). Dropout > 0 saves its
  // scaled mask, tok x d in the compute dtype.
  const int64_t per_layer = (10 * tok * d + tok * h + (dropout > 0 ? tok * d : 0)) * e + (B * n_head * T + 2 * tok) * 4;
  // The head: the flattened last output is a view (counted); the ReLU's output, B x h, saved by
  // the ReLU and the last Linear.
  const int64_t head = B * h * e;
  // Checkpointed layers keep only their inputs: the first is counted in `inputs`, the others (and
  // the head's input) are the layers' outputs, tok x d each; plus one layer recomputed in backward.
  if (checkpointed) return inputs + n_layer * tok * d * e + (n_layer > 0 ? per_layer : 0) + head;
  return inputs + n_layer * per_layer + head;
}

DHENConfig DHENConfig::preset(const std::string& name) {
  // {n_dense, n_sparse, rows, dim, n_layer, n_head, d_hidden}
  static const std::map<std::string, DHENConfig> presets = {
      {"dhen-tiny", {4, 4, 64, 16, 2, 2, 32}},
      {"dhen-small", {8, 8, 1000, 32, 2, 2, 64}},
      // The paper's Figs. 7a / 8a at this machine's scale: the dense layers (FSDP's) outweigh this
      // rank's embedding rows at W = 4. 3.9 M dense and 6.7 M embedding parameters.
      {"dhen-medium", {13, 26, 2000, 128, 8, 4, 512}},
      // Criteo-like: 13 dense features, 26 tables; 2.8 M dense and 333 M embedding parameters.
      {"dhen-large", {13, 26, 100000, 128, 4, 4, 512}},
  };
  auto it = presets.find(name);
  if (it == presets.end()) {
    std::string valid;
    for (const auto& kv : presets) valid += (valid.empty() ? "" : ", ") + kv.first;
    throw std::invalid_argument("unknown DHEN preset '" + name + "'; valid presets: " + valid);
  }
  return it->second;
}

// ---------------------------------------------------------------------------------------------
// DHENLayer

DHENLayerImpl::DHENLayerImpl(int64_t dim, int64_t n_head_, int64_t d_hidden, double dropout_)
    : n_head(n_head_), dropout(dropout_) {
  TORCH_CHECK(n_head > 0 && dim % n_head == 0, "DHEN: dim (", dim, ") must be divisible by n_head (", n_head, ")");
  qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
  attn_out = register_module("attn_out", torch::nn::Linear(dim, dim));
  cross = register_module("cross", torch::nn::Linear(dim, dim));
  fc1 = register_module("fc1", torch::nn::Linear(dim, d_hidden));
  fc2 = register_module("fc2", torch::nn::Linear(d_hidden, dim));
  mix = register_module("mix", torch::nn::Linear(3 * dim, dim));
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
}

torch::Tensor DHENLayerImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / n_head;
  // (i) Self-attention over the T feature tokens, no mask: every feature may look at every other.
  auto parts = qkv(x).chunk(3, /*dim=*/-1);
  auto heads = [&](const torch::Tensor& t) { return t.reshape({B, T, n_head, hd}).transpose(1, 2); };
  auto y = at::scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]));
  auto attended = attn_out(y.transpose(1, 2).reshape({B, T, C}));
  // (ii) DCN-style cross with the layer's input as x0: an explicit second-order interaction.
  auto crossed = x * cross(x) + x;
  // (iii) Per-token MLP: implicit interactions within a token.
  auto mlp = fc2(torch::relu(fc1(x)));
  // The ensemble: concatenated on the feature axis and mixed back to dim.
  auto mixed = mix(torch::cat({attended, crossed, mlp}, /*dim=*/-1));
  if (dropout > 0) mixed = torch::dropout(mixed, dropout, is_training());
  return norm(x + mixed);
}

// ---------------------------------------------------------------------------------------------
// DHEN

DHENImpl::DHENImpl(const DHENConfig& c, c10::intrusive_ptr<c10d::Backend> group, int rank, int world_size) : cfg(c) {
  TORCH_CHECK(cfg.n_dense > 0 && cfg.n_sparse > 0 && cfg.rows > 0 && cfg.dim > 0 && cfg.n_layer >= 0 &&
                  cfg.d_hidden > 0 && cfg.dropout >= 0 && cfg.dropout < 1,
              "invalid DHENConfig");
  // First, so the whole table's draw comes first from the RNG at every world size.
  sparse = register_module("sparse", RowShardedEmbedding(cfg.n_sparse, cfg.rows, cfg.dim, std::move(group), rank,
                                                         world_size));
  dense_proj = register_module("dense_proj", torch::nn::Linear(cfg.n_dense, cfg.dim));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.n_layer; ++i) layers->push_back(DHENLayer(cfg.dim, cfg.n_head, cfg.d_hidden, cfg.dropout));
  head = register_module("head", torch::nn::Sequential(torch::nn::Linear(cfg.tokens() * cfg.dim, cfg.d_hidden),
                                                       torch::nn::ReLU(), torch::nn::Linear(cfg.d_hidden, 1)));
}

torch::Tensor DHENImpl::forward(const torch::Tensor& dense, const torch::Tensor& ids) {
  TORCH_CHECK(dense.dim() == 2 && dense.size(1) == cfg.n_dense, "DHEN expects dense features [B, ", cfg.n_dense,
              "], got ", dense.sizes());
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) == cfg.n_sparse && ids.size(0) == dense.size(0),
              "DHEN expects ids [B, ", cfg.n_sparse, "] with the dense features' B, got ", ids.sizes());
  const int64_t B = dense.size(0);
  auto x = torch::cat({sparse(ids), dense_proj(dense).unsqueeze(1)}, /*dim=*/1);  // [B, T, dim]
  for (size_t i = 0; i < layers->size(); ++i) {
    DHENLayerImpl* layer = layers[i]->as<DHENLayerImpl>();
    // Recomputed in backward when fsdp::apply_activation_checkpointing marked the layer.
    x = fsdp::checkpointable(*layer, [layer](const torch::Tensor& h) { return layer->forward(h); }, x);
  }
  return head->forward(x.reshape({B, -1})).squeeze(-1);
}

torch::Tensor click_loss(const torch::Tensor& logits, const torch::Tensor& labels) {
  return torch::binary_cross_entropy_with_logits(logits, labels.to(logits.scalar_type()));
}

}  // namespace models
