#include "models/click_data.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace models {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Independent streams for the hidden weights and for each step (negative steps included).
at::Generator generator_for(uint64_t seed, uint64_t stream) {
  return at::make_generator<at::CPUGeneratorImpl>(splitmix64(splitmix64(seed) ^ stream));
}

constexpr uint64_t kWeightsStream = 0x5EED0F'C11C4DA7ULL;

}  // namespace

ClickData::ClickData(const DHENConfig& cfg, uint64_t seed, ClickRule rule)
    : n_dense_(cfg.n_dense), n_sparse_(cfg.n_sparse), rows_(cfg.rows), seed_(seed), rule_(rule) {
  if (n_dense_ <= 0 || n_sparse_ <= 0 || rows_ <= 0) {
    throw std::invalid_argument("ClickData: n_dense, n_sparse and rows must be positive");
  }
  auto gen = generator_for(seed, kWeightsStream);
  const auto f = torch::TensorOptions().dtype(torch::kFloat);
  w_ = torch::randn({n_sparse_, rows_}, gen, f);
  // Unit length rather than N(0, 1) / sqrt(n_dense): a . x ~ N(0, 1) exactly, so the Bayes
  // figures do not swing with the seed's draw of |a|.
  a_ = torch::randn({n_dense_}, gen, f);
  a_ = a_ / a_.norm();
  u_ = torch::randn({2, rows_}, gen, f);
}

torch::Tensor ClickData::true_logit(const torch::Tensor& dense, const torch::Tensor& ids) const {
  TORCH_CHECK(dense.dim() == 2 && dense.size(1) == n_dense_ && ids.dim() == 2 && ids.size(1) == n_sparse_ &&
                  ids.size(0) == dense.size(0),
              "ClickData::true_logit: expects dense [n, ", n_dense_, "] and ids [n, ", n_sparse_, "]");
  // w_t[id_t] for every (sample, table): gather along each table's row.
  auto main = w_.unsqueeze(0).expand({ids.size(0), n_sparse_, rows_}).gather(2, ids.unsqueeze(2)).squeeze(2);
  auto s = main.sum(1) / std::sqrt(static_cast<double>(n_sparse_)) + dense.to(torch::kFloat).matmul(a_);
  if (n_sparse_ >= 2) {
    s = s + rule_.cross * u_[0].index_select(0, ids.select(1, 0)) * u_[1].index_select(0, ids.select(1, 1));
  }
  return rule_.scale * s + rule_.bias;
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> ClickData::batch(int64_t step, int64_t global_batch,
                                                                         int64_t begin, int64_t end) const {
  if (global_batch <= 0 || begin < 0 || end < begin || end > global_batch) {
    throw std::invalid_argument("ClickData::batch: invalid range [" + std::to_string(begin) + ", " +
                                std::to_string(end) + ") of a global batch of " + std::to_string(global_batch));
  }
  // The whole global batch, in a fixed order of draws, then this rank's slice.
  auto gen = generator_for(seed_, static_cast<uint64_t>(step));
  auto dense = torch::randn({global_batch, n_dense_}, gen, torch::kFloat);
  auto ids = torch::randint(0, rows_, {global_batch, n_sparse_}, gen, torch::kLong);
  auto coin = torch::rand({global_batch}, gen, torch::kFloat);
  dense = dense.slice(0, begin, end).contiguous();
  ids = ids.slice(0, begin, end).contiguous();
  auto labels = (coin.slice(0, begin, end) < torch::sigmoid(true_logit(dense, ids))).to(torch::kFloat);
  return {dense, ids, labels};
}

ClickDataStats ClickData::stats(int64_t n_samples) const {
  auto [dense, ids, labels] = batch(kHeldOutStep, n_samples, 0, n_samples);
  auto z = true_logit(dense, ids);
  ClickDataStats s{};
  s.bayes_loss = torch::binary_cross_entropy_with_logits(z, labels).item<double>();
  s.bayes_auc = auc(z, labels);
  s.base_rate = labels.mean().item<double>();
  const double p = std::clamp(s.base_rate, 1e-12, 1.0 - 1e-12);
  s.constant_loss = -(s.base_rate * std::log(p) + (1.0 - s.base_rate) * std::log(1.0 - p));
  return s;
}

double auc(const torch::Tensor& scores, const torch::Tensor& labels) {
  TORCH_CHECK(scores.dim() == 1 && labels.dim() == 1 && scores.numel() == labels.numel(),
              "auc: expects scores [n] and labels [n]");
  auto sc = scores.detach().to(torch::kCPU, torch::kDouble).contiguous();
  auto lb = labels.detach().to(torch::kCPU, torch::kDouble).contiguous();
  const int64_t n = sc.numel();
  const double* s = sc.data_ptr<double>();
  const double* y = lb.data_ptr<double>();
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [s](int64_t i, int64_t j) { return s[i] < s[j]; });
  // Sum of the positives' ranks (1-based), each run of tied scores at its average rank.
  double rank_sum = 0, positives = 0;
  for (int64_t i = 0; i < n;) {
    int64_t j = i;
    while (j < n && s[order[j]] == s[order[i]]) ++j;
    const double average_rank = 0.5 * static_cast<double>(i + 1 + j);  // ranks i+1 .. j
    for (int64_t k = i; k < j; ++k) {
      if (y[order[k]] > 0.5) {
        rank_sum += average_rank;
        positives += 1;
      }
    }
    i = j;
  }
  const double negatives = static_cast<double>(n) - positives;
  if (positives == 0 || negatives == 0) return std::numeric_limits<double>::quiet_NaN();
  return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives);
}

}  // namespace models
