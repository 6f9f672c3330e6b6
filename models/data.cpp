#include "models/data.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>
#include <vector>

namespace models {

namespace fs = std::filesystem;

namespace {

// Reads a whole file; returns false (and leaves `out` unchanged) if it cannot be read.
bool read_file_bytes(const fs::path& p, std::vector<uint8_t>& out) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return false;
  std::vector<uint8_t> buf((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return false;
  out.insert(out.end(), buf.begin(), buf.end());
  return true;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

torch::Tensor bytes_to_tensor(const std::vector<uint8_t>& bytes) {
  auto t = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kInt32);
  auto* p = t.data_ptr<int32_t>();
  for (size_t i = 0; i < bytes.size(); ++i) p[i] = bytes[i];
  return t;
}

}  // namespace

TokenSource::TokenSource(torch::Tensor tokens, int64_t vocab_size, std::string origin)
    : tokens_(std::move(tokens)), vocab_size_(vocab_size), origin_(std::move(origin)) {
  TORCH_CHECK(tokens_.dim() == 1, "TokenSource: tokens must be 1-D");
  tokens_ = tokens_.to(torch::kInt32).contiguous();
}

TokenSource TokenSource::from_path(const std::string& path) {
  std::error_code ec;
  const fs::path root(path);
  if (!fs::exists(root, ec)) {
    throw std::runtime_error("corpus path '" + path +
                             "' does not exist; pass an existing text file, a directory of text "
                             "files, or a .u16/.bin token file (default: " +
                             std::string(kDefaultCorpus) + ")");
  }

  if (fs::is_directory(root, ec)) {
    // Directory symlinks are not followed (the iterator's default), so symlink loops cannot
    // recurse; errors on individual entries (permissions, dangling links) are skipped.
    std::vector<fs::path> files;
    fs::recursive_directory_iterator it(root, fs::directory_options::skip_permission_denied, ec);
    for (const fs::recursive_directory_iterator end; !ec && it != end; it.increment(ec)) {
      std::error_code fec;
      if (it->is_regular_file(fec) && !fec) files.push_back(it->path());
    }
    if (ec) {
      throw std::runtime_error("cannot list corpus directory '" + path + "': " + ec.message() +
                               "; check permissions or pass a single file instead");
    }
    std::sort(files.begin(), files.end());  // directory order is unspecified; sort for determinism
    std::vector<uint8_t> bytes;
    for (const auto& f : files) read_file_bytes(f, bytes);
    if (bytes.empty()) {
      throw std::runtime_error("corpus directory '" + path + "' contains no readable data (" +
                               std::to_string(files.size()) +
                               " regular files found); point it at a directory with text files");
    }
    return TokenSource(bytes_to_tensor(bytes), 256, path);
  }

  std::vector<uint8_t> bytes;
  if (!read_file_bytes(root, bytes)) {
    throw std::runtime_error("cannot read corpus file '" + path + "'; check that it is a "
                             "readable regular file");
  }
  if (bytes.empty()) {
    throw std::runtime_error("corpus file '" + path + "' is empty; pass a non-empty text file");
  }

  if (ends_with(path, ".u16") || ends_with(path, ".bin")) {
    if (bytes.size() % 2 != 0) {
      throw std::runtime_error("token file '" + path + "' has an odd size (" +
                               std::to_string(bytes.size()) +
                               " bytes) but must hold little-endian uint16 ids; rename it if it "
                               "is plain text");
    }
    const int64_t n = static_cast<int64_t>(bytes.size() / 2);
    auto t = torch::empty({n}, torch::kInt32);
    auto* p = t.data_ptr<int32_t>();
    int32_t max_id = 0;
    for (int64_t i = 0; i < n; ++i) {  // decode explicitly: independent of host endianness
      p[i] = static_cast<int32_t>(bytes[2 * i]) | (static_cast<int32_t>(bytes[2 * i + 1]) << 8);
      max_id = std::max(max_id, p[i]);
    }
    return TokenSource(t, static_cast<int64_t>(max_id) + 1, path);
  }
  return TokenSource(bytes_to_tensor(bytes), 256, path);
}

int64_t TokenSource::size() const { return tokens_.size(0); }

int64_t TokenSource::vocab_size() const { return vocab_size_; }

std::pair<torch::Tensor, torch::Tensor> TokenSource::batch(int64_t step, int64_t global_batch,
                                                           int64_t block_size, uint64_t seed,
                                                           int64_t begin, int64_t end) const {
  if (block_size <= 0 || global_batch <= 0) {
    throw std::runtime_error("batch(): global_batch and block_size must be positive (got " +
                             std::to_string(global_batch) + ", " + std::to_string(block_size) +
                             ")");
  }
  if (begin < 0 || end < begin || end > global_batch) {
    throw std::runtime_error("batch(): slice [" + std::to_string(begin) + ", " +
                             std::to_string(end) + ") is not inside the global batch of " +
                             std::to_string(global_batch));
  }
  if (size() < block_size + 1) {
    throw std::runtime_error("corpus '" + origin_ + "' has " + std::to_string(size()) +
                             " tokens, fewer than block_size + 1 = " +
                             std::to_string(block_size + 1) +
                             "; use a larger corpus or a smaller block size");
  }

  // A private generator keyed by (seed, step): batches are reproducible, independent of the
  // global torch RNG (so model init / dropout cannot shift them), and identical on every rank.
  std::mt19937_64 rng(seed * 1000003ULL + static_cast<uint64_t>(step));
  const uint64_t n_starts = static_cast<uint64_t>(size() - block_size);  // starts in [0, n_starts)
  std::vector<int64_t> starts(static_cast<size_t>(global_batch));
  // Plain modulo rather than std::uniform_int_distribution, whose output differs between standard
  // libraries; the bias is negligible for corpora far smaller than 2^64.
  for (auto& s : starts) s = static_cast<int64_t>(rng() % n_starts);

  const int64_t n = end - begin;
  auto inputs = torch::empty({n, block_size}, torch::kInt64);
  auto targets = torch::empty({n, block_size}, torch::kInt64);
  const int32_t* src = tokens_.data_ptr<int32_t>();
  int64_t* in = inputs.data_ptr<int64_t>();
  int64_t* tg = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    const int32_t* seq = src + starts[static_cast<size_t>(begin + r)];
    for (int64_t j = 0; j < block_size; ++j) {
      in[r * block_size + j] = seq[j];
      tg[r * block_size + j] = seq[j + 1];
    }
  }
  return {inputs, targets};
}

}  // namespace models
