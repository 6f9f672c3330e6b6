// fsdp-bench-checkpoint-scale: what a SHARDED save and load of a large model cost at a world size
// this machine cannot run (issue 25: the 200m GPT at W = 1024). The model is built on the meta
// device (no memory), wrapped the way fsdp-train wraps it (one unit per block, the rest in the
// root), and each rank's part of the manifest is made from the FlatParameter layout exactly as the
// SHARDED writer makes it (its pieces as boxes, its files, its step tensors, its generator state).
// Then, for real: the manifest is assembled as rank 0 assembles it, written with its checksum, and
// read back as every rank reads it (parse, checksum, schema, pieces); and one rank writes its own
// files (zeros of the right sizes). Printed: the part and manifest sizes, the bytes the parts cross
// the network with (an all-gather padded to the longest part, as before, against the point-to-point
// gather to rank 0), the files a rank opens on load (before: every file; now: its own and its
// share of the checksums), and the times.
//
//   build/bin/fsdp-bench-checkpoint-scale --model 200m --world-size 1024 --out /tmp/ckpt-scale
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <set>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "fsdp/deferred_init.h"
#include "models/gpt.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/file_system.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/state_dict.h"
#include "engine/flat_param.h"

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

struct UnitLayout {
  std::string name;
  std::vector<std::string> fqns;
  std::vector<std::vector<int64_t>> shapes;
};

