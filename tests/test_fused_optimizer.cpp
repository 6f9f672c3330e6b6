// fsdp::FusedAdamW and fsdp::FusedSGD (include/fsdp/fused_optimizer.h) against libtorch's AdamW and
// SGD, stepped side by side on the same parameters and gradients: the state bit for bit, the
// parameters bit for bit (SGD) or within the stated bound (AdamW), and the state interchangeable.
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/fused_optimizer.h"

namespace {

// Sizes with vector tails of every length, a parameter of one element, and one spread over
// several of the kernel's chunks.
const std::vector<int64_t> kSizes = {1, 7, 33, 1000, 70001};

struct Twin {
  std::vector<torch::Tensor> fused, reference;  // same values, separate storage
};

Twin make_params(at::ScalarType dtype) {
  torch::manual_seed(7);
  Twin t;
  for (int64_t n : kSizes) {
    auto v = torch::randn({n}, dtype);
    t.fused.push_back(v.clone().requires_grad_(true));
    t.reference.push_back(v.clone().requires_grad_(true));
  }
  return t;
}

// Gradients of step `s`: the same for both, of mixed magnitudes (Adam's denominator spans decades),
// some exactly zero.
void set_grads(Twin& t, int s) {
  torch::manual_seed(1000 + s);
  for (size_t i = 0; i < t.fused.size(); ++i) {
    auto g = torch::randn(t.fused[i].sizes(), t.fused[i].scalar_type()) *
             torch::pow(10.0, torch::randint(-4, 1, t.fused[i].sizes()).to(t.fused[i].scalar_type()));
    g.masked_fill_(torch::rand(t.fused[i].sizes()) < 0.05, 0.0);
    t.fused[i].mutable_grad() = g.clone();
    t.reference[i].mutable_grad() = g.clone();
  }
}

// Two groups as fsdp-train builds them: weight decay on the first half, none on the rest.
template <typename Options>
std::vector<torch::optim::OptimizerParamGroup> groups(const std::vector<torch::Tensor>& p, const Options& decay,
                                                      const Options& no_decay) {
  const size_t half = p.size() / 2;
  std::vector<torch::optim::OptimizerParamGroup> g;
  g.emplace_back(std::vector<torch::Tensor>(p.begin(), p.begin() + half), std::make_unique<Options>(decay));
  g.emplace_back(std::vector<torch::Tensor>(p.begin() + half, p.end()), std::make_unique<Options>(no_decay));
  return g;
}

// How many representable values apart a and b are (same sign assumed; 0 when bitwise equal).
int64_t ulps_apart(const torch::Tensor& a, const torch::Tensor& b) {
  int64_t worst = 0;
  if (a.scalar_type() == at::kFloat) {
    auto x = a.contiguous(), y = b.contiguous();
    const int32_t* xi = reinterpret_cast<const int32_t*>(x.data_ptr<float>());
    const int32_t* yi = reinterpret_cast<const int32_t*>(y.data_ptr<float>());
    for (int64_t i = 0; i < x.numel(); ++i) worst = std::max<int64_t>(worst, std::llabs(int64_t{xi[i]} - yi[i]));
  } else {
    auto x = a.contiguous(), y = b.contiguous();
    const int64_t* xi = reinterpret_cast<const int64_t*>(x.data_ptr<double>());
    const int64_t* yi = reinterpret_cast<const int64_t*>(y.data_ptr<double>());
    for (int64_t i = 0; i < x.numel(); ++i) {
      const int64_t d = xi[i] > yi[i] ? xi[i] - yi[i] : yi[i] - xi[i];
      worst = std::max(worst, d);
    }
  }
  return worst;
}

bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.numel() * a.element_size()) == 0;
}

