// fsdp-test-worker checkpoint_hostile --variants V --path DIR [--seeds A:B] --out PREFIX
//   Checkpoints under hostile and broken input (issue 25), through the library's own calls. The
//   tiny GPT (full_shard, AdamW) trains 2 steps; then by V:
//   save    saves SHARDED step 2 and 3 under DIR/sharded, FULL step 2 under DIR/full and LOCAL step 2
//           under DIR/local (the fuzzer's and the other variants' material)
//   load    loads DIR into a model trained 3 steps: writes the error (or ""), and a hash of every
//           rank's model, optimizer state and generator before and after
//   agree   rank 0 and rank 1 name different checkpoints of DIR/sharded (a commit landing between
//           their listings): find_checkpoint gives every rank rank 0's, and load_checkpoint of the
//           two different ones fails on every rank with nothing changed
//   resave  saves step 3 into DIR twice from one checkpointer (training {"copy": 1}, then 2);
//           FSDP_TEST_KILL_IN_COMMIT kills rank 0 inside the second commit
//   fuzz    the checkpoint fuzzer: mutations A..B-1 of DIR's checkpoints (rank 0 mutates a copy),
//           each loaded by every rank; writes each outcome's class and counts
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>

#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "fsdp/checkpoint.h"
#include "worker.h"

namespace worker {
namespace {

struct Trained {
  std::unique_ptr<models::GPT> gpt;
  std::unique_ptr<fsdp::FullyShardedDataParallel<models::GPTImpl>> model;
  std::unique_ptr<torch::optim::AdamW> optim;
};

Trained build(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a, int steps) {
  torch::manual_seed(0);
  Trained t;
  t.gpt = std::make_unique<models::GPT>(models::GPTConfig::preset("tiny"));
  fsdp::Options opts = options_from(a);
  opts.auto_wrap_policy = fsdp::module_type_policy<models::BlockImpl>();
  t.model = std::make_unique<fsdp::FullyShardedDataParallel<models::GPTImpl>>(*t.gpt, mesh, opts);
  t.optim = std::make_unique<torch::optim::AdamW>(t.model->parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.1));
  const int64_t per = kGlobalBatch / mesh->world_size(), rank = mesh->rank();
  for (int s = 0; s < steps; ++s) {
    t.optim->zero_grad();
    gpt_loss([&](const torch::Tensor& x) { return t.model->forward(x); }, s, rank * per, rank * per + per).backward();
    t.optim->step();
  }
  return t;
}

// FNV-1a over this rank's shards, its optimizer state (tensors, steps, learning rates) and its CPU
// generator: what a load may change.
uint64_t state_hash(Trained& t) {
  uint64_t h = 1469598103934665603ull;
  auto bytes = [&](const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;
  };
  auto tensor = [&](const torch::Tensor& x) {
    if (!x.defined()) return;
    const torch::Tensor c = x.detach().to(torch::kCPU).contiguous();
    bytes(c.data_ptr(), c.nbytes());
  };
  for (const auto& [name, piece] : fsdp::sharded_state_dict(*t.model)) tensor(piece.local);
  for (auto& group : t.optim->param_groups()) {
    const double lr = group.options().get_lr();
    bytes(&lr, sizeof lr);
    for (const auto& p : group.params()) {
      auto it = t.optim->state().find(p.unsafeGetTensorImpl());
      if (it == t.optim->state().end()) continue;
      auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
      const int64_t step = s.step();
      bytes(&step, sizeof step);
      tensor(s.exp_avg());
      tensor(s.exp_avg_sq());
    }
  }
  at::Generator g = at::detail::getDefaultCPUGenerator();
  tensor(g.get_state());
  return h;
}

std::string hex64(uint64_t v) {
  std::ostringstream s;
  s << std::hex << v;
  return s.str();
}

// Every rank reaches this point before any goes on (an all-reduce).
void barrier(const std::shared_ptr<fsdp::Mesh>& mesh) { global_mean(mesh, torch::ones({1})); }

void shell(const std::string& cmd) {
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("command failed: " + cmd);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// A load of `path` into `t`: its error ("" when it loaded), the hashes before and after, seconds,
// and the training state it holds.
json load_and_hash(Trained& t, const std::string& path) {
  const uint64_t before = state_hash(t);
  std::string error;
  json training;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    training = json::parse(fsdp::load_checkpoint(path, *t.model, t.optim.get()).user_json);
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "(an exception without a message)";
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {{"error", error},     {"before", hex64(before)}, {"after", hex64(state_hash(t))},
          {"seconds", seconds}, {"training", training}};
}

// ------------------------------------------------------------------------------------------------
// The fuzzer's mutations. Each is a pure function of its index: every rank could compute it; rank 0
// applies it to a fresh copy of one of the saved checkpoints.

struct Mutation {
  std::string source;  // which saved checkpoint: sharded, full or local
  std::string what;    // a readable description
  bool adversarial = false;  // a manifest edited with its checksum recomputed: not a corruption
};

// Every JSON pointer in `j` (objects' members and arrays' elements), depth first.
void pointers(const json& j, const json::json_pointer& at, std::vector<json::json_pointer>& out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      out.push_back(at / it.key());
      pointers(*it, at / it.key(), out);
    }
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) {
      out.push_back(at / i);
      pointers(j[i], at / i, out);
    }
  }
}

