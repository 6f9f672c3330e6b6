// fsdp-test-worker checkpoint_ignored --out PREFIX   (W = 2; docs/checkpoints.md "Ignored parameters")
//   The DHEN-like model's table, whose rows each rank holds outside fsdp, declared with
//   Options::row_sharded_parameters: the declarations fsdp refuses when the model is wrapped (a
//   parameter it does not ignore, a tensor that is no parameter, rows that do not tile the table,
//   tables of different sizes, one declared twice), what a checkpoint does with an ignored
//   parameter left undeclared (replicated: refused when the ranks' copies differ), and a load of a
//   checkpoint whose table has another shape: refused by name with nothing changed on any rank,
//   while the same load into a model of the saved shape brings back every row and its AdamW state
//   bit for bit. In memory and as one file: full_state_dict's table whole, sharded_state_dict's
//   rows at their place in it, and export_full's file loading (load_model_file) each rank's rows.
//   Writes each error message (empty: none) and the comparisons.
#include <functional>

#include "fsdp/checkpoint.h"
#include "worker.h"

namespace worker {
namespace {

// Copies of everything a load may change: this rank's shards and rows, and the optimizer's state.
std::vector<torch::Tensor> snapshot(fsdp::FullyShardedDataParallelBase& model, torch::optim::AdamW& optim) {
  std::vector<torch::Tensor> out;
  for (const auto& p : model.parameters()) {
    out.push_back(p.detach().clone());
    auto it = optim.state().find(p.unsafeGetTensorImpl());
    if (it == optim.state().end()) continue;
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    out.push_back(s.exp_avg().clone());
    out.push_back(s.exp_avg_sq().clone());
    out.push_back(torch::full({1}, s.step(), torch::kLong));
  }
  return out;
}

bool same(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].sizes() != b[i].sizes() || !torch::equal(a[i], b[i])) return false;
  }
  return true;
}

}  // namespace

