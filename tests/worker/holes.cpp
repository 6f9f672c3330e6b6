// fsdp-test-worker holes --case NAME [--strategy S] [--mixed-precision P] --out PREFIX
//   The edges of "a loop correct in plain libtorch is correct under fsdp" (issue 24), one case per
//   loop an outside review wrote: each runs the loop under fsdp and the same loop on a local model
//   of the global batch, and writes how far this rank's parameters (and gradients) are from the
//   local ones, or the error fsdp gave ("" when none):
//     two_towers        l_main.backward(retain_graph); l_aux.backward() on one forward; step
//     two_forwards      two forwards, each backwarded on its own; step
//     max_norm          an Embedding with max_norm (renormalizes its weight in forward); step
//     grad_of_params    torch::autograd::grad with respect to parameters (refused by name)
//     unfreeze          block 0 frozen at wrapping, unfrozen after the first step
//     nested_roots      a wrapped teacher called inside a wrapped student's forward
//     backward_throws   a hook throws in backward; zero_grad; training continues
//     forward_throws    a hook throws in forward; training continues
//     raw_pointer       a kernel that reads weights by data_ptr(), inside an unshard() scope
//     no_sync_clip      clip_grad_norm_ / step (libtorch's and fsdp's fused optimizers) after a no_sync
//                       backward (refused by name)
//     frozen_blocks     a trainable first layer before 6 frozen blocks: how many units backward holds
//                       gathered at once, by Metrics::memory and by live tensor bytes
#include <algorithm>
#include <cstring>

#include "fsdp/fused_optimizer.h"
#include "fsdp/process_memory.h"
#include "worker.h"

namespace worker {
namespace {

models::GPT tiny_gpt(bool frozen_first_block = false) {
  torch::manual_seed(0);
  models::GPT m(models::GPTConfig::preset("tiny"));
  if (frozen_first_block) {
    for (auto& p : m->blocks[0]->parameters()) p.requires_grad_(false);
  }
  return m;
}

// Rows [begin, end) of the global batch `step` of the tiny GPT's data.
std::pair<torch::Tensor, torch::Tensor> gpt_batch(int64_t step, int64_t begin, int64_t end) {
  return corpus().batch(step, kGlobalBatch, 32, 11, begin, end);
}

// An embedding whose rows are renormalized to max_norm in forward (libtorch's Embedding option),
// then a head: the in-place write to a parameter during forward.
struct MaxNormNetImpl : torch::nn::Module {
  MaxNormNetImpl() {
    emb = register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(256, 16).max_norm(1.0)));
    head = register_module("head", torch::nn::Linear(16, 256));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(emb(x)); }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(MaxNormNet);

// y = x W^T computed by a hand-written loop over W's raw storage (data_ptr), with its own backward:
// what a custom kernel does, invisible to the dispatcher.
struct RawLinearFn : torch::autograd::Function<RawLinearFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor w) {
    ctx->save_for_backward({x, w});
    const auto xc = x.contiguous();
    const int64_t n = xc.size(0), in = xc.size(1), out = w.size(0);
    TORCH_CHECK(w.dim() == 2 && w.size(1) == in, "RawLinear: the weight is not [out, in] (a 1-D shard?)");
    torch::Tensor y = torch::zeros({n, out});
    const float* W = w.data_ptr<float>();
    const float* X = xc.data_ptr<float>();
    float* Y = y.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t o = 0; o < out; ++o) {
        float s = 0;
        for (int64_t k = 0; k < in; ++k) s += X[i * in + k] * W[o * in + k];
        Y[i * out + o] = s;
      }
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor x = saved[0].contiguous(), w = saved[1], g = grads[0].contiguous();
    const int64_t n = x.size(0), in = x.size(1), out = w.size(0);
    torch::Tensor gx = torch::zeros({n, in}), gw = torch::zeros({out, in});
    const float* W = w.data_ptr<float>();
    const float* X = x.data_ptr<float>();
    const float* G = g.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t o = 0; o < out; ++o)
        for (int64_t k = 0; k < in; ++k) {
          gx.data_ptr<float>()[i * in + k] += G[i * out + o] * W[o * in + k];
          gw.data_ptr<float>()[o * in + k] += G[i * out + o] * X[i * in + k];
        }
    return {gx, gw};
  }
};

// A trainable first layer, then six frozen blocks (each its own unit), then a trainable head: the
// gradient reaches the first layer through every frozen block.
struct FrozenStackImpl : torch::nn::Module {
  static constexpr int64_t kWidth = 256;
  FrozenStackImpl() {
    first = register_module("first", torch::nn::Linear(kWidth, kWidth));
    for (int i = 0; i < 6; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), torch::nn::Linear(kWidth, kWidth)));
      for (auto& p : blocks.back()->parameters()) p.requires_grad_(false);
    }
    head = register_module("head", torch::nn::Linear(kWidth, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = first(x);
    for (auto& b : blocks) h = torch::tanh(b(h));
    return head(h);
  }
  torch::nn::Linear first{nullptr}, head{nullptr};
  std::vector<torch::nn::Linear> blocks;
};
TORCH_MODULE(FrozenStack);

