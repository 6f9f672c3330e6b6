// fsdp-test-worker precision --param-dtype bf16|fp16 [--reduce-dtype D] [--keep-low-grads 1]
//                            [--variants accum] --out PREFIX
//   Three SGD steps of the tiny GPT in mixed precision against a local reference that replays the
//   same casts (per-rank forward/backward in param_dtype, gradients cast to reduce_dtype, divided
//   by W, summed, cast to fp32); also the dtypes handed to each collective, the buffers' dtypes,
//   and the bytes moved against an fp32 run.
#include "worker.h"

namespace worker {

json run_precision(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  fsdp::Options opts = options_from(a);
  const int W = mesh->world_size(), rank = mesh->rank();
  const int64_t per = kGlobalBatch / W;
  const auto pd = fsdp::parse_dtype(a.param_dtype);
  const auto rd = fsdp::parse_dtype(a.reduce_dtype.empty() ? a.param_dtype : a.reduce_dtype);
  const auto cfg = models::GPTConfig::preset("tiny");
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  const double lr = 0.05;

  // Bytes of one fp32 step, for comparison.
  fsdp::CommBytes fp32_bytes;
  {
    torch::manual_seed(0);
    models::GPT m(cfg);
    fsdp::FullyShardedDataParallel s(m, mesh, opts);
    s.reset_step();
    gpt_loss([&](const torch::Tensor& x) { return s.forward(x); }, 0, rank * per, rank * per + per).backward();
    fp32_bytes = s.metrics().comm;
  }

  opts.mixed_precision = fsdp::MixedPrecision{pd, rd, pd, a.keep_low_grads != 0};
  torch::manual_seed(0);
  models::GPT mine(cfg);
  torch::manual_seed(0);
  models::GPT ref(cfg);   // the fp32 master copy of the reference
  torch::manual_seed(0);
  models::GPT work(cfg);  // the reference's low-precision working copy
  fsdp::FullyShardedDataParallel sharded(mine, mesh, opts);
  // Unique parameters: libtorch's parameters() lists the tied weight twice, and SGD would step it twice.
  std::vector<torch::Tensor> my_unique;
  for (auto& kv : unique_params(*mine)) my_unique.push_back(kv.second);
  torch::optim::SGD opt(my_unique, torch::optim::SGDOptions(lr));
  auto ref_params = unique_params(*ref);
  auto work_params = unique_params(*work);

  std::set<std::string> ag_dtypes, rs_dtypes, grad_dtypes, param_dtypes;
  std::string logits_dtype;
  fsdp::CommBytes mp_bytes;
  for (int step = 0; step < 3; ++step) {
    sharded.reset_step();
    opt.zero_grad();
    auto fwd = [&](const torch::Tensor& x) {
      auto logits = sharded.forward(x);
      logits_dtype = fsdp::dtype_name(logits.scalar_type());
      return logits;
    };
    // "accum": the rank's slice as two weighted micro-batches, the first under no_sync.
    const bool accum = a.variants == "accum";
    auto halves = [&](int r) {
      const int64_t b = r * per, mid = b + per / 2, e = b + per;
      return std::make_tuple(b, mid, e, double(mid - b) / per, double(e - mid) / per);
    };
    if (accum) {
      const auto [b, mid, e, w1, w2] = halves(rank);
      {
        auto guard = sharded.no_sync();
        (gpt_loss(fwd, step, b, mid) * w1).backward();
      }
      (gpt_loss(fwd, step, mid, e) * w2).backward();
    } else {
      gpt_loss(fwd, step, rank * per, rank * per + per).backward();
    }
    for (const auto& p : my_unique) {
      if (p.grad().defined()) grad_dtypes.insert(fsdp::dtype_name(p.grad().scalar_type()));
      param_dtypes.insert(fsdp::dtype_name(p.scalar_type()));
    }
    opt.step();
    if (step == 0) mp_bytes = sharded.metrics().comm;
    for (const auto& sp : sharded.timeline()) {
      if (sp.kind == fsdp::SpanKind::ALL_GATHER) ag_dtypes.insert(sp.dtype);
      if (sp.kind == fsdp::SpanKind::REDUCE_SCATTER) rs_dtypes.insert(sp.dtype);
    }

    // The reference: every rank's slice in the working dtype, gradients reduced as fsdp does.
    torch::NoGradGuard outer;
    std::vector<torch::Tensor> sum(ref_params.size());
    for (int r = 0; r < W; ++r) {
      for (size_t i = 0; i < ref_params.size(); ++i) {
        work_params[i].second.set_data(ref_params[i].second.detach().to(pd));
        work_params[i].second.mutable_grad().reset();
      }
      auto work_fwd = [&](const torch::Tensor& x) { return work->forward(x); };
      std::vector<torch::Tensor> accum_grads(ref_params.size());
      if (accum) {
        // The first micro-batch's gradients, kept in fp32 as fsdp's no_sync accumulator does.
        const auto [b, mid, e, w1, w2] = halves(r);
        {
          torch::AutoGradMode grad_on(true);
          (gpt_loss(work_fwd, step, b, mid) * w1).backward();
        }
        for (size_t i = 0; i < ref_params.size(); ++i) {
          auto g = work_params[i].second.grad();
          if (g.defined()) accum_grads[i] = g.to(rd).to(torch::kFloat);
          work_params[i].second.mutable_grad().reset();
        }
        torch::AutoGradMode grad_on(true);
        (gpt_loss(work_fwd, step, mid, e) * w2).backward();
      } else {
        torch::AutoGradMode grad_on(true);
        gpt_loss(work_fwd, step, r * per, r * per + per).backward();
      }
      for (size_t i = 0; i < ref_params.size(); ++i) {
        auto g = work_params[i].second.grad();
        if (!g.defined() && !accum_grads[i].defined()) continue;
        auto flat = g.defined() ? g.to(rd) : torch::zeros_like(accum_grads[i], torch::TensorOptions().dtype(rd));
        if (accum_grads[i].defined()) flat.add_(accum_grads[i]);
        auto part = flat / W;
        sum[i] = sum[i].defined() ? sum[i] + part : part;
      }
    }
    for (size_t i = 0; i < ref_params.size(); ++i) {
      if (!sum[i].defined()) continue;
      // fsdp casts the reduced gradient to fp32, and with keep_low_precision_grads on to param_dtype.
      auto g = sum[i].to(torch::kFloat);
      if (a.keep_low_grads) g = g.to(pd).to(torch::kFloat);
      ref_params[i].second.add_(g, -lr);
    }
  }
  // Buffers are cast once to buffer_dtype; integer buffers stay as they are.
  torch::manual_seed(0);
  InitZoo zoo;
  fsdp::Options zoo_opts = opts;
  zoo_opts.auto_wrap_policy = nullptr;
  fsdp::FullyShardedDataParallel zoo_sharded(zoo, mesh, zoo_opts);
  return json{{"max_param_diff", max_shard_diff(sharded, *mine, *ref, rank)},
              {"logits_dtype", logits_dtype}, {"grad_dtypes", grad_dtypes}, {"param_dtypes", param_dtypes},
              {"running_mean_dtype", fsdp::dtype_name(zoo->norm->running_mean.scalar_type())},
              {"num_batches_tracked_dtype", fsdp::dtype_name(zoo->norm->num_batches_tracked.scalar_type())},
              {"all_gather_dtypes", ag_dtypes}, {"reduce_scatter_dtypes", rs_dtypes},
              {"fp32_all_gather_bytes", fp32_bytes.all_gather}, {"fp32_reduce_scatter_bytes", fp32_bytes.reduce_scatter},
              {"all_gather_bytes", mp_bytes.all_gather}, {"reduce_scatter_bytes", mp_bytes.reduce_scatter},
              {"fp32_all_reduce_bytes", fp32_bytes.all_reduce}, {"all_reduce_bytes", mp_bytes.all_reduce}};
}

}  // namespace worker