// The stated bound (fused_optimizer.h): where libtorch's sqrt rounds off by one ulp, the update
// differs in its last bits, and the parameter's sum may round the other way: per step at most a
// rounding of the parameter and a few of the update (ε·|p| + 4ε·lr, ε the dtype's epsilon). Over
// n steps the differences add up to at most n times that. Returns the worst |difference| / bound
// over every element and step (≤ 1 holds the bound), and checks the moments bit for bit.
double adamw_50_steps(at::ScalarType dtype, bool amsgrad, double* worst_abs) {
  Twin t = make_params(dtype);
  const double lr = 1e-3;
  const auto decay = torch::optim::AdamWOptions(lr).weight_decay(0.1).amsgrad(amsgrad);
  const auto no_decay = torch::optim::AdamWOptions(lr).weight_decay(0.0).amsgrad(amsgrad);
  fsdp::FusedAdamW fused(groups(t.fused, decay, no_decay));
  torch::optim::AdamW reference(groups(t.reference, decay, no_decay));
  const double eps = dtype == at::kFloat ? std::numeric_limits<float>::epsilon() : std::numeric_limits<double>::epsilon();
  double worst = 0;
  *worst_abs = 0;
  for (int s = 0; s < 50; ++s) {
    set_grads(t, s);
    fused.step();
    reference.step();
    for (size_t i = 0; i < t.fused.size(); ++i) {
      auto& fs = static_cast<torch::optim::AdamWParamState&>(*fused.state().at(t.fused[i].unsafeGetTensorImpl()));
      auto& rs = static_cast<torch::optim::AdamWParamState&>(*reference.state().at(t.reference[i].unsafeGetTensorImpl()));
      EXPECT_EQ(fs.step(), rs.step());
      // The moments do not depend on the parameters: equal to the bit.
      EXPECT_TRUE(bitwise_equal(fs.exp_avg(), rs.exp_avg())) << "exp_avg of parameter " << i << " at step " << s;
      EXPECT_TRUE(bitwise_equal(fs.exp_avg_sq(), rs.exp_avg_sq())) << "exp_avg_sq of parameter " << i << " at step " << s;
      if (amsgrad) EXPECT_TRUE(bitwise_equal(fs.max_exp_avg_sq(), rs.max_exp_avg_sq())) << "parameter " << i;
      const auto a = t.fused[i].detach().to(at::kDouble), b = t.reference[i].detach().to(at::kDouble);
      const auto diff = (a - b).abs();
      const auto bound = (s + 1) * (eps * b.abs() + 4 * eps * lr);
      worst = std::max(worst, (diff / bound).max().item<double>());
      *worst_abs = std::max(*worst_abs, diff.max().item<double>());
    }
  }
  return worst;
}

TEST(FusedOptimizer, AdamWMomentsBitForBitAndParametersWithinBoundOver50Steps) {
  double abs = 0;
  const double worst = adamw_50_steps(at::kFloat, false, &abs);
  std::cout << "FusedAdamW float32, 50 steps: max |p - libtorch's p| " << abs << ", " << worst << " of the bound"
            << std::endl;
  EXPECT_LE(worst, 1.0);
}

TEST(FusedOptimizer, AdamWWithAmsgradAndInDoubleStaysWithinTheBound) {
  double abs_ams = 0, abs_dbl = 0;
  const double ams = adamw_50_steps(at::kFloat, true, &abs_ams);
  const double dbl = adamw_50_steps(at::kDouble, false, &abs_dbl);
  std::cout << "FusedAdamW amsgrad: max |dp| " << abs_ams << " (" << ams << " of the bound), float64: " << abs_dbl << " ("
            << dbl << " of the bound)" << std::endl;
  EXPECT_LE(ams, 1.0);
  EXPECT_LE(dbl, 1.0);
}

TEST(FusedOptimizer, SGDIsLibtorchsBitForBit) {
  struct Case {
    double momentum, dampening, weight_decay;
    bool nesterov;
  };
  for (const Case c : {Case{0.9, 0.0, 0.0, false}, Case{0.9, 0.1, 1e-2, false}, Case{0.9, 0.0, 1e-2, true},
                       Case{0.0, 0.0, 1e-2, false}}) {
    for (const auto dtype : {at::kFloat, at::kDouble}) {
      Twin t = make_params(dtype);
      const auto o = torch::optim::SGDOptions(0.05).momentum(c.momentum).dampening(c.dampening).nesterov(c.nesterov);
      const auto decay = torch::optim::SGDOptions(o).weight_decay(c.weight_decay);
      fsdp::FusedSGD fused(groups(t.fused, decay, o), o);
      torch::optim::SGD reference(groups(t.reference, decay, o), o);
      for (int s = 0; s < 50; ++s) {
        set_grads(t, s);
        fused.step();
        reference.step();
      }
      for (size_t i = 0; i < t.fused.size(); ++i) {
        EXPECT_TRUE(bitwise_equal(t.fused[i].detach(), t.reference[i].detach()))
            << "momentum " << c.momentum << " nesterov " << c.nesterov << " parameter " << i << " ("
            << ulps_apart(t.fused[i].detach(), t.reference[i].detach()) << " ulp)";
        if (c.momentum != 0) {
          auto& fs = static_cast<torch::optim::SGDParamState&>(*fused.state().at(t.fused[i].unsafeGetTensorImpl()));
          auto& rs = static_cast<torch::optim::SGDParamState&>(*reference.state().at(t.reference[i].unsafeGetTensorImpl()));
          EXPECT_TRUE(bitwise_equal(fs.momentum_buffer(), rs.momentum_buffer()));
        } else {
          EXPECT_TRUE(fused.state().empty());
        }
      }
    }
  }
}

