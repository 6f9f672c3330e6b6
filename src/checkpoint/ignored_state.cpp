#include "checkpoint/ignored_state.h"

#include <algorithm>
#include <set>
#include <sstream>
#include <stdexcept>

#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_parallel_state.h"

namespace fsdp {
namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// One line per replicated ignored parameter: its name, shape, dtype and the CRC-32C of its bytes.
// The ranks compare these lines, not the tensors: a few bytes each, whatever the tensors' size.
std::string replicated_digest(const std::vector<IgnoredParam>& params) {
  std::string out;
  for (const IgnoredParam& p : params) {
    if (p.table) continue;
    const at::Tensor bytes = p.param.detach().to(c10::kCPU).contiguous();
    const uint32_t crc = crc32c_update(0, bytes.data_ptr(), static_cast<size_t>(bytes.numel()) * bytes.element_size());
    out += p.name + " " + shape_text(p.shape) + " " + std::string(c10::toString(bytes.scalar_type())) + " crc32c " +
           std::to_string(crc) + "\n";
  }
  return out;
}

// This rank's `local` on the CPU in `shape` (undefined: zeros).
at::Tensor on_cpu(const at::Tensor& local, const std::vector<int64_t>& shape, c10::ScalarType dtype) {
  if (!local.defined()) return at::zeros(shape, at::TensorOptions().dtype(dtype));
  return local.detach().to(c10::kCPU).contiguous().view(shape);
}

}  // namespace

std::vector<IgnoredParam> ignored_params(detail::ShardedRoot& root) {
  std::vector<IgnoredParam> out;
  std::set<const c10::TensorImpl*> seen;  // a tied parameter once, under its first name
  for (const auto& item : root.module().named_parameters(/*recurse=*/true)) {
    const c10::TensorImpl* impl = item.value().unsafeGetTensorImpl();
    if (!root.ignored().count(impl) || !seen.insert(impl).second) continue;
    IgnoredParam p;
    p.name = item.key();
    p.param = item.value();
    p.shape = item.value().sizes().vec();
    for (const detail::RowShardedTable& t : root.row_sharded()) {
      if (t.param.unsafeGetTensorImpl() != impl) continue;
      p.table = &t;
      p.shape = t.shape;
      p.flat_begin = t.row_begin * t.row_numel();
    }
    out.push_back(std::move(p));
  }
  return out;
}

std::map<const c10::TensorImpl*, std::string> saved_parameter_names(detail::ShardedRoot& root) {
  std::map<const c10::TensorImpl*, std::string> out;
  for (const auto& unit : root.unit_list()) {
    const FlatParamHandle& h = unit->handle();
    for (size_t i = 0; i < h.params().size(); ++i) out[h.params()[i].unsafeGetTensorImpl()] = h.layout().entries()[i].fqn;
  }
  for (const IgnoredParam& p : ignored_params(root)) out[p.param.unsafeGetTensorImpl()] = p.name;
  return out;
}

void check_replicated_agree(detail::ShardedRoot& root, const std::string& what) {
  const std::vector<IgnoredParam> params = ignored_params(root);
  // Which ignored parameters are replicated is the same on every rank (the model's structure and
  // the declarations were compared when it was wrapped), so every rank returns here, or none.
  if (std::none_of(params.begin(), params.end(), [](const IgnoredParam& p) { return p.table == nullptr; })) return;
  const std::vector<std::string> all = all_gather_strings(job_group(root), replicated_digest(params));
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    std::istringstream a(all[0]), b(all[r]);
    std::string la, lb;
    while (std::getline(a, la) && std::getline(b, lb) && la == lb) {
    }
    const std::string name = la.substr(0, la.find(' '));
    throw std::invalid_argument(
        "fsdp: " + what + ": ignored parameter '" + name + "' is replicated (it is not in "
        "Options::row_sharded_parameters), so a checkpoint holds it once, rank 0's copy, but rank " + std::to_string(r) +
        " holds another value than rank 0 (rank 0: " + la.substr(la.find(' ') + 1) + "; rank " + std::to_string(r) +
        ": " + lb.substr(lb.find(' ') + 1) + "). If each rank holds its own rows of a table, declare it in "
        "Options::row_sharded_parameters; if it is meant to be the same on every rank, keep it so (fsdp averages no "
        "ignored parameter's gradients: all-reduce them yourself, or broadcast rank 0's values before saving)");
  }
}

at::Tensor whole_ignored(detail::ShardedRoot& root, const IgnoredParam& p, const at::Tensor& local, GatherTo to) {
  at::NoGradGuard no_grad;
  const c10::ScalarType dtype = p.param.scalar_type();
  if (!p.table) {
    if (to == GatherTo::TO_RANK0 && !writes_whole(root)) return at::Tensor();
    return on_cpu(local, p.shape, dtype);
  }
  const detail::RowShardedTable& t = *p.table;
  const GroupPtr& group = root.comm().mesh().world_group;  // the ranks the declarations number
  const int rank = group->getRank(), W = group->getSize();
  std::vector<int64_t> local_shape = t.shape;
  local_shape[0] = t.param.size(0);
  const at::Tensor mine = on_cpu(local, local_shape, dtype);
  const auto opts = at::TensorOptions().dtype(dtype);
  if (to == GatherTo::TO_RANK0) {
    constexpr int kTag = 7102;
    if (rank != 0) {
      if (mine.numel() > 0) {
        std::vector<at::Tensor> out{mine};
        wait_for(group->send(out, 0, kTag), "send of a rank's rows of an ignored table (checkpoint)");
      }
      return at::Tensor();
    }
    // Every row comes from one rank: the declarations were checked to tile the table.
    at::Tensor whole = at::empty(t.shape, opts);
    whole.narrow(0, t.ranks[0].first, mine.size(0)).copy_(mine);
    for (int r = 1; r < W; ++r) {
      const auto [begin, end] = t.ranks[r];
      if (end == begin) continue;
      std::vector<at::Tensor> slot{whole.narrow(0, begin, end - begin)};
      wait_for(group->recv(slot, r, kTag), "receive of a rank's rows of an ignored table (checkpoint)");
    }
    return whole;
  }
  int64_t most = 0;
  for (const auto& [begin, end] : t.ranks) most = std::max(most, end - begin);
  const int64_t row = t.row_numel();
  at::Tensor padded = at::zeros({std::max<int64_t>(most * row, 1)}, opts);
  padded.narrow(0, 0, mine.numel()).copy_(mine.view({-1}));
  at::Tensor all = at::empty({W * padded.numel()}, opts);
  wait_for(group->_allgather_base(all, padded), "all-gather of the ranks' rows of an ignored table (checkpoint)");
  at::Tensor whole = at::empty(t.shape, opts);
  at::Tensor flat = whole.view({-1});
  for (int r = 0; r < W; ++r) {
    const auto [begin, end] = t.ranks[r];
    const int64_t n = (end - begin) * row;
    if (n > 0) flat.narrow(0, begin * row, n).copy_(all.narrow(0, r * padded.numel(), n));
  }
  return whole;
}

void append_whole_ignored(detail::ShardedRoot& root, std::vector<std::pair<std::string, at::Tensor>>& out, bool keep,
                          GatherTo to) {
  for (const IgnoredParam& p : ignored_params(root)) {
    const at::Tensor whole = whole_ignored(root, p, p.param, to);
    // A replicated one is this rank's own tensor (a view on the CPU): the dict gets a copy.
    if (keep) out.emplace_back(p.name, (p.table ? whole : whole.clone()).to(p.param.device()));
  }
}

}  // namespace fsdp
