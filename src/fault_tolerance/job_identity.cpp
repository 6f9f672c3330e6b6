#include "fault_tolerance/job_identity.h"

#include <cstdio>
#include <sstream>

#include <torch/nn/module.h>

#include "fsdp/fault_tolerance.h"

#include <nlohmann/json.hpp>

namespace fsdp::detail {

std::string encode_identity(const std::map<std::string, std::string>& items) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : items) j[k] = v;
  return j.dump();
}

std::optional<std::string> identity_difference(const std::string& mine, const std::string& theirs) {
  if (mine == theirs) return std::nullopt;
  const nlohmann::json a = nlohmann::json::parse(mine, nullptr, /*allow_exceptions=*/false);
  const nlohmann::json b = nlohmann::json::parse(theirs, nullptr, /*allow_exceptions=*/false);
  if (!b.is_object()) {
    return "the job's identity in the coordinator's store is not one this version of fsdp wrote ('" +
           theirs.substr(0, 80) + "')";
  }
  auto text = [](const nlohmann::json& o, const std::string& k) {
    return o.contains(k) && o[k].is_string() ? "'" + o[k].get<std::string>() + "'" : std::string("none");
  };
  for (const auto& [k, v] : a.items()) {
    if (!b.contains(k) || b[k] != v) return k + " is " + text(a, k) + " here and " + text(b, k) + " in the job";
  }
  for (const auto& [k, v] : b.items()) {
    if (!a.contains(k)) return k + " is none here and " + text(b, k) + " in the job";
  }
  return std::nullopt;  // the same items, written differently
}

std::string digest(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char out[17];
  std::snprintf(out, sizeof(out), "%016llx", static_cast<unsigned long long>(h));
  return out;
}

}  // namespace fsdp::detail

namespace fsdp {

std::string parameters_identity(const torch::nn::Module& model) {
  std::ostringstream shapes;
  int64_t elements = 0;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    shapes << p.key() << ":" << p.value().sizes() << ":" << p.value().scalar_type() << ";";
    elements += p.value().numel();
  }
  return std::to_string(elements) + " parameter elements, names, shapes and dtypes " + detail::digest(shapes.str());
}

}  // namespace fsdp