std::vector<std::string> files_of(const std::string& dir) {
  std::vector<std::string> out;
  std::istringstream list([&] {
    const std::string tmp = dir + ".list";
    shell("cd " + dir + " && find . -type f | sort > " + tmp);
    const std::string text = read_text(tmp);
    std::remove(tmp.c_str());
    return text;
  }());
  std::string f;
  while (std::getline(list, f)) {
    if (f.rfind("./", 0) == 0) f = f.substr(2);
    if (f != "manifest.json") out.push_back(f);
  }
  return out;
}

Mutation mutate(const std::string& base, const std::string& copy, int64_t index) {
  std::mt19937_64 rng(static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull + 1);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  static const char* sources[] = {"sharded/step-00000002", "full/step-00000002", "local/step-00000002"};
  Mutation m;
  m.source = sources[index % 3];
  shell("rm -rf " + copy + " && cp -r " + base + "/" + m.source + " " + copy);
  const std::string manifest_path = copy + "/manifest.json";
  const int family = static_cast<int>(pick(10));
  if (family <= 4) {  // the manifest's fields
    json j = json::parse(read_text(manifest_path));
    std::vector<json::json_pointer> all;
    pointers(j, json::json_pointer(), all);
    const json::json_pointer at = all[pick(all.size())];
    const int op = static_cast<int>(pick(5));
    static const std::vector<json> values = {
        "x", 2.9, -1, json(std::numeric_limits<uint64_t>::max()), nullptr, json::array(), json::object(), true,
        json(int64_t{1} << 40), 0, "../../outside", "/etc/passwd", json(std::numeric_limits<int64_t>::min())};
    if (op == 0 && at.to_string() != "/manifest_crc32c") {
      j.at(at.parent_pointer()).is_object() ? (void)j.at(at.parent_pointer()).erase(at.back())
                                            : j.at(at.parent_pointer()).erase(std::stoul(at.back()));
      m.what = "delete " + at.to_string();
    } else if (op == 1 || op == 0) {
      const json v = values[pick(values.size())];
      j.at(at) = v;
      m.what = "set " + at.to_string() + " = " + v.dump();
    } else if (op == 2 && j.at(at).is_number_integer()) {
      const int64_t v = j.at(at).get<int64_t>();
      const int64_t choices[] = {v + 1, v - 1, v * 2 + 1, -v - 1, std::numeric_limits<int64_t>::max()};
      j.at(at) = choices[pick(5)];
      m.what = "change the integer " + at.to_string() + " to " + j.at(at).dump();
    } else if (op == 3 && j.contains("files") && !j["files"].empty()) {  // a path that escapes
      auto it = j["files"].begin();
      std::advance(it, static_cast<long>(pick(j["files"].size())));
      const std::string old = it.key();
      static const char* escapes[] = {"../", "/tmp/", "model/../../", "./"};
      const std::string renamed = escapes[pick(4)] + old;
      j["files"][renamed] = j["files"][old];
      j["files"].erase(old);
      for (auto& [name, list] : j["pieces"].items()) {
        for (auto& p : list) {
          if (p["file"] == old) p["file"] = renamed;
        }
      }
      m.what = "rename file " + old + " to " + renamed;
    } else {
      // Swap the values of two random fields.
      const json::json_pointer other = all[pick(all.size())];
      if (at.to_string().rfind(other.to_string(), 0) != 0 && other.to_string().rfind(at.to_string(), 0) != 0) {
        std::swap(j.at(at), j.at(other));
      }
      m.what = "swap " + at.to_string() + " and " + other.to_string();
    }
    // Half the edits keep the checksum right (a hand edit or an adversary): the schema must catch
    // them; the other half are corruptions the checksum must catch.
    m.adversarial = pick(2) == 0;
    if (m.adversarial) {
      write_text(manifest_path, fsdp::manifest_text(j));
      m.what += " (checksum recomputed)";
    } else {
      json copy_j = j;
      write_text(manifest_path, copy_j.dump(1) + "\n");
    }
    return m;
  }
  // The files' bytes.
  const std::vector<std::string> files = files_of(copy);
  const std::string file = files[pick(files.size())];
  const std::string path = copy + "/" + file;
  std::string bytes = read_text(path);
  switch (family) {
    case 5: {  // flip bits of one byte: in the header or the data
      if (bytes.empty()) break;
      const size_t at = pick(2) ? pick(std::min<size_t>(bytes.size(), 256)) : pick(bytes.size());
      bytes[at] = static_cast<char>(bytes[at] ^ (1 + pick(255)));
      write_text(path, bytes);
      m.what = "flip byte " + std::to_string(at) + " of " + file;
      break;
    }
    case 6: {  // truncate
      const size_t n = pick(bytes.size() + 1);
      write_text(path, bytes.substr(0, n));
      m.what = "truncate " + file + " to " + std::to_string(n) + " bytes";
      break;
    }
    case 7: {  // extend
      const size_t n = 1 + pick(64);
      std::string more(n, '\0');
      for (char& c : more) c = static_cast<char>(rng());
      write_text(path, bytes + more);
      m.what = "append " + std::to_string(n) + " bytes to " + file;
      break;
    }
    case 8: {  // swap two files of this checkpoint (ranks' files, model and optimizer)
      const std::string other = files[pick(files.size())];
      const std::string ob = read_text(copy + "/" + other);
      write_text(path, ob);
      write_text(copy + "/" + other, bytes);
      m.what = "swap " + file + " and " + other;
      break;
    }
    default: {  // the same file from another step, or a rank file removed, or the manifest's bytes
      const int sub = static_cast<int>(pick(3));
      if (sub == 0 && m.source == "sharded/step-00000002") {
        const std::string other = base + "/sharded/step-00000003/" + file;
        write_text(path, read_text(other));
        m.what = "replace " + file + " with step 3's";
      } else if (sub == 1) {
        std::remove(path.c_str());
        m.what = "remove " + file;
      } else {
        std::string text = read_text(manifest_path);
        const size_t at = pick(text.size());
        text[at] = static_cast<char>(text[at] ^ (1 + pick(255)));
        write_text(manifest_path, text);
        m.what = "flip byte " + std::to_string(at) + " of manifest.json";
      }
    }
  }
  return m;
}

