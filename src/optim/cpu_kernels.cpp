// One pass per element, in the rounding of libtorch's CPU operators (include/fsdp/fused_optimizer.h
// says what that buys): ATen's vectorized add with alpha is fma(other, alpha, self), addcmul is
// fma(value·t1, t2, self), addcdiv is (value·t1)/t2 + self, and a scalar argument is rounded to the
// tensor's dtype first. Built with -ffp-contract=off (no multiply-add but the explicit std::fma:
// p·decay + update must round twice, as libtorch's mul_ then addcdiv_ do) and -fno-math-errno (so
// that sqrt vectorizes; it is the correctly rounded IEEE square root either way).
#include "optim/cpu_kernels.h"

#include <cmath>

// On x86-64 every loop is built for AVX-512, AVX2 with FMA and the baseline, and the loader picks
// the best the CPU has. The baseline computes the same values (std::fma is exact everywhere), only
// slower where the CPU has no FMA instruction.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FSDP_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FSDP_VECTOR_CLONES
#endif

namespace fsdp::optim::cpu {
namespace {

// torch.maximum: NaN when either is NaN.
template <typename T>
inline T nan_max(T a, T b) {
  return a != a ? a : (b != b || b > a ? b : a);
}

template <typename T>
inline __attribute__((always_inline)) void adamw_loop(T* __restrict p, const T* __restrict g, T* __restrict m,
                                                      T* __restrict v, T* __restrict vmax, int64_t n,
                                                      const AdamWStep<T> s) {
  if (vmax == nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      const T gi = g[i];
      const T mi = std::fma(gi, s.one_minus_beta1, m[i] * s.beta1);     // exp_avg.mul_(β1).add_(g, 1-β1)
      const T vi = std::fma(s.one_minus_beta2 * gi, gi, v[i] * s.beta2);  // exp_avg_sq.mul_(β2).addcmul_(g, g, 1-β2)
      m[i] = mi;
      v[i] = vi;
      const T den = std::sqrt(vi) / s.bc2_sqrt + s.eps;                   // (sqrt / sqrt(bc2)).add_(eps)
      p[i] = (s.neg_step * mi) / den + p[i] * s.decay;                    // p.mul_(decay), then addcdiv_
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const T gi = g[i];
      const T mi = std::fma(gi, s.one_minus_beta1, m[i] * s.beta1);
      const T vi = std::fma(s.one_minus_beta2 * gi, gi, v[i] * s.beta2);
      m[i] = mi;
      v[i] = vi;
      const T mx = nan_max(vmax[i], vi);  // torch::max_out(max_exp_avg_sq, exp_avg_sq, max_exp_avg_sq)
      vmax[i] = mx;
      const T den = std::sqrt(mx) / s.bc2_sqrt + s.eps;
      p[i] = (s.neg_step * mi) / den + p[i] * s.decay;
    }
  }
}

template <typename T>
inline __attribute__((always_inline)) void sgd_loop(T* __restrict p, const T* __restrict g, T* __restrict buf,
                                                    int64_t n, const SGDStep<T> s) {
  for (int64_t i = 0; i < n; ++i) {
    // d_p = grad.add(p, wd): fma(p, wd, grad)
    T d = s.has_weight_decay ? std::fma(p[i], s.weight_decay, g[i]) : g[i];
    if (s.has_momentum) {
      // A new buffer is the direction itself; else buf.mul_(momentum).add_(d, 1 - dampening).
      const T b = s.fresh ? d : std::fma(d, s.one_minus_dampening, buf[i] * s.momentum);
      buf[i] = b;
      d = s.nesterov ? std::fma(b, s.momentum, d) : b;  // d.add(buf, momentum)
    }
    p[i] = std::fma(d, s.neg_lr, p[i]);  // p.add_(d, -lr)
  }
}

}  // namespace

FSDP_VECTOR_CLONES void adamw(float* p, const float* g, float* m, float* v, float* vmax, int64_t n,
                              const AdamWStep<float>& s) {
  adamw_loop(p, g, m, v, vmax, n, s);
}
FSDP_VECTOR_CLONES void adamw(double* p, const double* g, double* m, double* v, double* vmax, int64_t n,
                              const AdamWStep<double>& s) {
  adamw_loop(p, g, m, v, vmax, n, s);
}
FSDP_VECTOR_CLONES void sgd(float* p, const float* g, float* buf, int64_t n, const SGDStep<float>& s) {
  sgd_loop(p, g, buf, n, s);
}
FSDP_VECTOR_CLONES void sgd(double* p, const double* g, double* buf, int64_t n, const SGDStep<double>& s) {
  sgd_loop(p, g, buf, n, s);
}

}  // namespace fsdp::optim::cpu