json run_checkpoint_ignored(const std::shared_ptr<fsdp::Mesh>& mesh, const Args& a) {
  const int rank = mesh->rank(), W = mesh->world_size();
  const int64_t per = kGlobalBatch / W;
  const models::DHENConfig tiny = models::DHENConfig::preset("dhen-tiny");
  auto build = [&](int64_t rows) {
    models::DHENConfig cfg = tiny;
    cfg.rows = rows;
    torch::manual_seed(0);
    return models::DHEN(cfg, mesh->world(), rank, W);
  };
  auto table = [](const models::DHEN& m) {
    const auto& e = *m->sparse;
    return fsdp::RowShardedParameter{e.weight, e.row_begin(), e.num_tables * e.rows};
  };
  auto options = [&](const models::DHEN& m, bool declare) {
    fsdp::Options o = options_from(a);
    o.auto_wrap_policy = fsdp::module_type_policy<models::DHENLayerImpl>();
    o.ignored_modules = {m->sparse.ptr()};
    if (declare) o.row_sharded_parameters = {table(m)};
    return o;
  };
  // The error wrapping the model gives with its declarations edited.
  auto wrapped_with = [&](const std::function<void(models::DHEN&, fsdp::Options&)>& edit) {
    models::DHEN m = build(tiny.rows);
    fsdp::Options o = options(m, true);
    edit(m, o);
    return error_of([&] { fsdp::FullyShardedDataParallel sharded(m, mesh, o); });
  };
  const int64_t N = tiny.n_sparse * tiny.rows;
  json out{{"rank", rank}};
  out["declared"] = wrapped_with([](models::DHEN&, fsdp::Options&) {});
  out["not_ignored"] = wrapped_with([](models::DHEN& m, fsdp::Options& o) {
    o.row_sharded_parameters = {{m->dense_proj->weight, 0, m->dense_proj->weight.size(0)}};
  });
  out["not_a_parameter"] = wrapped_with([](models::DHEN&, fsdp::Options& o) {
    o.row_sharded_parameters = {{torch::zeros({4, 4}), 0, 4}};
  });
  out["declared_twice"] = wrapped_with([](models::DHEN&, fsdp::Options& o) {
    o.row_sharded_parameters.push_back(o.row_sharded_parameters[0]);
  });
  out["overlap"] = wrapped_with([](models::DHEN&, fsdp::Options& o) { o.row_sharded_parameters[0].row_begin = 0; });
  out["gap"] = wrapped_with([&](models::DHEN&, fsdp::Options& o) { o.row_sharded_parameters[0].rows = N + 5; });
  out["other_rows_per_rank"] = wrapped_with([&](models::DHEN&, fsdp::Options& o) {
    if (rank == 1) o.row_sharded_parameters[0].rows = N + 64;
  });

  auto step = [&](fsdp::FullyShardedDataParallelBase& sharded, models::DHEN& m, torch::optim::AdamW& optim, int s) {
    static const models::ClickData clicks(tiny, 3);
    auto [dense, ids, labels] = clicks.batch(s, kGlobalBatch, rank * per, rank * per + per);
    optim.zero_grad();
    // The ids of the tiny config's tables, folded into a smaller table's rows.
    auto loss = models::click_loss(sharded.forward_with([&] { return m->forward(dense, ids.remainder(m->sparse->rows)); }),
                                   labels);
    loss.backward();
    optim.step();
  };
  const std::string dir = a.out + "-ckpt-ignored";
  std::vector<torch::Tensor> saved_state;
  {  // Undeclared, the rows are taken as replicated: a save finds that the ranks' copies differ.
    models::DHEN m = build(tiny.rows);
    fsdp::FullyShardedDataParallel sharded(m, mesh, options(m, false));
    torch::optim::AdamW optim(sharded.parameters(), torch::optim::AdamWOptions(0.01));
    step(sharded, m, optim, 0);
    fsdp::Checkpointer ckpt(mesh, dir + "-undeclared");
    out["undeclared_save"] = error_of([&] { ckpt.save(sharded, &optim, {1, "{}"}); });
  }
  {  // Declared: saved whole, with its optimizer state.
    models::DHEN m = build(tiny.rows);
    fsdp::FullyShardedDataParallel sharded(m, mesh, options(m, true));
    torch::optim::AdamW optim(sharded.parameters(), torch::optim::AdamWOptions(0.01));
    for (int s = 0; s < 2; ++s) step(sharded, m, optim, s);
    fsdp::Checkpointer ckpt(mesh, dir);
    ckpt.save(sharded, &optim, {2, "{}"});
    saved_state = snapshot(sharded, optim);
  }
  {  // A table of half the rows: refused by name, nothing changed.
    models::DHEN m = build(tiny.rows / 2);
    fsdp::FullyShardedDataParallel sharded(m, mesh, options(m, true));
    torch::optim::AdamW optim(sharded.parameters(), torch::optim::AdamWOptions(0.01));
    step(sharded, m, optim, 5);
    const auto before = snapshot(sharded, optim);
    out["load_other_rows"] = error_of([&] { fsdp::load_checkpoint(fsdp::latest_checkpoint(dir).value(), sharded, &optim); });
    out["unchanged"] = same(before, snapshot(sharded, optim));
  }
  {  // The saved shape, other weights and a stepped optimizer: the load brings back the saved state.
    models::DHEN m = build(tiny.rows);
    fsdp::FullyShardedDataParallel sharded(m, mesh, options(m, true));
    torch::optim::AdamW optim(sharded.parameters(), torch::optim::AdamWOptions(0.01));
    for (int s = 5; s < 8; ++s) step(sharded, m, optim, s);
    out["load_same_rows"] = error_of([&] { fsdp::load_checkpoint(fsdp::latest_checkpoint(dir).value(), sharded, &optim); });
    out["loaded_exactly"] = same(saved_state, snapshot(sharded, optim));
  }
  {  // In memory and as one file: the table whole, or this rank's rows with their place in it.
    models::DHEN m = build(tiny.rows);
    fsdp::FullyShardedDataParallel sharded(m, mesh, options(m, true));
    torch::manual_seed(0);
    const models::DHEN whole(tiny);  // one process, the same seed: the whole table, as every W draws it
    const torch::Tensor& all_rows = whole->sparse->weight;
    auto table_of = [](const std::vector<std::pair<std::string, torch::Tensor>>& sd) {
      for (const auto& [name, t] : sd) {
        if (name == "sparse.weight") return t;
      }
      return torch::Tensor();
    };
    const torch::Tensor full = table_of(fsdp::full_state_dict(sharded, /*rank0_only=*/false));
    out["full_state_dict_table"] = full.defined() && full.sizes() == all_rows.sizes() && torch::equal(full, all_rows);
    out["sharded_state_dict_table"] = false;
    for (const auto& [name, piece] : fsdp::sharded_state_dict(sharded)) {
      if (name != "sparse.weight") continue;
      const int64_t begin = m->sparse->row_begin(), rows = m->sparse->local_rows();
      out["sharded_state_dict_table"] = piece.shape == std::vector<int64_t>{N, tiny.dim} &&
                                        piece.flat_begin == begin * tiny.dim &&
                                        torch::equal(piece.local.view({rows, tiny.dim}), all_rows.narrow(0, begin, rows));
    }
    torch::optim::AdamW optim(sharded.parameters(), torch::optim::AdamWOptions(0.01));
    for (int s = 0; s < 2; ++s) step(sharded, m, optim, s);
    const std::string file = dir + "-model.safetensors";
    fsdp::export_full(file, sharded);
    const torch::Tensor trained = table_of(fsdp::full_state_dict(sharded, /*rank0_only=*/false));
    models::DHEN fresh = build(tiny.rows);
    fsdp::FullyShardedDataParallel reloaded(fresh, mesh, options(fresh, true));
    fsdp::load_model_file(file, reloaded);
    out["load_model_file_rows"] = torch::equal(fresh->sparse->weight, m->sparse->weight) &&
                                  !torch::equal(trained, all_rows);
  }
  return out;
}

}  // namespace worker
