// Text from a language model, one token at a time. Plain libtorch: whatever computes the logits
// (the model itself, or the model under fsdp) is passed in as a function.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace models {

struct SamplingOptions {
  int64_t tokens = 200;       // how many tokens to add after the prompt
  int64_t context = 128;      // the model's window: only the last `context` tokens are fed back
  double temperature = 0.8;   // 0: greedy (the most likely token every time)
  uint64_t seed = 0;          // the sampler's own generator; the global RNG is never touched
};

// `next_logits(ids)`: ids int64 [1, T] (T <= context) -> the logits of the token after them, [V]
// (float, any device). Returns `prompt` followed by `options.tokens` sampled ids. Deterministic
// for a seed and the same logits.
std::vector<int64_t> sample_tokens(const std::function<torch::Tensor(const torch::Tensor&)>& next_logits,
                                   std::vector<int64_t> prompt, const SamplingOptions& options);

// Byte-level text and token ids (tokens 0..255, as TokenSource reads text).
std::vector<int64_t> encode_bytes(const std::string& text);
// Bytes back to text for a terminal: tabs and newlines kept, other control bytes and bytes that
// are not printable ASCII shown as '?' (a byte-level model can emit half of a UTF-8 sequence).
std::string decode_bytes(const std::vector<int64_t>& ids);

}  // namespace models
