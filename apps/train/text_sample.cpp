#include "text_sample.h"

#include <chrono>
#include <stdexcept>
#include <thread>

#include "models/sampling.h"

namespace train {

std::optional<TextSample> sample_text(const Config& c, const Workload& workload, torch::nn::Module& model,
                                      Trainee& trainee, fsdp::Mesh& mesh, const torch::Device& device,
                                      const std::shared_ptr<fsdp::TensorParallel>& tp) {
  const int64_t context = workload.text_context();
  if (c.sample_tokens == 0 || context == 0) return std::nullopt;
  if (c.prompt.empty()) throw std::invalid_argument("--prompt is empty: give the text the sample starts from");
  model.eval();  // generation runs without dropout
  // Under TP the job is every rank (the data-parallel mesh is this TP rank's part of it).
  fsdp::Mesh& job = tp ? *tp->world() : mesh;
  const bool root = job.rank() == 0;
  models::SamplingOptions options;
  options.tokens = c.sample_tokens;
  options.context = context;
  options.temperature = c.temperature;
  options.seed = c.seed;
  // The logits of the token after `ids` from the model's output [1, T, V].
  auto last = [](const torch::Tensor& logits) { return logits.select(1, -1).reshape({-1}).to(torch::kCPU, torch::kFloat); };
  auto plain_forward = [&](const torch::Tensor& ids) {
    return last(workload.forward(model, Batch{{ids.to(device)}, {}}, std::nullopt));
  };
  TextSample sample;
  sample.prompt = c.prompt;
  std::vector<int64_t> ids;
  const auto t0 = std::chrono::steady_clock::now();
  fsdp::FullyShardedDataParallelBase* wrapped = trainee.wrapped();
  if (wrapped == nullptr) {
    // Local training or the DDP-style baseline: rank 0 holds the whole model already.
    sample.via = "the model's forward (no fsdp)";
    if (root) ids = models::sample_tokens(plain_forward, models::encode_bytes(c.prompt), options);
  } else if (c.sample_via == "summon" && !tp) {
    sample.via = "summon_full_params (rank 0)";
    fsdp::SummonOptions whole;
    whole.writeback = false;  // reading only
    whole.rank0_only = true;  // the other ranks keep their shards
    auto full = wrapped->summon_full_params(whole);
    if (root) {
      // The other local ranks wait at the end of the scope: rank 0 may use every core meanwhile.
      const int threads = torch::get_num_threads();
      torch::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
      try {
        ids = models::sample_tokens(plain_forward, models::encode_bytes(c.prompt), options);
      } catch (...) {
        torch::set_num_threads(threads);
        throw;
      }
      torch::set_num_threads(threads);
    }
  } else {
    // Under TP every rank runs the forward (each TP rank its part of every layer): the split
    // logits, [V / TP] per rank, are gathered whole as a user's inference gathers them.
    sample.via = tp ? "the sharded forward, logits gathered over TP" : "the sharded forward";
    const int W = job.world_size();
    auto sharded_forward = [&](const torch::Tensor& ids) {
      // Under sequence parallelism the length must split over the TP ranks: padded at the end,
      // which a causal model's earlier positions never see (the context fits: the block size is a
      // multiple of the TP size).
      const int64_t n = ids.size(-1);
      const int64_t pad = tp && tp->sequence_parallel() ? (tp->size() - n % tp->size()) % tp->size() : 0;
      const torch::Tensor in = pad == 0 ? ids : torch::cat({ids, torch::zeros({ids.size(0), pad}, ids.options())}, -1);
      torch::Tensor logits = trainee.forward(
          [&] { return workload.forward(model, Batch{{in.to(device)}, {}}, trainee.input_dtype()); });
      logits = logits.select(1, n - 1).reshape({-1}).to(torch::kCPU, torch::kFloat);
      if (tp) {
        logits = fsdp::gather_from_tensor_parallel_region(logits, tp, -1);
        // A padded vocabulary's padding classes are none of the model's.
        if (workload.vocabulary() > 0 && logits.size(-1) > workload.vocabulary()) logits = logits.narrow(-1, 0, workload.vocabulary());
      }
      logits = logits.contiguous();
      if (W > 1) {
        // Every rank samples from rank 0's logits, so every rank feeds the same tokens back.
        std::vector<at::Tensor> tensors{logits};
        job.world()->broadcast(tensors)->wait();
      }
      return logits;
    };
    torch::NoGradGuard no_grad;
    ids = models::sample_tokens(sharded_forward, models::encode_bytes(c.prompt), options);
  }
  sample.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!root) return std::nullopt;
  sample.text = models::decode_bytes(ids);
  sample.tokens = options.tokens;
  return sample;
}

}  // namespace train
