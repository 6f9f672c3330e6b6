// Synthetic click data with a KNOWN generating rule, for DHEN (models/dhen.h): deterministic
// and rank-sliceable like TokenSource::batch (models/data.h), and with the Bayes-optimal loss and
// AUC computable, so a run can say how close to the best possible model it got.
//
// The rule, for a sample with dense features x ~ N(0, I) [n_dense] and one id per table, drawn
// uniformly from [0, rows) (uniform, not Zipf-like: every row is seen about equally often):
//   z = scale * (sum_t w_t[id_t] / sqrt(n_sparse) + a . x + cross * u_0[id_0] * u_1[id_1]) + bias
//   label ~ Bernoulli(sigmoid(z))
// with hidden weights drawn once from the seed: w_t[id] ~ N(0, 1) per (table, id), a a random
// unit vector (so a . x ~ N(0, 1) at every seed), and u_0, u_1 ~ N(0, 1) per id of tables 0 and
// 1: a pairwise interaction between tables 0 and 1 independent of their main effects (absent
// when n_sparse < 2), which only a model that multiplies the two embeddings (the cross, the
// attention) can learn. scale, cross and bias: ClickRule below (1.0, 0.5, -1.15).
//
// Measured (2026-12-01, fsdp-train's defaults: AdamW lr 2e-3, weight decay 0.1, clip 1.0, global
// batch 256, held-out batches of 8192 samples; the Bayes figures on 65536 held-out samples):
//   build/bin/fsdp-train --nproc-per-node 2 --model dhen-small --steps 2000 --eval-every 500
//     seed 1234 (default): Bayes 0.4714 / 0.8108, constant loss 0.6110; held-out loss / AUC
//       0.5221 / 0.7564 after 500 steps, 0.5045 / 0.7736 after 1000, 0.5040 / 0.7793 after 2000
//   the same with --steps 1000 --eval-every 1000 --seed S, after 1000 steps:
//     seed 1: Bayes 0.4716 / 0.8152; 0.5074 / 0.7765
//     seed 2: Bayes 0.4711 / 0.8114; 0.5171 / 0.7680
//     seed 3: Bayes 0.4697 / 0.8140; 0.5261 / 0.7621
//   What is left against the Bayes figures is mostly the tables 0 x 1 interaction and per-id noise
//   (train and held-out losses agree: no overfitting).
// STATED TARGET: dhen-small, fsdp-train's defaults as above, any world size (the global batch is
// sliced across ranks; the same math as one process): held-out loss <= 0.53 and held-out AUC >=
// 0.76 within 1000 steps (predicting the base rate: 0.61 / 0.5; Bayes: 0.47 / 0.81). Checked by
// ctest MainJob.DHENReachesItsStatedTarget at W = 2 with the default seed.
#pragma once

#include "models/dhen.h"

#include <torch/torch.h>

#include <cstdint>
#include <tuple>

namespace models {

struct ClickDataStats {
  double bayes_loss;     // mean BCE of the true probabilities: the best any model can do
  double bayes_auc;      // AUC of the true logits
  double base_rate;      // fraction of positive labels
  double constant_loss;  // BCE of predicting the base rate for every sample
};

// The rule's constants (see above). The defaults give a Bayes AUC of about 0.81 and a base rate
// of about 0.30 at every seed; tests may make the problem easier or harder.
struct ClickRule {
  double scale = 1.0;
  double cross = 0.5;
  double bias = -1.15;
};

class ClickData {
 public:
  // Uses cfg's n_dense, n_sparse and rows. The hidden weights come from a private generator
  // seeded by `seed`; the global torch RNG is never touched.
  ClickData(const DHENConfig& cfg, uint64_t seed, ClickRule rule = {});

  // The global batch for `step` is `global_batch` samples from a private generator seeded by
  // (seed, step); every rank computes the same global batch and keeps samples [begin, end).
  // Negative steps are held-out data (stats() uses step -1). Returns dense float [n, n_dense],
  // ids int64 [n, n_sparse], labels float [n] (0 / 1), n = end - begin. Throws
  // std::invalid_argument on an invalid range.
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> batch(int64_t step, int64_t global_batch, int64_t begin,
                                                                int64_t end) const;

  // The true logit z of samples (dense [n, n_dense], ids [n, n_sparse]) -> [n].
  torch::Tensor true_logit(const torch::Tensor& dense, const torch::Tensor& ids) const;

  // On the held-out batch(-1, n_samples, 0, n_samples): evaluate a model on that same batch to
  // compare it with these figures sample for sample.
  ClickDataStats stats(int64_t n_samples) const;

  static constexpr int64_t kHeldOutStep = -1;
  const ClickRule& rule() const { return rule_; }

 private:
  int64_t n_dense_, n_sparse_, rows_;
  uint64_t seed_;
  ClickRule rule_;
  torch::Tensor w_;  // [n_sparse, rows]: main effect of each (table, id)
  torch::Tensor a_;  // [n_dense]
  torch::Tensor u_;  // [2, rows]: the interaction factors of tables 0 and 1
};

// Area under the ROC curve of `scores` for binary `labels` (both [n]), rank-based (the
// Mann-Whitney statistic) with tied scores given their average rank. NaN when the labels are
// all one class.
double auc(const torch::Tensor& scores, const torch::Tensor& labels);

}  // namespace models
