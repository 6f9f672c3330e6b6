#include "models/sampling.h"

#include <stdexcept>

namespace models {

std::vector<int64_t> sample_tokens(const std::function<torch::Tensor(const torch::Tensor&)>& next_logits,
                                   std::vector<int64_t> prompt, const SamplingOptions& options) {
  if (prompt.empty()) throw std::invalid_argument("sample_tokens: the prompt is empty; give at least one token");
  if (options.context < 1) throw std::invalid_argument("sample_tokens: the context must hold at least one token");
  if (options.temperature < 0) throw std::invalid_argument("sample_tokens: the temperature must not be negative");
  torch::NoGradGuard no_grad;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);
  std::vector<int64_t> ids = std::move(prompt);
  for (int64_t i = 0; i < options.tokens; ++i) {
    const int64_t begin = std::max<int64_t>(0, static_cast<int64_t>(ids.size()) - options.context);
    std::vector<int64_t> window(ids.begin() + begin, ids.end());
    const torch::Tensor input = torch::tensor(window, torch::kLong).unsqueeze(0);
    const torch::Tensor logits = next_logits(input).to(torch::kCPU, torch::kFloat).reshape({-1});
    int64_t next = 0;
    if (options.temperature == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      const torch::Tensor probs = torch::softmax(logits / options.temperature, 0);
      next = at::multinomial(probs, 1, /*replacement=*/false, generator).item<int64_t>();
    }
    ids.push_back(next);
  }
  return ids;
}

std::vector<int64_t> encode_bytes(const std::string& text) {
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  for (unsigned char ch : text) ids.push_back(ch);
  return ids;
}

std::string decode_bytes(const std::vector<int64_t>& ids) {
  std::string text;
  text.reserve(ids.size());
  for (int64_t id : ids) {
    const bool printable = (id >= 0x20 && id < 0x7f) || id == '\n' || id == '\t';
    text.push_back(printable ? static_cast<char>(id) : '?');
  }
  return text;
}

}  // namespace models