// The state is libtorch's: a FusedAdamW's archive loads into torch::optim::AdamW and the other way,
// and the run goes on as if nothing had changed.
TEST(FusedOptimizer, StateMovesBetweenFusedAndLibtorchAdamWBothWays) {
  Twin t = make_params(at::kFloat);
  auto a = t.fused;
  std::vector<torch::Tensor> b;
  for (auto& p : t.fused) b.push_back(p.detach().clone().requires_grad_(true));
  fsdp::FusedAdamW first(a, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  for (int s = 0; s < 5; ++s) {
    for (size_t i = 0; i < a.size(); ++i) a[i].mutable_grad() = torch::ones_like(a[i]) * (s + 1);
    first.step();
  }
  std::stringstream saved;
  {
    torch::serialize::OutputArchive out;
    first.save(out);
    out.save_to(saved);
  }
  for (size_t i = 0; i < a.size(); ++i) {
    torch::NoGradGuard no_grad;
    b[i].copy_(a[i]);
  }
  torch::optim::AdamW second(b, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  {
    torch::serialize::InputArchive in;
    in.load_from(saved);
    second.load(in);
  }
  ASSERT_EQ(second.state().size(), a.size());
  auto& s0 = static_cast<torch::optim::AdamWParamState&>(*second.state().at(b[3].unsafeGetTensorImpl()));
  auto& f0 = static_cast<torch::optim::AdamWParamState&>(*first.state().at(a[3].unsafeGetTensorImpl()));
  EXPECT_EQ(s0.step(), 5);
  EXPECT_TRUE(bitwise_equal(s0.exp_avg(), f0.exp_avg()));
  // And back: libtorch's archive into a new FusedAdamW, which continues from step 6.
  std::stringstream again;
  {
    torch::serialize::OutputArchive out;
    second.save(out);
    out.save_to(again);
  }
  fsdp::FusedAdamW third(b, torch::optim::AdamWOptions(1e-3).weight_decay(0.1));
  {
    torch::serialize::InputArchive in;
    in.load_from(again);
    third.load(in);
  }
  for (size_t i = 0; i < a.size(); ++i) {
    a[i].mutable_grad() = torch::ones_like(a[i]) * 6;
    b[i].mutable_grad() = torch::ones_like(b[i]) * 6;
  }
  first.step();
  third.step();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i].detach(), b[i].detach())) << "parameter " << i;
  EXPECT_EQ(static_cast<torch::optim::AdamWParamState&>(*third.state().at(b[0].unsafeGetTensorImpl())).step(), 6);
}

TEST(FusedOptimizer, ParametersWithoutGradientsAreLeftAsLibtorchLeavesThem) {
  auto p = torch::ones({4}).requires_grad_(true), q = torch::ones({4}).requires_grad_(true);
  fsdp::FusedAdamW opt(std::vector<torch::Tensor>{p, q}, torch::optim::AdamWOptions(0.1).weight_decay(0.5));
  p.mutable_grad() = torch::ones({4});
  opt.step();
  EXPECT_TRUE(torch::equal(q.detach(), torch::ones({4})));  // untouched, no weight decay either
  EXPECT_EQ(opt.state().count(q.unsafeGetTensorImpl()), 0u);
  EXPECT_EQ(opt.state().count(p.unsafeGetTensorImpl()), 1u);
}