// The kind of a named error, from its words (for the counts; the whole message is kept too).
std::string error_class(const std::string& e) {
  static const std::vector<std::pair<std::string, std::string>> kinds = {
      {"manifest_crc32c", "manifest checksum"},
      {"not valid JSON", "manifest not JSON"},
      {"is invalid: field", "manifest schema"},
      {"not an fsdp checkpoint manifest", "manifest format"},
      {"manifest version", "manifest version"},
      {"is corrupt: its CRC-32C", "file checksum"},
      {"the manifest says", "file size"},
      {"is missing", "file missing"},
      {"ranks read different manifests", "ranks disagree"},
      {"LOCAL checkpoint saved at", "layout"},
      {"not a state of this model", "model mismatch"},
      {"random number generator state", "generator state"},
      {"hyper-parameters are incomplete or malformed", "optimizer options"},
      {"holds no data for", "data missing"},
      {"which the file does not hold", "data missing"},
      {"the manifest's piece of", "piece placement"},
      {"lies elsewhere in", "piece placement"},
      {"is not the whole of", "piece placement"},
      {"checkpoint file", "file content"},
      {"optimizer", "optimizer state"},
  };
  for (const auto& [needle, kind] : kinds) {
    if (e.find(needle) != std::string::npos) return kind;
  }
  return "other";
}

