// fsdp-test-worker recompute [strategy flags] [--mixed-precision bf16] --out PREFIX
//   Activation checkpointing (fsdp/activation_checkpoint.h), with dropout on. Trains a model of 4
//   blocks with dropout twice from the same seeds, without and then with every block
//   checkpointed, under fsdp and locally, and writes:
//     losses / losses_checkpointed          per step, both runs (fsdp)
//     max_grad_diff, max_param_diff         max |difference| between the two fsdp runs over this
//                                           rank's gradient shards after every backward and its
//                                           parameter shards after every step (0: bitwise equal)
//     local_max_grad_diff, local_loss_diff  the same for the two local runs (no fsdp)
//     input_without_grad_diff               a block checkpointed on an input that needs no gradient
//     unsharded_peak / _checkpointed        per step, the peak of gathered bytes
//     spans / spans_checkpointed            the last step's timeline
#include "worker.h"

#include "fsdp/activation_checkpoint.h"

namespace worker {
namespace {

constexpr int64_t kBlockWidth = 32;

struct DropBlockImpl : torch::nn::Module {
  DropBlockImpl() {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kBlockWidth})));
    fc = register_module("fc", torch::nn::Linear(kBlockWidth, 4 * kBlockWidth));
    proj = register_module("proj", torch::nn::Linear(4 * kBlockWidth, kBlockWidth));
    drop = register_module("drop", torch::nn::Dropout(0.25));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + proj(drop(torch::gelu(fc(ln(x))))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc{nullptr}, proj{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(DropBlock);

struct DropNetImpl : torch::nn::Module {
  DropNetImpl() {
    in = register_module("in", torch::nn::Linear(16, kBlockWidth));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 4; ++i) blocks->push_back(DropBlock());
    out = register_module("out", torch::nn::Linear(kBlockWidth, 16));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = in(x);
    for (size_t i = 0; i < blocks->size(); ++i) {
      DropBlockImpl* b = blocks[i]->as<DropBlockImpl>();
      h = fsdp::checkpointable(*b, [b](const torch::Tensor& t) { return b->forward(t); }, h);
    }
    return out(h);
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(DropNet);

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<torch::Tensor>> grads, params;  // per step, this rank's tensors
  std::vector<int64_t> unsharded_peak;
  json spans;
};

std::vector<torch::Tensor> copies(const std::vector<torch::Tensor>& ts, bool grads) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) {
    const torch::Tensor v = grads ? t.grad() : t;
    out.push_back(v.defined() ? v.detach().clone() : torch::Tensor());
  }
  return out;
}

double max_diff(const std::vector<std::vector<torch::Tensor>>& a, const std::vector<std::vector<torch::Tensor>>& b) {
  double d = 0;
  for (size_t s = 0; s < a.size(); ++s) {
    for (size_t i = 0; i < a[s].size(); ++i) {
      if (a[s][i].defined() != b[s][i].defined()) return 1e30;
      if (a[s][i].defined() && a[s][i].numel() > 0) d = std::max(d, (a[s][i].to(torch::kDouble) - b[s][i].to(torch::kDouble)).abs().max().item<double>());
    }
  }
  return d;
}

// Four steps from seed 0; dropout draws from a seed fixed per step and rank, the same in both runs.
Run train(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a, bool sharded, bool checkpointed) {
  torch::manual_seed(0);
  DropNet net;
  if (checkpointed) fsdp::apply_activation_checkpointing(*net, fsdp::checkpoint_modules_of_type<DropBlockImpl>());
  fsdp::Options opts = options_from(a);
  opts.auto_wrap_policy = fsdp::module_type_policy<DropBlockImpl>();
  if (a.mixed_precision != "none") {
    const auto dtype = fsdp::parse_dtype(a.mixed_precision);
    opts.mixed_precision = fsdp::MixedPrecision{dtype, dtype, dtype, false};
  }
  std::unique_ptr<fsdp::FullyShardedDataParallel<DropNetImpl>> wrapped;
  if (sharded) wrapped = std::make_unique<fsdp::FullyShardedDataParallel<DropNetImpl>>(net, mesh, opts);
  std::vector<torch::Tensor> params;
  for (const auto& np : unique_params(*net)) params.push_back(np.second);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2));
  const int rank = sharded ? mesh->rank() : 0, W = sharded ? mesh->world_size() : 1;
  const int64_t per = kGlobalBatch / W;
  Run r;
  for (int step = 0; step < 4; ++step) {
    if (wrapped) wrapped->reset_step();
    opt.zero_grad();
    auto [x, y] = uneven_batch(step, rank * per, rank * per + per);
    torch::manual_seed(1000 + 10 * step + rank);
    const torch::Tensor pred = wrapped ? wrapped->forward(x) : net->forward(x);
    const torch::Tensor loss = torch::mse_loss(pred.to(torch::kFloat), y);
    loss.backward();
    r.losses.push_back(loss.item<double>());
    r.grads.push_back(copies(params, true));
    opt.step();
    r.params.push_back(copies(params, false));
    if (wrapped) r.unsharded_peak.push_back(wrapped->metrics().memory.unsharded_peak);
  }
  if (wrapped) r.spans = timeline_json(*wrapped);
  return r;
}

// A checkpointed block whose input needs no gradient (the pitfall of re-entrant checkpointing:
// no node would be recorded, and the block's parameters would get no gradient): max |difference|
// of its parameters' gradients against the same block without checkpointing.
double input_without_grad_diff() {
  std::vector<std::vector<torch::Tensor>> grads[2];
  for (int ckpt = 0; ckpt < 2; ++ckpt) {
    torch::manual_seed(3);
    DropBlock block;
    auto [x, y] = uneven_batch(0, 0, kGlobalBatch);
    const torch::Tensor in = torch::cat({x, x}, 1);  // [N, 32], requires no grad
    torch::manual_seed(4);
    DropBlockImpl* b = block.get();
    const torch::Tensor out = ckpt ? fsdp::checkpoint([b](const torch::Tensor& t) { return b->forward(t); }, in)
                                   : b->forward(in);
    out.pow(2).mean().backward();
    std::vector<torch::Tensor> params = block->parameters();
    grads[ckpt].push_back(copies(params, true));
    for (const auto& g : grads[ckpt].back()) {
      if (!g.defined()) return 1e30;  // no gradient at all: the pitfall
    }
  }
  return max_diff(grads[0], grads[1]);
}

}  // namespace

json run_recompute(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const Run plain = train(mesh, a, true, false), ckpt = train(mesh, a, true, true);
  const Run local = train(mesh, a, false, false), local_ckpt = train(mesh, a, false, true);
  double local_loss_diff = 0;
  for (size_t i = 0; i < local.losses.size(); ++i) {
    local_loss_diff = std::max(local_loss_diff, std::abs(local.losses[i] - local_ckpt.losses[i]));
  }
  return json{{"losses", plain.losses},
              {"losses_checkpointed", ckpt.losses},
              {"max_grad_diff", max_diff(plain.grads, ckpt.grads)},
              {"max_param_diff", max_diff(plain.params, ckpt.params)},
              {"local_max_grad_diff", max_diff(local.grads, local_ckpt.grads)},
              {"local_loss_diff", local_loss_diff},
              {"input_without_grad_diff", input_without_grad_diff()},
              {"unsharded_peak", plain.unsharded_peak},
              {"unsharded_peak_checkpointed", ckpt.unsharded_peak},
              {"spans", plain.spans},
              {"spans_checkpointed", ckpt.spans}};
}

}  // namespace worker
