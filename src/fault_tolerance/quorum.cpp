#include "fault_tolerance/quorum.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <sstream>
#include <stdexcept>

namespace fsdp::detail {

nlohmann::json Round::to_json() const {
  nlohmann::json gens = nlohmann::json::object();
  for (const auto& [r, g] : generation) gens[std::to_string(r)] = g;
  return {{"number", number}, {"step", step},       {"epoch", epoch},
          {"members", members}, {"generation", gens}, {"joining", joining},
          {"source", source},   {"left", left},       {"sitting_out", sitting_out},
          {"end", end},         {"synchronize", synchronize}};
}

Round Round::from_json(const nlohmann::json& j) {
  Round r;
  r.number = j.at("number").get<int64_t>();
  r.step = j.at("step").get<int64_t>();
  r.epoch = j.at("epoch").get<int64_t>();
  r.members = j.at("members").get<std::vector<int>>();
  for (const auto& [k, v] : j.at("generation").items()) r.generation[std::stoi(k)] = v.get<int>();
  r.joining = j.at("joining").get<std::vector<int>>();
  r.source = j.at("source").get<int>();
  r.left = j.at("left").get<std::vector<int>>();
  r.sitting_out = j.at("sitting_out").get<std::vector<int>>();
  r.end = j.at("end").get<bool>();
  r.synchronize = j.at("synchronize").get<bool>();
  return r;
}

bool Round::has(int replica) const {
  for (int m : members) {
    if (m == replica) return true;
  }
  return false;
}

std::vector<ScheduledChange> parse_schedule(const std::string& text, int replicas) {
  std::vector<ScheduledChange> out;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item.empty()) continue;
    const auto colon = item.find(':'), at = item.find('@');
    ScheduledChange c;
    bool ok = colon != std::string::npos && at != std::string::npos && at > colon;
    if (ok) {
      const std::string kind = item.substr(0, colon);
      ok = kind == "out" || kind == "in";
      c.out = kind == "out";
      try {
        size_t used = 0;
        const std::string r = item.substr(colon + 1, at - colon - 1), s = item.substr(at + 1);
        c.replica = std::stoi(r, &used);
        ok = ok && used == r.size();
        c.step = std::stoll(s, &used);
        ok = ok && used == s.size();
      } catch (const std::exception&) {
        ok = false;
      }
    }
    if (!ok || c.replica < 0 || c.replica >= replicas || c.step < 0) {
      throw std::invalid_argument("fsdp: the live schedule item '" + item + "' is not out:R@S or in:R@S with R a replica "
                                  "group (0.." + std::to_string(replicas - 1) + ") and S a step");
    }
    out.push_back(c);
  }
  check_schedule(out, replicas, 1);
  return out;
}

void check_schedule(const std::vector<ScheduledChange>& changes, int replicas, int min_replicas) {
  // Each group's changes alternate out, in, out ... at rising steps (in at the step of its out
  // would be let in to a round it never asked for: the coordinator would wait for it forever).
  std::map<int, const ScheduledChange*> last;
  for (const auto& c : changes) {
    auto it = last.find(c.replica);
    const bool out_now = it == last.end() || !it->second->out;
    if (c.out != out_now || (it != last.end() && c.step <= it->second->step)) {
      throw std::invalid_argument(
          "fsdp: the live schedule item '" + std::string(c.out ? "out" : "in") + ":" + std::to_string(c.replica) + "@" +
          std::to_string(c.step) + "' does not follow the group's earlier items: each group's items go out, in, out "
          "... at steps that rise (in at a later step than its out)");
    }
    last[c.replica] = &c;
  }
  // At every step, at least min_replicas groups are in.
  std::map<int64_t, int> change_at;
  for (const auto& c : changes) change_at[c.step] += c.out ? -1 : 1;
  int in = replicas;
  for (const auto& [step, delta] : change_at) {
    in += delta;
    if (in < std::max(1, min_replicas)) {
      throw std::invalid_argument("fsdp: the live schedule leaves " + std::to_string(in) + " replica group(s) in from step " +
                                  std::to_string(step) + ", fewer than " +
                                  (min_replicas > 1 ? "the job's minimum of " + std::to_string(min_replicas)
                                                    : std::string("one")) +
                                  ": nobody would train; let a group back in first");
    }
  }
}

std::string LiveConfig::encode() const {
  return kLiveProtocol + " " + std::to_string(world_size) + " " + std::to_string(ranks_per_replica) + " " +
         std::to_string(total_steps) + " " + std::to_string(min_replicas) + " " + std::to_string(max_retries) + " " +
         schedule;
}

LiveConfig LiveConfig::decode(const std::string& text) {
  LiveConfig c;
  std::istringstream in(text);
  std::string version;
  in >> version;
  if (version != kLiveProtocol) {
    throw std::runtime_error("fsdp: the live job's config '" + text.substr(0, 80) + "' is not of protocol " + kLiveProtocol);
  }
  in >> c.world_size >> c.ranks_per_replica >> c.total_steps >> c.min_replicas >> c.max_retries;
  std::getline(in >> std::ws, c.schedule);
  if (!in.eof() && in.fail()) throw std::runtime_error("fsdp: the live job's config '" + text + "' is damaged");
  return c;
}

std::optional<std::pair<int64_t, int64_t>> parse_pair(const std::string& text) {
  const auto colon = text.find(':');
  if (colon == std::string::npos) return std::nullopt;
  try {
    size_t used_a = 0, used_b = 0;
    const std::string a = text.substr(0, colon), b = text.substr(colon + 1);
    const int64_t x = std::stoll(a, &used_a), y = std::stoll(b, &used_b);
    if (used_a != a.size() || used_b != b.size() || a.empty() || b.empty()) return std::nullopt;
    return std::make_pair(x, y);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::optional<int64_t> parse_integer(const std::string& text) {
  try {
    size_t used = 0;
    const int64_t v = std::stoll(text, &used);
    if (used != text.size()) return std::nullopt;
    return v;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::chrono::milliseconds seconds_from_environment(const char* name, std::chrono::milliseconds fallback) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') return fallback;
  char* end = nullptr;
  const double s = std::strtod(raw, &end);
  if (end == raw || *end != '\0' || !(s > 0) || s > 1e6) {
    throw std::invalid_argument(std::string("fsdp: ") + name + "='" + raw + "' is not a positive number of seconds");
  }
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

int integer_from_environment(const char* name, int fallback, int low, int high) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') return fallback;
  const auto v = parse_integer(raw);
  if (!v || *v < low || *v > high) {
    throw std::invalid_argument(std::string("fsdp: ") + name + "='" + raw + "' is not a whole number from " +
                                std::to_string(low) + " to " + std::to_string(high));
  }
  return static_cast<int>(*v);
}

std::string to_string(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
std::vector<uint8_t> to_bytes(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }

std::string list_text(const std::vector<int>& groups) {
  std::string s;
  for (int g : groups) s += (s.empty() ? "" : ", ") + std::to_string(g);
  return s.empty() ? "none" : s;
}

}  // namespace fsdp::detail