json fuzz(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const int rank = mesh->rank();
  const auto colon = a.seeds.find(':');
  const int64_t first = std::stoll(a.seeds.substr(0, colon)), last = std::stoll(a.seeds.substr(colon + 1));
  Trained t = build(mesh, a, 3);
  // What an exact load of each source gives; and the state every mutation's load starts from (a
  // model of step 3, so that anything a failed load changed shows).
  std::map<std::string, std::string> exact;
  for (const std::string s : {"sharded/step-00000002", "full/step-00000002", "local/step-00000002"}) {
    const json r = load_and_hash(t, a.path + "/" + s);
    if (!r["error"].get<std::string>().empty()) throw std::runtime_error("the good checkpoint does not load: " + r["error"].get<std::string>());
    exact[s] = r["after"];
  }
  auto reset = [&] { fsdp::load_checkpoint(a.path + "/sharded/step-00000003", *t.model, t.optim.get()); };
  std::map<std::string, int> counts;
  json bad = json::array(), outcomes = json::array();
  const std::string copy = a.path + "/mutated";
  for (int64_t i = first; i < last; ++i) {
    reset();
    Mutation m;
    if (rank == 0) {
      m = mutate(a.path, copy, i);
      write_text(copy + ".adversarial", m.adversarial ? "1" : "0");
    }
    barrier(mesh);
    // Every rank needs the source (to know the exact hash, a function of i alone) and whether the
    // manifest was edited with its checksum recomputed (rank 0 says).
    static const char* sources[] = {"sharded/step-00000002", "full/step-00000002", "local/step-00000002"};
    m.source = sources[i % 3];
    m.adversarial = read_text(copy + ".adversarial") == "1";
    const json r = load_and_hash(t, copy);
    const std::string err = r["error"];
    std::string outcome;
    if (err.empty()) {
      outcome = r["after"] == exact[m.source] ? "exact load" : (m.adversarial ? "loaded an edited manifest" : "ALTERED");
    } else {
      outcome = r["after"] == r["before"] ? "refused: " + error_class(err) : "PARTIAL";
    }
    if (r["seconds"].get<double>() > 30) outcome = "SLOW " + outcome;
    ++counts[outcome];
    json o = {{"i", i}, {"outcome", outcome}, {"seconds", r["seconds"]}};
    if (rank == 0) o["mutation"] = m.what;
    if (!err.empty()) o["error"] = err.substr(0, 400);
    if (outcome == "ALTERED" || outcome == "PARTIAL" || outcome.rfind("SLOW", 0) == 0 || outcome == "refused: other") {
      bad.push_back(o);
    }
    outcomes.push_back(o);
    barrier(mesh);
  }
  return {{"rank", rank}, {"counts", counts}, {"bad", bad}, {"outcomes", outcomes}};
}

}  // namespace

json run_checkpoint_hostile(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const int rank = mesh->rank();
  json out{{"rank", rank}};
  if (a.variants == "save") {
    Trained t = build(mesh, a, 2);
    {
      fsdp::Checkpointer ckpt(mesh, a.path + "/sharded");
      ckpt.save(*t.model, t.optim.get(), {2, "{}"});
      fsdp::Checkpointer full(mesh, a.path + "/full", {fsdp::StateDictKind::FULL});
      full.save(*t.model, t.optim.get(), {2, "{}"});
      fsdp::Checkpointer local(mesh, a.path + "/local", {fsdp::StateDictKind::LOCAL});
      local.save(*t.model, t.optim.get(), {2, "{}"});
    }
    t.optim->zero_grad();
    const int64_t per = kGlobalBatch / mesh->world_size();
    gpt_loss([&](const torch::Tensor& x) { return t.model->forward(x); }, 2, rank * per, rank * per + per).backward();
    t.optim->step();
    fsdp::Checkpointer ckpt(mesh, a.path + "/sharded");
    ckpt.save(*t.model, t.optim.get(), {3, "{}"});
    return out;
  }
  if (a.variants == "load") {  // a checkpoint, or the folder of one (rank 0's choice)
    Trained t = build(mesh, a, 3);
    out.update(load_and_hash(t, fsdp::find_checkpoint(*mesh, a.path).value_or(a.path)));
    return out;
  }
  if (a.variants == "agree") {
    Trained t = build(mesh, a, 3);
    // Rank 1 would pick step 2 (say, its listing came before step 3's commit): it gets rank 0's.
    const auto found = fsdp::find_checkpoint(*mesh, rank == 0 ? a.path + "/sharded" : a.path + "/sharded/step-00000002");
    out["found"] = found.value_or("");
    out.update(load_and_hash(t, a.path + (rank == 0 ? "/sharded/step-00000003" : "/sharded/step-00000002")));
    return out;
  }
  if (a.variants == "resave") {
    Trained t = build(mesh, a, 2);
    fsdp::Checkpointer ckpt(mesh, a.path);
    ckpt.save(*t.model, t.optim.get(), {3, "{\"copy\": 1}"});
    ckpt.save(*t.model, t.optim.get(), {3, "{\"copy\": 2}"});
    const auto latest = ckpt.latest();
    out["latest"] = latest.value_or("");
    return out;
  }
  if (a.variants == "fuzz") return fuzz(mesh, a);
  throw std::invalid_argument("checkpoint_hostile: unknown --variants " + a.variants);
}

}  // namespace worker
