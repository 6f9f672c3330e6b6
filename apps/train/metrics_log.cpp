#include "metrics_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace train {
namespace {
std::string mb(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MB", bytes / 1e6);
  return buf;
}
double ms_of(int64_t ns) { return static_cast<double>(ns) / 1e6; }
}  // namespace

void make_metrics_folder(const std::string& path) {
  if (path.empty()) return;
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  std::error_code error;
  if (!folder.empty()) std::filesystem::create_directories(folder, error);
  if (error) {
    throw std::invalid_argument("--metrics-jsonl " + path + ": cannot create its folder " + folder.string() + " (" +
                                error.message() + "); name a file in a folder you can write");
  }
}

JsonlWriter::JsonlWriter(const std::string& path) {
  if (path.empty()) return;
  make_metrics_folder(path);
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd_ < 0) {
    throw std::runtime_error("cannot open --metrics-jsonl file '" + path + "' for appending: " + std::strerror(errno));
  }
}

JsonlWriter::~JsonlWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void JsonlWriter::write(const nlohmann::json& j) {
  if (fd_ < 0) return;
  const std::string line = j.dump() + "\n";
  if (::write(fd_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
    throw std::runtime_error("writing the metrics file failed");
  }
}

nlohmann::json to_json(const StepRecord& r) {
  const fsdp::Metrics& m = r.metrics;
  nlohmann::json j = {{"rank", r.rank}, {"step", r.step}, {"time", r.time}, {"loss", r.loss}, {"grad_norm", r.grad_norm}, {"lr", r.lr}, {"step_ms", r.step_ms}, {"tokens_per_s", r.tokens_per_s},
          {"param_bytes_resident", m.memory.sharded_params},
          {"grad_bytes_resident", m.memory.sharded_grads},
          {"peak_unsharded_bytes", m.memory.unsharded_peak},
          {"comm_bytes", {{"all_gather", m.comm.all_gather}, {"reduce_scatter", m.comm.reduce_scatter},
                          {"all_reduce", m.comm.all_reduce}, {"sequence_check", m.comm.sequence_check}}},
          {"comm_calls", {{"all_gather", m.comm.all_gather_calls}, {"reduce_scatter", m.comm.reduce_scatter_calls},
                          {"all_reduce", m.comm.all_reduce_calls}}},
          {"exposed_comm_ms", ms_of(m.overlap.exposed_ns())},
          {"exposed_all_gather_ms", ms_of(m.overlap.exposed_all_gather_ns)},
          {"exposed_reduce_ms", ms_of(m.overlap.exposed_reduce_ns)},
          {"rate_limiter_wait_ms", ms_of(m.overlap.rate_limiter_wait_ns)},
          {"max_all_gathers_in_flight", m.overlap.max_all_gathers_in_flight},
          {"operator_calls_into_fsdp", {{"in_passes", m.detection.operator_calls_in_passes},
                                        {"at_rest", m.detection.operator_calls_at_rest}}},
          {"sequence_check_ms", ms_of(m.overlap.sequence_check_ns)},
          {"device_memory", {{"allocated_peak", m.device.allocated_peak}, {"active_peak", m.device.active_peak},
                             {"reserved_peak", m.device.reserved_peak},
                             {"num_alloc_retries", m.device.num_alloc_retries}}},
          {"reducing_grads_peak", m.memory.reducing_grads_peak},
          {"reducing_grads_at_backward_end", m.memory.reducing_grads_at_backward_end},
          {"reductions_in_flight_at_backward_end", m.memory.reductions_in_flight_at_backward_end}};
  // Where the step's time went: each phase's wall time and the exposed communication inside it;
  // "rest" is what no phase covers (the batch, zero_grad, the loss's all-reduce for this line).
  nlohmann::json phases;
  for (int i = 0; i < fsdp::kNumStepPhases; ++i) {
    const fsdp::PhaseTime& t = m.phases.phase[i];
    phases[fsdp::to_string(static_cast<fsdp::StepPhase>(i))] = {
        {"ms", ms_of(t.wall_ns)}, {"exposed_all_gather_ms", ms_of(t.exposed_all_gather_ns)},
        {"exposed_reduce_ms", ms_of(t.exposed_reduce_ns)}, {"rate_limiter_wait_ms", ms_of(t.rate_limiter_wait_ns)},
        {"count", t.count}};  // --grad-accum K: K forwards and backwards, their times summed
  }
  phases["rest_ms"] = r.step_ms - ms_of(m.phases.wall_ns());
  j["phases"] = std::move(phases);
  if (m.quantization.quantized_gathers > 0) {
    j["quantization"] = {{"gathers", m.quantization.quantized_gathers},
                         {"max_abs_error", m.quantization.max_abs_error},
                         {"max_abs_weight", m.quantization.max_abs_weight}};
  }
  if (!r.memory.is_null()) j["memory"] = r.memory;
  if (!r.links.is_null()) j["links"] = r.links;
  j["local_rank"] = r.local_rank;
  j["node_rank"] = r.node_rank;
  return j;
}

std::string progress_line(const StepRecord& r, bool sharded, bool cuda, const char* unit) {
  const fsdp::Metrics& m = r.metrics;
  char head[256];
  std::snprintf(head, sizeof(head), "step %4d | loss %.4f | lr %.3g | %8.0f %s/s | %7.1f ms", r.step, r.loss, r.lr,
                r.tokens_per_s, unit, r.step_ms);
  std::string line = std::string(head) + " | params " + mb(m.memory.sharded_params) + " resident, peak unsharded " +
                     mb(m.memory.unsharded_peak) + " | comm AG " + mb(m.comm.all_gather) + " RS " +
                     mb(m.comm.reduce_scatter) + " AR " + mb(m.comm.all_reduce);
  if (sharded) {
    char exposed[64];
    std::snprintf(exposed, sizeof(exposed), " | exposed comm %.1f ms", ms_of(m.overlap.exposed_ns()));
    line += exposed;
  }
  if (cuda) {
    line += " | peak allocated " + mb(m.device.allocated_peak) + ", alloc retries " +
            std::to_string(m.device.num_alloc_retries);
  }
  return line;
}

}  // namespace train
