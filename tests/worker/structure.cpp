// fsdp-test-worker structure [--strategy S --shard-size F] [--mismatch-rank R [--mismatch-what W]]
//   Builds and wraps the tiny GPT and exits: what construction checks across ranks, and how it
//   fails. Rank R builds a different model (W = model) or passes a different backward prefetch
//   (W = prefetch).
#include "worker.h"

namespace worker {

json run_structure(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  torch::manual_seed(0);
  auto cfg = models::GPTConfig::preset("tiny");
  fsdp::Options opts = options_from(a);
  if (mesh->rank() == a.mismatch_rank) {
    if (a.mismatch_what == "prefetch") opts.backward_prefetch = fsdp::BackwardPrefetch::BACKWARD_POST;
    else cfg.d_model += 2;  // a different model on one rank
  }
  models::GPT gpt(cfg);
  fsdp::FullyShardedDataParallel sharded(gpt, mesh, opts);
  return nullptr;
}

}  // namespace worker
