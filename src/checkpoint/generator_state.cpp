// Saving and restoring the generators' states (generator_state.h).
#include "checkpoint/generator_state.h"

#include <mutex>
#include <stdexcept>

#include <ATen/Context.h>

#include "checkpoint/rank_agreement.h"
#include "tensor_parallel/rng_tracker.h"

namespace fsdp {
namespace {

std::string hex(const at::Tensor& bytes) {
  static const char* digits = "0123456789abcdef";
  const auto* p = bytes.data_ptr<uint8_t>();
  std::string out;
  out.reserve(2 * bytes.numel());
  for (int64_t i = 0; i < bytes.numel(); ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

at::Tensor unhex(const std::string& text) {
  at::Tensor out = at::empty({static_cast<int64_t>(text.size() / 2)}, at::kByte);
  auto* p = out.data_ptr<uint8_t>();
  auto v = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (size_t i = 0; i + 1 < text.size(); i += 2) p[i / 2] = static_cast<uint8_t>(v(text[i]) << 4 | v(text[i + 1]));
  return out;
}

}  // namespace

// The random number generators a rank's training draws from: the CPU one and, with CUDA, the
// current device's.
nlohmann::json rng_state() {
  nlohmann::json out;
  {
    at::Generator g = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(g.mutex());
    out["cpu"] = hex(g.get_state());
  }
  if (at::hasCUDA()) {
    at::Generator g = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA));
    std::lock_guard<std::mutex> lock(g.mutex());
    out["cuda"] = hex(g.get_state());
  }
  // This TP rank's streams for dropout on split activations (fsdp::seed_tensor_parallel_rng).
  for (auto& [name, g] : detail::tensor_parallel_generators()) {
    std::lock_guard<std::mutex> lock(g.mutex());
    out[name] = hex(g.get_state());
  }
  return out;
}

StagedRng StagedRng::check(const nlohmann::json& j, const std::string& origin) {
  StagedRng out;
  auto stage = [&](const char* name, at::Generator g) {
    if (!j.contains(name)) return;
    at::Tensor state = unhex(j[name].get<std::string>());
    try {
      at::Generator probe = g.clone();
      probe.set_state(state);
    } catch (const std::exception& e) {
      throw std::runtime_error("fsdp: cannot load " + origin + ": its " + name + " random number generator state does "
                               "not fit this build of libtorch (" + first_line(e.what()) + ")");
    }
    out.states.emplace_back(std::move(g), std::move(state));
  };
  stage("cpu", at::detail::getDefaultCPUGenerator());
  if (at::hasCUDA()) stage("cuda", at::globalContext().defaultGenerator(c10::Device(c10::kCUDA)));
  for (auto& [name, g] : detail::tensor_parallel_generators()) stage(name.c_str(), g);
  return out;
}

void StagedRng::apply() {
  for (auto& [g, state] : states) {
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  }
}

}  // namespace fsdp
