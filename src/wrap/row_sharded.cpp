#include "wrap/row_sharded.h"

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>
#include <tuple>

#include "fsdp/tensor_parallel.h"

namespace fsdp::detail {
namespace {

constexpr const char* kField = "Options::row_sharded_parameters";

std::string shape_text(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string rows_text(int64_t begin, int64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

// What must be the same on every rank for one declaration: the name, the dtype and the shape of a
// row (the row counts are compared, and tiled, separately).
int64_t spec_hash(const std::string& name, const at::Tensor& p) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  auto add = [&h](const std::string& s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
  };
  add(name);
  add(std::string(c10::toString(p.scalar_type())));
  add(shape_text(p.sizes().slice(1)));
  return static_cast<int64_t>(h >> 1);
}

// This rank's declarations, resolved to names and checked on their own. Returns the first
// problem ("" when none).
std::string check_locally(const torch::nn::Module& model, const Options& options, const IgnoredSet& ignored, int rank,
                          std::vector<RowShardedTable>& out) {
  std::map<const c10::TensorImpl*, std::string> first_name;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    first_name.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  if (!options.row_sharded_parameters.empty() && options.tensor_parallel && options.tensor_parallel->size() > 1) {
    return std::string(kField) + " with Options::tensor_parallel: a tensor-parallel model's checkpoints are put "
           "together per TP group, which knows nothing of rows held outside fsdp. Not supported; drop one of the two";
  }
  std::set<const c10::TensorImpl*> seen;
  const auto& decls = options.row_sharded_parameters;
  for (size_t i = 0; i < decls.size(); ++i) {
    const RowShardedParameter& d = decls[i];
    const std::string entry = "entry " + std::to_string(i) + " of " + kField;
    if (!d.parameter.defined()) return entry + " holds no tensor; declare the model's own parameter";
    const auto name = first_name.find(d.parameter.unsafeGetTensorImpl());
    if (name == first_name.end()) {
      return entry + " (a tensor of shape " + shape_text(d.parameter.sizes()) + ") is not a parameter of the wrapped "
             "model; declare the model's own parameter tensors (e.g. the embedding's weight)";
    }
    const std::string quoted = "'" + name->second + "'";
    if (!ignored.count(d.parameter.unsafeGetTensorImpl())) {
      return quoted + " is declared in " + kField + " but fsdp does not ignore it: fsdp shards it itself, in its "
             "unit, so it cannot also be this rank's own rows. Add its module to Options::ignored_modules (or it to "
             "Options::ignored_parameters), or drop the declaration";
    }
    if (!seen.insert(d.parameter.unsafeGetTensorImpl()).second) {
      return quoted + " is declared twice in " + std::string(kField) + "; declare each table once";
    }
    if (d.parameter.dim() == 0) return quoted + " is a scalar; a row-sharded parameter has rows (its dimension 0)";
    const int64_t local = d.parameter.size(0);
    if (d.row_begin < 0 || d.rows < 0 || d.row_begin + local > d.rows) {
      return quoted + ": rank " + std::to_string(rank) + " declares rows " + rows_text(d.row_begin, d.row_begin + local) +
             " (row_begin " + std::to_string(d.row_begin) + " and the parameter's " + std::to_string(local) +
             " rows) of a table of " + std::to_string(d.rows) + " rows; they must lie within [0, rows): rows is the "
             "whole table's, all ranks together";
    }
    RowShardedTable t;
    t.name = name->second;
    t.param = d.parameter;
    t.shape = d.parameter.sizes().vec();
    t.shape[0] = d.rows;
    t.row_begin = d.row_begin;
    out.push_back(std::move(t));
  }
  return "";
}

// The ranks' rows of one table must tile it: "" when they do, else what is wrong.
std::string check_tiling(const RowShardedTable& t) {
  std::vector<std::tuple<int64_t, int64_t, int>> held;  // (begin, end, rank) of the ranks that hold rows
  for (size_t r = 0; r < t.ranks.size(); ++r) {
    if (t.ranks[r].second > t.ranks[r].first) held.emplace_back(t.ranks[r].first, t.ranks[r].second, static_cast<int>(r));
  }
  std::sort(held.begin(), held.end());
  std::string problem;
  int64_t cursor = 0;
  int last = -1;
  for (const auto& [begin, end, r] : held) {
    if (begin > cursor) {
      problem = "rows " + rows_text(cursor, begin) + " are held by no rank";
    } else if (begin < cursor) {
      problem = "rows " + rows_text(begin, std::min(end, cursor)) + " are held by both rank " + std::to_string(last) +
                " and rank " + std::to_string(r);
    }
    if (!problem.empty()) break;
    cursor = end;
    last = r;
  }
  if (problem.empty() && cursor < t.shape[0]) problem = "rows " + rows_text(cursor, t.shape[0]) + " are held by no rank";
  if (problem.empty()) return "";
  std::string each;
  for (size_t r = 0; r < t.ranks.size() && r < 8; ++r) {
    each += (r ? ", " : "") + std::string("rank ") + std::to_string(r) + " " + rows_text(t.ranks[r].first, t.ranks[r].second);
  }
  if (t.ranks.size() > 8) each += ", ... (" + std::to_string(t.ranks.size()) + " ranks)";
  return "the ranks' rows of '" + t.name + "' do not tile its " + std::to_string(t.shape[0]) + " rows: " + problem +
         " (" + each + "). Each row must be held by exactly one rank: give each rank's row_begin the first row it "
         "holds, and rows the whole table's count";
}

[[noreturn]] void refuse(const std::string& what) { throw std::invalid_argument("fsdp: " + std::string(kField) + ": " + what); }

}  // namespace

int64_t RowShardedTable::row_numel() const {
  int64_t n = 1;
  for (size_t d = 1; d < shape.size(); ++d) n *= shape[d];
  return n;
}

std::vector<RowShardedTable> resolve_row_sharded(const torch::nn::Module& model, const Options& options,
                                                 const IgnoredSet& ignored, MeshState& mesh) {
  const int rank = mesh.env.rank, W = mesh.env.world_size;
  std::vector<RowShardedTable> tables;
  const std::string mine = check_locally(model, options, ignored, rank, tables);
  if (W == 1 || mesh.simulated) {
    if (!mine.empty()) refuse(mine);
    for (auto& t : tables) {
      // A simulated rank has no peers to compare with: its own rows are all that can be placed.
      t.ranks.assign(W, {0, 0});
      t.ranks[rank] = {t.row_begin, t.row_begin + t.param.size(0)};
      if (W == 1) {
        if (const std::string tiling = check_tiling(t); !tiling.empty()) refuse(tiling);
      }
    }
    return tables;
  }
  // Every rank learns whether any rank failed its own checks (the failing ranks' messages go
  // through the store: only they write one, and only the first is read), and how many tables each
  // declares.
  const std::string key = "fsdp/row-sharded/" + std::to_string(mesh.checks++) + "/";
  if (!mine.empty()) mesh.store->set(key + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  at::Tensor head = at::tensor({static_cast<int64_t>(!mine.empty()), static_cast<int64_t>(tables.size())}, at::kLong);
  at::Tensor heads = at::empty({2 * W}, at::kLong);
  wait_for(mesh.world->_allgather_base(heads, head), "all-gather of the row-sharded declarations' counts");
  const auto* h = heads.data_ptr<int64_t>();
  for (int r = 0; r < W; ++r) {
    if (h[2 * r] == 0) continue;
    const auto text = mesh.store->get(key + std::to_string(r));
    refuse("rank " + std::to_string(r) + ": " + std::string(text.begin(), text.end()));
  }
  for (int r = 1; r < W; ++r) {
    if (h[2 * r + 1] != h[1]) {
      refuse("rank 0 declares " + std::to_string(h[1]) + " row-sharded parameter(s) and rank " + std::to_string(r) +
             " declares " + std::to_string(h[2 * r + 1]) + "; every rank declares its part of the same tables, in the "
             "same order (a rank that holds no rows declares them with row_begin at the table's end and 0 rows)");
    }
  }
  const int64_t n = static_cast<int64_t>(tables.size());
  if (n == 0) return tables;
  // Each table's (name, dtype and row shape), rows and this rank's range, from every rank.
  at::Tensor row = at::empty({4 * n}, at::kLong);
  for (int64_t i = 0; i < n; ++i) {
    const RowShardedTable& t = tables[i];
    row[4 * i] = spec_hash(t.name, t.param);
    row[4 * i + 1] = t.shape[0];
    row[4 * i + 2] = t.row_begin;
    row[4 * i + 3] = t.param.size(0);
  }
  at::Tensor all = at::empty({4 * n * W}, at::kLong);
  wait_for(mesh.world->_allgather_base(all, row), "all-gather of the row-sharded declarations");
  const auto* a = all.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    RowShardedTable& t = tables[i];
    for (int r = 0; r < W; ++r) {
      const int64_t* x = a + 4 * (n * r + i);
      const int64_t* first = a + 4 * i;  // rank 0's
      if (x[0] != first[0]) {
        refuse("declaration " + std::to_string(i) + " differs between rank 0 and rank " + std::to_string(r) +
               " in its parameter, dtype or row shape (here, on rank " + std::to_string(rank) + ", it is '" + t.name +
               "', rows of " + c10::toString(t.param.scalar_type()) + " " + shape_text(t.param.sizes().slice(1)) +
               "); every rank declares its part of the same tables, in the same order");
      }
      if (x[1] != first[1]) {
        refuse("the ranks declare different sizes of '" + t.name + "': rank 0 a table of " + std::to_string(first[1]) +
               " rows, rank " + std::to_string(r) + " of " + std::to_string(x[1]) + "; rows is the whole table's, the "
               "same on every rank");
      }
      t.ranks.emplace_back(x[2], x[2] + x[3]);
    }
    if (const std::string tiling = check_tiling(t); !tiling.empty()) refuse(tiling);
  }
  return tables;
}

}  // namespace fsdp::detail