// MixedPrecision::keep_low_precision_grads leaves bf16 gradients on fp32 parameters: libtorch's
// optimizers promote them, and so do the fused ones (they refused them, telling the user to cast).
TEST(FusedOptimizer, LowPrecisionGradientsStepAsLibtorchStepsThem) {
  for (const auto low : {torch::kBFloat16, torch::kHalf}) {
    torch::manual_seed(3);
    auto a = torch::randn({7, 5}).requires_grad_(true), b = a.detach().clone().requires_grad_(true);
    auto c = a.detach().clone().requires_grad_(true), d = a.detach().clone().requires_grad_(true);
    fsdp::FusedAdamW fused(std::vector<torch::Tensor>{a}, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    torch::optim::AdamW libtorch(std::vector<torch::Tensor>{b}, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    fsdp::FusedSGD fused_sgd(std::vector<torch::Tensor>{c}, torch::optim::SGDOptions(1e-2).momentum(0.9));
    torch::optim::SGD sgd(std::vector<torch::Tensor>{d}, torch::optim::SGDOptions(1e-2).momentum(0.9));
    for (int step = 0; step < 5; ++step) {
      const auto g = torch::randn({7, 5}).to(low);
      a.mutable_grad() = g.clone();
      b.mutable_grad() = g.to(torch::kFloat);
      c.mutable_grad() = g.clone();
      d.mutable_grad() = g.to(torch::kFloat);
      fused.step();
      libtorch.step();
      fused_sgd.step();
      sgd.step();
    }
    EXPECT_LE((a - b).abs().max().item<double>(), 5 * 2.4e-7) << c10::toString(low);
    EXPECT_TRUE(torch::equal(c.detach(), d.detach())) << c10::toString(low);
    EXPECT_EQ(a.grad().scalar_type(), low) << "the gradient itself is left as it was";
  }
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(FusedOptimizer, RefusesWhatItCannotStepByName) {
  auto half = torch::ones({4}, torch::kBFloat16).requires_grad_(true);
  half.mutable_grad() = torch::ones({4}, torch::kBFloat16);
  EXPECT_NE(error_of([&] { fsdp::FusedAdamW(std::vector<torch::Tensor>{half}).step(); }).find("BFloat16"), std::string::npos);
  auto w = torch::ones({4}).requires_grad_(true);
  const std::string twice = error_of([&] { fsdp::FusedAdamW(std::vector<torch::Tensor>{w, w}); });
  EXPECT_NE(twice.find("listed twice"), std::string::npos) << twice;
  auto e = torch::ones({4, 2}).requires_grad_(true);
  e.mutable_grad() = torch::ones({4, 2}).to_sparse();
  EXPECT_NE(error_of([&] { fsdp::FusedSGD(std::vector<torch::Tensor>{e}, torch::optim::SGDOptions(0.1)).step(); }).find("sparse"),
            std::string::npos);
  auto strided = torch::ones({4, 4}).t().requires_grad_(true);  // a non-contiguous leaf
  strided.mutable_grad() = torch::ones({4, 4});
  EXPECT_NE(error_of([&] { fsdp::FusedAdamW(std::vector<torch::Tensor>{strided}).step(); }).find("contiguous"),
            std::string::npos);
}

// The outside review of issue 38: what libtorch refuses, refused alike, naming the cause.
TEST(FusedOptimizer, RefusesWhatLibtorchRefusesNamingTheCause) {
  // A gradient of another shape but as many elements: read flat it would land on the wrong elements.
  auto a = torch::arange(12, torch::kFloat).view({3, 4}).requires_grad_(true);
  a.mutable_grad() = torch::eye(4, 3);
  const std::string shape = error_of([&] { fsdp::FusedSGD(std::vector<torch::Tensor>{a}, torch::optim::SGDOptions(1.0)).step(); });
  EXPECT_NE(shape.find("shape"), std::string::npos) << shape;
  EXPECT_TRUE(torch::equal(a.detach(), torch::arange(12, torch::kFloat).view({3, 4}))) << "stepped before refusing";
  // A float32 gradient on a float64 parameter: the message says dtype, not "contiguous".
  auto q = torch::randn({5}, torch::kDouble).requires_grad_(true);
  q.mutable_grad() = torch::randn({5});
  const std::string dtype = error_of([&] { fsdp::FusedAdamW(std::vector<torch::Tensor>{q}).step(); });
  EXPECT_NE(dtype.find("Float"), std::string::npos) << dtype;
  EXPECT_NE(dtype.find("cast"), std::string::npos) << dtype;
  // Options libtorch's constructors refuse.
  auto p = torch::randn({4}).requires_grad_(true);
  const std::vector<torch::Tensor> ps{p};
  EXPECT_NE(error_of([&] { fsdp::FusedAdamW(ps, torch::optim::AdamWOptions(-1e-3)); }).find("learning rate"), std::string::npos);
  EXPECT_NE(error_of([&] { fsdp::FusedAdamW(ps, torch::optim::AdamWOptions(1e-3).betas({1.0, 0.999})); }).find("betas"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fsdp::FusedAdamW(ps, torch::optim::AdamWOptions(1e-3).eps(-1)); }).find("epsilon"), std::string::npos);
  EXPECT_NE(error_of([&] { fsdp::FusedSGD(ps, torch::optim::SGDOptions(0.1).nesterov(true)); }).find("Nesterov"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fsdp::FusedSGD(ps, torch::optim::SGDOptions(0.1).momentum(-1)); }).find("momentum"),
            std::string::npos);
}

}  // namespace
