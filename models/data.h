// Byte-level (or pre-tokenized uint16) text data with deterministic, rank-sliceable batches.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>

namespace models {

// Always present on Debian/Ubuntu; ~260 KB of licence texts, plenty for smoke training.
inline constexpr char kDefaultCorpus[] = "/usr/share/common-licenses";

class TokenSource {
 public:
  // tokens: 1-D integer tensor of token ids in [0, vocab_size). `origin` is used in messages.
  TokenSource(torch::Tensor tokens, int64_t vocab_size, std::string origin = "<memory>");

  // - directory: every regular file below it (recursive, sorted by path, directory symlinks not
  //   followed, unreadable files skipped), bytes concatenated, tokens 0..255;
  // - "*.u16" / "*.bin": little-endian uint16 token ids, vocab = max id + 1;
  // - any other file: its bytes, tokens 0..255.
  // Throws std::runtime_error on a missing path or an empty corpus.
  static TokenSource from_path(const std::string& path = kDefaultCorpus);

  int64_t size() const;        // number of tokens
  int64_t vocab_size() const;  // 256 for bytes, max id + 1 for uint16 corpora
  const torch::Tensor& tokens() const { return tokens_; }  // int32 [size()]
  const std::string& origin() const { return origin_; }

  // The global batch for `step` is `global_batch` sequences at random offsets drawn from a private
  // generator seeded by (seed, step) -- the global torch RNG is never touched. Returns sequences
  // [begin, end) of that global batch: inputs int64 [end-begin, block_size] and targets (inputs
  // shifted by one token). Every rank computes the same global batch and keeps its own slice; a
  // single-process run uses [0, global_batch). Throws std::runtime_error if the corpus is shorter
  // than block_size + 1 or the range is invalid.
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t step, int64_t global_batch,
                                                int64_t block_size, uint64_t seed, int64_t begin,
                                                int64_t end) const;

 private:
  torch::Tensor tokens_;  // int32: holds bytes and uint16 ids at half the memory of int64
  int64_t vocab_size_;
  std::string origin_;
};

}  // namespace models
