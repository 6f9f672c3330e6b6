// Megatron-LM's RNG tracker (fsdp/tensor_parallel.h, seed_tensor_parallel_rng): dropout on
// activations every TP rank holds alike must draw the same mask on each (the default generator,
// seeded alike across the TP group); dropout on activations split across the TP group (a
// feed-forward's features, a sequence-parallel chunk) must draw an independent mask on each (one
// stream per TP rank). A scope swaps the TP rank's stream into the default generator, so any
// operator inside (torch::dropout, a module's) draws from it unchanged.
#include "tensor_parallel/rng_tracker.h"

#include <ATen/Context.h>
#include <ATen/CPUGeneratorImpl.h>

#include <mutex>
#include <optional>
#include <stdexcept>

#include "fsdp/tensor_parallel.h"

namespace fsdp {
namespace {

struct Streams {
  std::mutex mutex;
  std::optional<at::Generator> cpu, cuda;  // this TP rank's streams, once seeded
  const TensorParallel* seeded_for = nullptr;  // whose TP rank they were seeded for
};
Streams& streams() {
  static Streams s;
  return s;
}

thread_local int t_depth = 0;

std::vector<std::pair<at::Generator, at::Generator>> pairs() {
  // (default generator, this rank's stream) for each device that has a stream.
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<std::pair<at::Generator, at::Generator>> out;
  if (s.cpu) out.emplace_back(at::detail::getDefaultCPUGenerator(), *s.cpu);
  if (s.cuda) out.emplace_back(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA)), *s.cuda);
  return out;
}

}  // namespace

namespace detail {
std::vector<std::pair<std::string, at::Generator>> tensor_parallel_generators() {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<std::pair<std::string, at::Generator>> out;
  if (s.cpu) out.emplace_back("tp_cpu", *s.cpu);
  if (s.cuda) out.emplace_back("tp_cuda", *s.cuda);
  return out;
}
}  // namespace detail

void seed_tensor_parallel_rng(const std::shared_ptr<TensorParallel>& tp, uint64_t seed) {
  if (!tp) throw std::invalid_argument("fsdp::seed_tensor_parallel_rng: the TensorParallel is null");
  // Apart from every default seed a job derives from small integers (a golden-ratio multiple, then
  // the TP rank), so no rank's stream replays another rank's default generator.
  const uint64_t own = seed * 0x9E3779B97F4A7C15ull + 2718ull + static_cast<uint64_t>(tp->rank());
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.seeded_for = tp.get();
  {
    at::Generator g = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> glock(g.mutex());
    g.set_current_seed(seed);
    s.cpu = g.clone();
    s.cpu->set_current_seed(own);
  }
  if (at::hasCUDA()) {
    at::Generator g = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA));
    std::lock_guard<std::mutex> glock(g.mutex());
    g.set_current_seed(seed);
    s.cuda = g.clone();
    s.cuda->set_current_seed(own);
  }
}

TensorParallelRngScope::TensorParallelRngScope(const std::shared_ptr<TensorParallel>& tp) {
  if (!tp || tp->size() == 1 || t_depth++ > 0) {
    if (tp && tp->size() > 1) nested_ = true;
    return;
  }
  auto p = pairs();
  const TensorParallel* seeded_for = nullptr;
  {
    std::lock_guard<std::mutex> lock(streams().mutex);
    seeded_for = streams().seeded_for;
  }
  if (!p.empty() && seeded_for != tp.get()) {
    --t_depth;
    throw std::logic_error("fsdp::TensorParallelRngScope: the TP streams were seeded for another TensorParallel (its "
                           "TP ranks may not be this one's): call fsdp::seed_tensor_parallel_rng(tp, seed) for the "
                           "TensorParallel whose layers draw the masks");
  }
  if (p.empty()) {
    --t_depth;
    throw std::logic_error("fsdp::TensorParallelRngScope: dropout on split activations needs this TP rank's own "
                           "random stream: call fsdp::seed_tensor_parallel_rng(tp, seed) once before training "
                           "(the same seed on the TP ranks of a data-parallel group)");
  }
  for (auto& [def, mine] : p) {
    std::lock_guard<std::mutex> lock(def.mutex());
    saved_.push_back(def.get_state());
    def.set_state(mine.get_state());
  }
  active_ = true;
}

TensorParallelRngScope::~TensorParallelRngScope() {
  if (nested_) --t_depth;
  if (!active_) return;
  --t_depth;
  auto p = pairs();
  for (size_t i = 0; i < p.size() && i < saved_.size(); ++i) {
    auto& [def, mine] = p[i];
    std::lock_guard<std::mutex> lock(def.mutex());
    mine.set_state(def.get_state());
    def.set_state(saved_[i]);
  }
}

}  // namespace fsdp