// Rank `rank`'s part as checkpoint_writer.cpp's write_rank_files makes it for a SHARDED save with
// an Adam-family optimizer (exp_avg, exp_avg_sq and the step tensors), plus what save() adds.
json part_of(const std::vector<UnitLayout>& units, const std::vector<fsdp::FlatParamLayout>& layouts, int rank, int world,
             const std::string& rng_hex, std::map<std::string, int64_t>* file_bytes) {
  json part = {{"pieces", json::object()}, {"files", json::object()}};
  std::map<std::string, int64_t> bytes;  // file -> data bytes
  std::set<std::string> with_state;
  for (size_t u = 0; u < units.size(); ++u) {
    const auto slices = layouts[u].slices(rank);
    for (size_t i = 0; i < slices.size(); ++i) {
      if (slices[i].length == 0) continue;
      const std::string& fqn = units[u].fqns[i];
      const auto boxes = fsdp::boxes_of_range(units[u].shapes[i], slices[i].param_begin, slices[i].param_begin + slices[i].length);
      for (const std::string& key : {fqn, "state." + fqn + ".exp_avg", "state." + fqn + ".exp_avg_sq"}) {
        const std::string sub = key == fqn ? "model" : "optim";
        for (size_t j = 0; j < boxes.size(); ++j) {
          const std::string file = fsdp::rank_file(sub, rank, world, static_cast<int>(j));
          part["pieces"][key].push_back({{"key", key}, {"flat", {boxes[j].flat_begin, boxes[j].flat_end}}, {"at", 0}, {"file", file}});
          bytes[file] += 4 * (boxes[j].flat_end - boxes[j].flat_begin);
        }
      }
      with_state.insert(fqn);
    }
  }
  for (const std::string& fqn : with_state) {
    const std::string key = "state." + fqn + ".step", file = fsdp::rank_file("optim", rank, world, 0);
    part["pieces"][key].push_back({{"key", key}, {"flat", {0, 1}}, {"at", 0}, {"file", file}});
    bytes[file] += 4;
  }
  for (const auto& [file, n] : bytes) {
    part["files"][file] = {{"bytes", n}, {"crc32c", 0}};
    if (file_bytes) (*file_bytes)[file] = n;
  }
  part["rng"] = {{"cpu", rng_hex}};
  json steps = json::object();
  for (const std::string& fqn : with_state) steps[fqn] = 10;
  part["steps"] = steps;
  return part;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fsdp-bench-checkpoint-scale: a SHARDED checkpoint's manifest, save and load at a large simulated world size"};
  std::string model = "200m", out = "/tmp/fsdp-checkpoint-scale";
  int world = 1024, rank = 1;
  app.add_option("--model", model, "GPT preset");
  app.add_option("--world-size", world, "the simulated world size (full_shard: F = W)");
  app.add_option("--rank", rank, "the rank whose own files are written and whose load is counted");
  app.add_option("--out", out, "a scratch folder (removed and recreated)");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);

  // The model's parameters by unit, from a meta build (nothing allocated).
  const auto cfg = models::GPTConfig::preset(model);
  auto gpt = fsdp::meta_init([&] { return models::GPT(cfg); });
  std::vector<UnitLayout> units(cfg.n_layer + 1);
  units.back().name = "<root>";
  std::set<const c10::TensorImpl*> seen;
  int64_t numel = 0;
  for (const auto& item : gpt->named_parameters(true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;  // the tied weight once
    const std::string& name = item.key();
    size_t u = units.size() - 1;
    if (name.rfind("blocks.", 0) == 0) u = std::stoul(name.substr(7, name.find('.', 7) - 7));
    units[u].fqns.push_back(name);
    units[u].shapes.push_back(item.value().sizes().vec());
    numel += item.value().numel();
  }
  std::vector<fsdp::FlatParamLayout> layouts;
  for (const auto& u : units) layouts.emplace_back(u.fqns, u.shapes, world);

  // Every rank's part (a real generator state's size: the CPU generator's 5056 bytes, in hex).
  at::Generator g = at::detail::getDefaultCPUGenerator();
  at::Tensor state = g.get_state();
  const std::string rng_hex(static_cast<size_t>(2 * state.numel()), 'a');
  auto t0 = Clock::now();
  std::vector<std::string> parts;
  size_t longest = 0, total = 0;
  for (int r = 0; r < world; ++r) {
    parts.push_back(part_of(units, layouts, r, world, rng_hex, nullptr).dump());
    longest = std::max(longest, parts.back().size());
    total += parts.back().size();
  }
  const double parts_ms = ms_since(t0);

  // Rank 0's assembly (checkpoint.cpp's commit), then the manifest with its checksum on disk.
  t0 = Clock::now();
  json manifest = {{"format", "fsdp-checkpoint"}, {"version", fsdp::kManifestVersion}, {"kind", "sharded"}, {"step", 10},
                   {"world_size", world}, {"shard_size", world}, {"strategy", "full_shard"}, {"mixed_precision", nullptr},
                   {"training", json::object()}, {"scaler", nullptr}};
  json params = json::object();
  json unit_list = json::array();
  for (size_t u = 0; u < units.size(); ++u) {
    for (size_t i = 0; i < units[u].fqns.size(); ++i) {
      params[units[u].fqns[i]] = {{"shape", units[u].shapes[i]}, {"dtype", "F32"}, {"unit", u}, {"aliases", json::array()}};
    }
    unit_list.push_back({{"name", units[u].name}, {"params", units[u].fqns}, {"numel", layouts[u].numel()},
                         {"padded_numel", layouts[u].padded_numel()}, {"shard_numel", layouts[u].shard_numel()}});
  }
  manifest["model"] = {{"params", params}, {"buffers", json::object()}, {"units", unit_list}};
  json groups = json::array({{{"params", json::array()}, {"options", {{"lr", 1e-3}}}}});
  for (const auto& [name, p] : params.items()) groups[0]["params"].push_back(name);
  manifest["optimizer"] = {{"type", "AdamW"}, {"groups", groups}, {"steps", json::object()}};
  manifest["pieces"] = json::object();
  manifest["files"] = json::object();
  manifest["rng"] = json::object();
  for (int r = 0; r < world; ++r) {
    const json p = json::parse(parts[r]);
    for (auto it = p["pieces"].begin(); it != p["pieces"].end(); ++it) {
      for (const auto& piece : *it) manifest["pieces"][it.key()].push_back(piece);
    }
    for (auto it = p["files"].begin(); it != p["files"].end(); ++it) manifest["files"][it.key()] = *it;
    manifest["rng"][std::to_string(r)] = p["rng"];
    for (auto it = p["steps"].begin(); it != p["steps"].end(); ++it) manifest["optimizer"]["steps"][it.key()] = *it;
  }
  const std::string text = fsdp::manifest_text(manifest);
  const double assemble_ms = ms_since(t0);
  fsdp::remove_tree(out);
  fsdp::make_directories(out + "/model");
  fsdp::make_directories(out + "/optim");
  t0 = Clock::now();
  {
    std::ofstream f(out + "/manifest.json");
    f << text;
  }
  fsdp::fsync_path(out + "/manifest.json");
  const double write_manifest_ms = ms_since(t0);

  // One rank's own files: what every rank writes in parallel in a real save.
  std::map<std::string, int64_t> mine;
  part_of(units, layouts, rank, world, rng_hex, &mine);
  t0 = Clock::now();
  int64_t written = 0;
  for (const auto& [file, n] : mine) {
    fsdp::SafetensorsWriter w(out + "/" + file, {{"data", c10::kFloat, {n / 4}}});
    w.write_next(at::zeros({n / 4}));
    w.finish();
    written += n;
  }
  const double write_rank_ms = ms_since(t0);

  // Every rank's load: the manifest parsed, checksummed and validated, then its pieces.
  t0 = Clock::now();
  const json read = fsdp::read_manifest(out);
  const double read_manifest_ms = ms_since(t0);
  t0 = Clock::now();
  const fsdp::SavedTensors saved = fsdp::saved_from_manifest(out, read);
  const double pieces_ms = ms_since(t0);
  size_t piece_count = 0;
  for (const auto& [name, list] : saved.pieces) piece_count += list.size();

  const double W = world;
  std::printf("fsdp-bench-checkpoint-scale: GPT '%s' (%.1f M parameters, %zu units), SHARDED with AdamW, W = %d\n",
              model.c_str(), numel / 1e6, units.size(), world);
  std::printf("  a rank's part of the manifest      %8.1f KB (longest), %.1f KB mean; made in %.0f ms for all ranks\n",
              longest / 1e3, total / 1e3 / W, parts_ms);
  std::printf("  the manifest                       %8.1f MB, %zu pieces, %zu files; assembled in %.0f ms, written in %.0f ms\n",
              text.size() / 1e6, piece_count, read["files"].size(), assemble_ms, write_manifest_ms);
  std::printf("    of which generator states        %8.1f MB (%d ranks x %zu hex digits)\n", W * rng_hex.size() / 1e6, world,
              rng_hex.size());
  std::printf("  the parts on the network, before   %8.1f MB per rank, %.2f GB in all (all-gather padded to the longest)\n",
              W * longest / 1e6, W * W * longest / 1e9);
  std::printf("  the parts on the network, now      %8.1f MB, all into rank 0 (point-to-point, each at its length)\n",
              total / 1e6);
  std::printf("  rank %d's own files                 %8.1f MB in %zu files, written and fsynced in %.0f ms\n", rank,
              written / 1e6, mine.size(), write_rank_ms);
  std::printf("  a load: the manifest read          %8.0f ms per rank (parse, checksum, schema); its pieces %.0f ms\n",
              read_manifest_ms, pieces_ms);
  std::printf("  files a rank opens on load, before %8zu (every file's size, then its checksum share)\n", read["files"].size());
  std::printf("  files a rank opens on load, now    %8zu (its own files, read; and %zu checksums: its share of %zu)\n",
              mine.size(), (read["files"].size() + world - 1) / world, read["files"].size());
  fsdp::remove_tree(out);
  return 0;
}