// A layer whose forward and backward read the weight's storage by pointer (RawLinearFn).
struct RawLinearImpl : torch::nn::Module {
  RawLinearImpl() { weight = register_parameter("weight", torch::randn({16, 16}) * 0.2); }
  torch::Tensor forward(const torch::Tensor& x) { return RawLinearFn::apply(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(RawLinear);

struct RawNetImpl : torch::nn::Module {
  RawNetImpl() {
    first = register_module("first", torch::nn::Linear(16, 16));
    raw = register_module("raw", RawLinear());
    last = register_module("last", torch::nn::Linear(16, 16));
  }
  torch::Tensor forward(const torch::Tensor& x) { return last(raw(torch::tanh(first(x)))); }
  torch::nn::Linear first{nullptr}, last{nullptr};
  RawLinear raw{nullptr};
};
TORCH_MODULE(RawNet);

}  // namespace

json run_holes(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const int rank = mesh->rank(), W = mesh->world_size();
  const int64_t per = kGlobalBatch / W, lo = rank * per, hi = lo + per;
  fsdp::Options opts = options_from(a);
  if (a.mixed_precision != "none") {
    const auto d = fsdp::parse_dtype(a.mixed_precision);
    opts.mixed_precision = fsdp::MixedPrecision{d, d, d, false};
  }
  const std::string& c = a.hole;
  json out{{"case", c}, {"rank", rank}, {"error", ""}};
  auto sgd = [](const std::vector<torch::Tensor>& params) {
    return torch::optim::SGD(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  };

  if (c == "two_towers" || c == "two_forwards" || c == "unfreeze" || c == "backward_throws" ||
      c == "forward_throws" || c == "no_sync_clip") {
    opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
    const bool frozen = c == "unfreeze";
    auto model = tiny_gpt(frozen);
    auto local = tiny_gpt(frozen);
    fsdp::FullyShardedDataParallel sharded(model, mesh, opts);
    auto optim = sgd(sharded.parameters());
    auto local_params = unique_params(*local);
    std::vector<torch::Tensor> lp;
    for (auto& kv : local_params) lp.push_back(kv.second);
    auto local_optim = sgd(lp);
    for (int step = 0; step < 3; ++step) {
      if (c == "unfreeze" && step == 1) {
        // Progressive unfreezing: the first block trains from the second step on.
        for (auto& p : model->blocks[0]->parameters()) p.requires_grad_(true);
        for (auto& p : local->blocks[0]->parameters()) p.requires_grad_(true);
      }
      optim.zero_grad();
      local_optim.zero_grad();
      auto [x, y] = gpt_batch(step, lo, hi);
      auto [gx, gy] = gpt_batch(step, 0, kGlobalBatch);
      auto [x2, y2] = gpt_batch(100 + step, lo, hi);
      auto [gx2, gy2] = gpt_batch(100 + step, 0, kGlobalBatch);
      const std::string err = error_of([&] {
        if (c == "two_towers") {
          // The main tower is the whole model; the auxiliary one reads the first block's output.
          auto towers = [](models::GPTImpl& m, const torch::Tensor& ids) {
            auto pos = torch::arange(ids.size(1), torch::kLong);
            auto h = m.tok_emb(ids) + m.pos_emb(pos);
            auto first = m.blocks[0]->as<models::BlockImpl>()->forward(h);
            h = first;
            for (size_t i = 1; i < m.blocks->size(); ++i) h = m.blocks[i]->as<models::BlockImpl>()->forward(h);
            return std::make_pair(m.head(m.ln_f(h)), first.square().mean() * 0.1);
          };
          auto [o, aux] = sharded.forward_with([&] { return towers(*model, x); });
          models::lm_loss(o, y).backward({}, /*retain_graph=*/true);
          aux.backward();
          auto [lo_, laux] = towers(*local, gx);
          models::lm_loss(lo_, gy).backward({}, true);
          laux.backward();
        } else if (c == "two_forwards") {
          auto l1 = models::lm_loss(sharded.forward(x), y);
          auto l2 = models::lm_loss(sharded.forward(x2), y2);
          l1.backward();
          l2.backward();
          models::lm_loss(local->forward(gx), gy).backward();
          models::lm_loss(local->forward(gx2), gy2).backward();
        } else if (c == "backward_throws" && step == 1) {
          // A hook on a parameter that throws in backward (every rank alike), once backward has
          // reduced the later blocks: the exception reaches backward()'s caller; the loop zeroes
          // the gradients and carries on with the next batch.
          torch::Tensor hooked = model->blocks[0]->as<models::BlockImpl>()->mlp->fc->weight;
          const unsigned handle = hooked.register_hook([](const torch::Tensor&) -> torch::Tensor {
            throw std::runtime_error("user hook");
          });
          const std::string thrown = error_of([&] { models::lm_loss(sharded.forward(x), y).backward(); });
          hooked.remove_hook(handle);
          if (thrown.find("user hook") == std::string::npos) throw std::runtime_error("expected the hook's error, got: " + thrown);
          optim.zero_grad();
          models::lm_loss(sharded.forward(x2), y2).backward();
          models::lm_loss(local->forward(gx2), gy2).backward();
        } else if (c == "forward_throws" && step == 1) {
          const std::string thrown = error_of([&] {
            sharded.forward_with([&] {
              auto h = model->tok_emb(x);
              h = model->blocks[0]->as<models::BlockImpl>()->forward(h);
              throw std::runtime_error("user forward");
              return h;
            });
          });
          if (thrown.find("user forward") == std::string::npos) throw std::runtime_error("expected the forward's error, got: " + thrown);
          models::lm_loss(sharded.forward(x2), y2).backward();
          models::lm_loss(local->forward(gx2), gy2).backward();
        } else if (c == "no_sync_clip" && step == 0) {
          {
            auto guard = sharded.no_sync();
            models::lm_loss(sharded.forward(x), y).backward();
          }
          out["clip_during_no_sync"] = error_of([&] { sharded.clip_grad_norm_(1.0); });
          out["step_during_no_sync"] = error_of([&] { optim.step(); });
          // fsdp's fused optimizers reach the same guard (one call per group, the parameters in a list).
          out["fused_adamw_during_no_sync"] = error_of([&] {
            fsdp::FusedAdamW fused(sharded.parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.0));
            fused.step();
          });
          out["fused_sgd_during_no_sync"] = error_of([&] {
            fsdp::FusedSGD fused(sharded.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
            fused.step();
          });
          // Then the synchronized backward, as the loop should have done.
          models::lm_loss(sharded.forward(x2), y2).backward();
          models::lm_loss(local->forward(gx), gy).backward();
          models::lm_loss(local->forward(gx2), gy2).backward();
        } else {
          models::lm_loss(sharded.forward(x), y).backward();
          models::lm_loss(local->forward(gx), gy).backward();
        }
        optim.step();
        local_optim.step();
      });
      if (!err.empty()) {
        out["error"] = "step " + std::to_string(step) + ": " + err;
        break;
      }
    }
    out["max_param_diff"] = max_shard_diff(sharded, *model, *local, rank);
  } else if (c == "max_norm") {
    torch::manual_seed(0);
    MaxNormNet model;
    torch::manual_seed(0);
    MaxNormNet local;
    fsdp::FullyShardedDataParallel sharded(model, mesh, opts);
    auto optim = sgd(sharded.parameters());
    auto local_optim = sgd(local->parameters());
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = gpt_batch(step, lo, hi);
      auto [gx, gy] = gpt_batch(step, 0, kGlobalBatch);
      const std::string err = error_of([&] {
        optim.zero_grad();
        models::lm_loss(sharded.forward(x), y).backward();
        optim.step();
      });
      if (!err.empty()) {
        out["error"] = err;
        break;
      }
      local_optim.zero_grad();
      models::lm_loss(local->forward(gx), gy).backward();
      local_optim.step();
    }
    if (out["error"] == "") out["max_param_diff"] = max_shard_diff(sharded, *model, *local, rank);
  } else if (c == "grad_of_params") {
    opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
    auto model = tiny_gpt();
    fsdp::FullyShardedDataParallel sharded(model, mesh, opts);
    auto [x, y] = gpt_batch(0, lo, hi);
    std::vector<torch::Tensor> params = sharded.parameters();
    out["error"] = error_of([&] {
      auto loss = models::lm_loss(sharded.forward(x), y);
      auto grads = torch::autograd::grad({loss}, params);
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
    });
    // The wrapper stays usable after the refusal.
    out["after"] = error_of([&] {
      models::lm_loss(sharded.forward(x), y).backward();
    });
  } else if (c == "nested_roots") {
    // Distillation: a wrapped teacher runs inside the wrapped student's forward (without grad).
    opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
    auto student = tiny_gpt(), local_student = tiny_gpt();
    torch::manual_seed(1);
    models::GPT teacher(models::GPTConfig::preset("tiny"));
    torch::manual_seed(1);
    models::GPT local_teacher(models::GPTConfig::preset("tiny"));
    fsdp::FullyShardedDataParallel wrapped_teacher(teacher, mesh, opts);
    fsdp::FullyShardedDataParallel wrapped_student(student, mesh, opts);
    auto optim = sgd(wrapped_student.parameters());
    std::vector<torch::Tensor> local_params;  // the tied embedding and head once, as the wrapper lists it
    for (auto& kv : unique_params(*local_student)) local_params.push_back(kv.second);
    auto local_optim = sgd(local_params);
    auto distill = [](const torch::Tensor& s, const torch::Tensor& t, const torch::Tensor& y) {
      return models::lm_loss(s, y) + (torch::log_softmax(s, -1) - torch::log_softmax(t, -1)).square().mean();
    };
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = gpt_batch(step, lo, hi);
      auto [gx, gy] = gpt_batch(step, 0, kGlobalBatch);
      const std::string err = error_of([&] {
        optim.zero_grad();
        torch::Tensor outside;
        if (a.variants == "outside") {  // the teacher before the student's forward, not nested
          torch::NoGradGuard no_grad;
          outside = wrapped_teacher.forward(x);
        } else if (a.variants == "local_teacher") {
          torch::NoGradGuard no_grad;
          outside = local_teacher->forward(x);
        }
        auto loss = wrapped_student.forward_with([&] {
          torch::Tensor t = outside;
          if (!t.defined()) {
            torch::NoGradGuard no_grad;
            t = wrapped_teacher.forward(x);
          }
          return distill(student->forward(x), t, y);
        });
        loss.backward();
        optim.step();
      });
      if (!err.empty()) {
        out["error"] = err;
        break;
      }
      local_optim.zero_grad();
      torch::Tensor t;
      {
        torch::NoGradGuard no_grad;
        t = local_teacher->forward(gx);
      }
      distill(local_student->forward(gx), t, gy).backward();
      local_optim.step();
    }
    out["max_param_diff"] = max_shard_diff(wrapped_student, *student, *local_student, rank);
  } else if (c == "raw_pointer") {
    torch::manual_seed(0);
    RawNet model;
    torch::manual_seed(0);
    RawNet local;
    opts.auto_wrap_policy = fsdp::module_type_policy<RawLinearImpl>();  // the raw layer is a unit of its own
    fsdp::FullyShardedDataParallel sharded(model, mesh, opts);
    auto optim = sgd(sharded.parameters());
    auto local_optim = sgd(local->parameters());
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = uneven_batch(step, lo, hi);
      auto [gx, gy] = uneven_batch(step, 0, kGlobalBatch);
      const std::string err = error_of([&] {
        optim.zero_grad();
        // The kernel reads the weight's storage directly: gather the model for the whole step.
#ifndef FSDP_HOLES_WITHOUT_UNSHARD
        auto whole = sharded.unshard();
#endif
        torch::mse_loss(sharded.forward(x), y).backward();
      });
      if (!err.empty()) {
        out["error"] = err;
        break;
      }
      optim.step();
      local_optim.zero_grad();
      torch::mse_loss(local->forward(gx), gy).backward();
      local_optim.step();
    }
    out["max_param_diff"] = max_shard_diff(sharded, *model, *local, rank);
  } else if (c == "frozen_blocks") {
    torch::manual_seed(0);
    FrozenStack model;
    std::vector<const torch::nn::Module*> blocks;
    for (auto& b : model->blocks) blocks.push_back(b.get());
    opts.auto_wrap_policy = [blocks](const std::string&, const torch::nn::Module& m, int64_t) {
      return std::find(blocks.begin(), blocks.end(), &m) != blocks.end();
    };
    fsdp::FullyShardedDataParallel sharded(model, mesh, opts);
    // A block's gathered bytes, and the root unit's (the first layer and the head: gathered
    // through backward whatever happens to the blocks).
    int64_t unit_bytes = 0, root_bytes = 0;
    for (const auto& u : sharded.units()) (u.is_root ? root_bytes : unit_bytes) = u.padded_numel * u.element_size;
    auto x = torch::randn({4, FrozenStackImpl::kWidth});
    for (int step = 0; step < 2; ++step) {
      sharded.reset_step();
      auto loss = sharded.forward(x).square().mean();
      const fsdp::HostMemoryPeak peak;  // live tensor bytes through backward
      loss.backward();
      // Blocks gathered at once (the forward's peak is two: the unit running and the next).
      out["gathered_blocks_peak"] = static_cast<double>(sharded.metrics().memory.unsharded_peak - root_bytes) / unit_bytes;
      out["backward_live_peak_blocks"] = static_cast<double>(peak.peak_bytes()) / unit_bytes;
    }
  } else {
    throw std::invalid_argument("holes: unknown --case '" + c + "'");
  }
  return out;
}

}  // namespace worker
