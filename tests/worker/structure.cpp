// fsdp-test-worker structure [--strategy S --shard-size F] [--mismatch-rank R]
//   Builds and wraps the tiny GPT (rank R builds a different one) and exits: what construction
//   checks across ranks, and how it fails.
#include "worker.h"

namespace worker {

json run_structure(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  torch::manual_seed(0);
  auto cfg = models::GPTConfig::preset("tiny");
  if (mesh->rank() == a.mismatch_rank) cfg.d_model += 2;  // a different model on one rank
  models::GPT gpt(cfg);
  fsdp::FullyShardedDataParallel sharded(gpt, mesh, options_from(a));
  return nullptr;
}

}  // namespace worker
