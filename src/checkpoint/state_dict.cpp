#include "checkpoint/state_dict.h"

#include <map>
#include <set>

#include "checkpoint/ignored_state.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_parallel_state.h"

namespace fsdp {

RankState collect_rank_state(detail::ShardedRoot& root, torch::optim::Optimizer* optimizer) {
  RankState out;
  std::unique_ptr<OptimizerStateAdapter> adapter;
  if (optimizer) {
    adapter = OptimizerStateAdapter::for_optimizer(*optimizer);
    out.optimizer = OptimizerMeta{adapter->name(), nlohmann::json::array(), nlohmann::json::object()};
  }
  std::map<const c10::TensorImpl*, std::string> name_of;
  std::vector<StatePiece> optim_pieces;
  // A parameter's piece, and its optimizer state placed the same way.
  auto add = [&](const StatePiece& p, const at::Tensor& param) {
    out.pieces.push_back(p);
    name_of[param.unsafeGetTensorImpl()] = p.key;
    if (!adapter) return;
    const ParamOptimState st = adapter->get(*optimizer, param);
    if (!st.present) return;
    out.optimizer->steps[p.key] = st.step;
    for (const auto& [key, t] : st.tensors) {
      TORCH_CHECK(t.numel() == p.local.numel(), "fsdp: the optimizer's ", key, " of ", p.key, " has ", t.numel(),
                  " elements where its parameter has ", p.local.numel(), " on this rank; was the optimizer built before "
                  "the model was wrapped? Build it after, from the wrapper's parameters().");
      StatePiece o = p;
      o.key = "state." + p.key + "." + key;
      o.folder = "optim";
      o.param = p.key;
      o.state_key = key;
      o.dtype = t.scalar_type();
      o.local = t.detach().reshape({-1});
      optim_pieces.push_back(std::move(o));
    }
  };
  for (const auto& unit : root.unit_list()) {
    const FlatParamHandle& h = unit->handle();
    const auto& entries = h.layout().entries();
    out.unit_shards.push_back(h.shard());
    for (size_t i = 0; i < entries.size(); ++i) {
      const ShardSlice& s = h.slices()[i];
      StatePiece p;
      p.key = entries[i].fqn;
      p.folder = "model";
      p.shape = entries[i].shape;
      p.dtype = h.dtypes().master;
      p.flat_begin = s.param_begin;
      p.local = shard_slice(*unit, i);
      p.unit = unit->index();
      p.shard_offset = s.shard_offset;
      add(p, h.params()[i]);
    }
  }
  for (const IgnoredParam& ig : ignored_params(root)) {
    StatePiece p;
    p.key = ig.name;
    p.folder = "model";
    p.shape = ig.shape;
    p.dtype = ig.param.scalar_type();
    p.flat_begin = ig.flat_begin;
    p.local = ig.param.detach().reshape({-1});
    p.own_rows = ig.table != nullptr;
    add(p, ig.param);
  }
  for (const auto& b : root.module().named_buffers(true)) {
    if (!b.value().defined()) continue;
    StatePiece p;
    p.key = b.key();
    p.folder = "model";
    p.shape = b.value().sizes().vec();
    p.dtype = b.value().scalar_type();
    p.local = b.value().detach().reshape({-1});
    out.pieces.push_back(std::move(p));
  }
  if (adapter) {
    for (auto& group : optimizer->param_groups()) {
      nlohmann::json names = nlohmann::json::array();
      for (const auto& p : group.params()) {
        auto it = name_of.find(p.unsafeGetTensorImpl());
        TORCH_CHECK(it != name_of.end(), "fsdp: the optimizer steps a tensor that is not a parameter of this wrapped "
                                         "model; checkpoints name optimizer state by parameter name");
        names.push_back(it->second);
      }
      out.optimizer->groups.push_back({{"options", adapter->group_options(group)}, {"params", names}});
    }
  }
  for (auto& p : optim_pieces) out.pieces.push_back(std::move(p));
  return out;
}

nlohmann::json describe_model_state(detail::ShardedRoot& root) {
  nlohmann::json params = nlohmann::json::object(), units = nlohmann::json::array();
  std::map<const c10::TensorImpl*, std::string> first;
  for (const auto& unit : root.unit_list()) {
    const FlatParamHandle& h = unit->handle();
    nlohmann::json names = nlohmann::json::array();
    for (size_t i = 0; i < h.layout().entries().size(); ++i) {
      const auto& e = h.layout().entries()[i];
      names.push_back(e.fqn);
      params[e.fqn] = {{"shape", whole_shape(h, i)}, {"dtype", safetensors_dtype(h.dtypes().master)}, {"unit", unit->index()},
                       {"aliases", nlohmann::json::array()}};
      first[h.params()[i].unsafeGetTensorImpl()] = e.fqn;
    }
    units.push_back({{"name", unit->name()}, {"params", names}, {"numel", h.layout().numel()},
                     {"padded_numel", h.layout().padded_numel()}, {"shard_numel", h.layout().shard_numel()}});
  }
  for (const IgnoredParam& ig : ignored_params(root)) {
    params[ig.name] = {{"shape", ig.shape}, {"dtype", safetensors_dtype(ig.param.scalar_type())}, {"unit", -1},
                       {"aliases", nlohmann::json::array()}, {"ignored", ig.table ? "row_sharded" : "replicated"}};
    first[ig.param.unsafeGetTensorImpl()] = ig.name;
  }
  // A tied weight appears once under its first name; its other names are aliases.
  for (const auto& item : root.module().named_parameters(true)) {
    auto it = first.find(item.value().unsafeGetTensorImpl());
    if (it != first.end() && it->second != item.key()) params[it->second]["aliases"].push_back(item.key());
  }
  nlohmann::json buffers = nlohmann::json::object();
  for (const auto& b : root.module().named_buffers(true)) {
    if (b.value().defined()) {
      buffers[b.key()] = {{"shape", b.value().sizes().vec()}, {"dtype", safetensors_dtype(b.value().scalar_type())}};
    }
  }
  return {{"params", params}, {"buffers", buffers}, {"units", units}};
}

std::vector<Box> boxes_of_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  std::vector<Box> out;
  if (begin >= end) return out;
  if (shape.size() <= 1) {
    Box b;
    if (shape.empty()) {  // a scalar: one element, no dimensions
      b.flat_begin = 0;
      b.flat_end = 1;
    } else {
      b.offsets = {begin};
      b.sizes = {end - begin};
      b.flat_begin = begin;
      b.flat_end = end;
    }
    out.push_back(std::move(b));
    return out;
  }
  const std::vector<int64_t> inner_shape(shape.begin() + 1, shape.end());
  int64_t inner = 1;
  for (int64_t d : inner_shape) inner *= d;
  auto prefixed = [&](int64_t row, const std::vector<Box>& in) {
    for (const Box& b : in) {
      Box r;
      r.offsets.push_back(row);
      r.sizes.push_back(1);
      r.offsets.insert(r.offsets.end(), b.offsets.begin(), b.offsets.end());
      r.sizes.insert(r.sizes.end(), b.sizes.begin(), b.sizes.end());
      r.flat_begin = row * inner + b.flat_begin;
      r.flat_end = row * inner + b.flat_end;
      out.push_back(std::move(r));
    }
  };
  int64_t at = begin;
  if (at % inner != 0) {  // a partial first row
    const int64_t row = at / inner, stop = std::min(end, (row + 1) * inner);
    prefixed(row, boxes_of_range(inner_shape, at - row * inner, stop - row * inner));
    at = stop;
  }
  if (end / inner > at / inner && at < end) {  // whole rows
    const int64_t first = at / inner, last = end / inner;
    Box b;
    b.offsets.assign(shape.size(), 0);
    b.offsets[0] = first;
    b.sizes = shape;
    b.sizes[0] = last - first;
    b.flat_begin = first * inner;
    b.flat_end = last * inner;
    out.push_back(std::move(b));
    at = last * inner;
  }
  if (at < end) {  // a partial last row
    const int64_t row = at / inner;
    prefixed(row, boxes_of_range(inner_shape, 0, end - row * inner));
  }
  return out;
}

at::Tensor shard_slice(const Unit& unit, size_t i) {
  const ShardSlice& s = unit.handle().slices()[i];
  return unit.handle().shard().narrow(0, s.shard_offset, s.length);
}

at::Tensor view_of_param(const at::Tensor& unsharded_flat, const FlatParamEntry& entry) {
  return unsharded_flat.narrow(0, entry.offset, entry.numel).view(entry.shape);
}

void gather_units(detail::ShardedRoot& root, const std::function<at::Tensor(const Unit&, size_t)>& local_of,
                  const std::function<void(const Unit&, const at::Tensor&)>& consume, GatherTo to) {
  at::NoGradGuard no_grad;
  CommContext& comm = root.comm();
  const MeshInfo& mi = comm.mesh();
  const int F = mi.shard_size;
  // TO_RANK0 concerns rank 0's shard group only (shard groups are F consecutive ranks).
  if (to == GatherTo::TO_RANK0 && mi.rank >= F) return;
  for (const auto& unit : root.unit_list()) {
    const FlatParamHandle& h = unit->handle();
    const auto opts = at::TensorOptions().dtype(h.dtypes().master).device(h.shard().device());
    const int64_t n = h.layout().shard_numel();
    auto fill = [&](at::Tensor into) {  // this rank's shard of the stream, into `into` ([n], zeros)
      for (size_t i = 0; i < h.slices().size(); ++i) {
        const ShardSlice& s = h.slices()[i];
        const at::Tensor local = local_of(*unit, i);
        if (s.length > 0 && local.defined()) into.narrow(0, s.shard_offset, s.length).copy_(local.reshape({-1}));
      }
    };
    if (to == GatherTo::TO_RANK0) {
      if (mi.rank == 0) {
        at::Tensor full = at::zeros({h.layout().padded_numel()}, opts);
        fill(full.narrow(0, 0, n));
        for (int r = 1; r < F; ++r) {
          std::vector<at::Tensor> slot{full.narrow(0, r * n, n)};
          wait_for(mi.shard_group->recv(slot, r, unit->index()), "receive of a shard (checkpoint)");
        }
        consume(*unit, full);
      } else {
        std::vector<at::Tensor> mine{at::zeros({n}, opts)};
        fill(mine[0]);
        wait_for(mi.shard_group->send(mine, 0, unit->index()), "send of a shard (checkpoint)");
      }
      continue;
    }
    at::Tensor shard = at::zeros({n}, opts);
    fill(shard);
    if (F == 1) {
      consume(*unit, shard);
      continue;
    }
    at::Tensor full;
    InFlight f = comm.issue(CommKind::ALL_GATHER, Over::SHARD_GROUP, unit->index(), "state (checkpoint)", [&] {
      full = at::empty({h.layout().padded_numel()}, opts);
      return Buffers{full, shard};
    });
    comm.wait(f);
    f = InFlight{};
    shard = at::Tensor();
    consume(*unit, full);
  }
}

std::vector<std::string> all_gather_strings(const GroupPtr& group, const std::string& mine) {
  const int n = group->getSize();
  std::vector<at::Tensor> len_in{at::tensor({static_cast<int64_t>(mine.size())}, at::kLong)};
  std::vector<std::vector<at::Tensor>> len_out(1);
  for (int r = 0; r < n; ++r) len_out[0].push_back(at::empty({1}, at::kLong));
  group->allgather(len_out, len_in)->wait();
  int64_t longest = 0;
  for (const auto& t : len_out[0]) longest = std::max(longest, t.item<int64_t>());
  at::Tensor data = at::zeros({std::max<int64_t>(longest, 1)}, at::kByte);
  std::memcpy(data.data_ptr(), mine.data(), mine.size());
  std::vector<at::Tensor> in{data};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < n; ++r) out[0].push_back(at::empty_like(data));
  group->allgather(out, in)->wait();
  std::vector<std::string> result;
  for (int r = 0; r < n; ++r) {
    const auto* p = static_cast<const char*>(out[0][r].data_ptr());
    result.emplace_back(p, static_cast<size_t>(len_out[0][r].item<int64_t>()));
  }
  return result;
}

std::vector<std::string> gather_strings_to_rank0(const GroupPtr& group, const std::string& mine) {
  const int n = group->getSize(), rank = group->getRank();
  // The lengths first (one number per rank), so that rank 0 can size each receive.
  std::vector<at::Tensor> len_in{at::tensor({static_cast<int64_t>(mine.size())}, at::kLong)};
  std::vector<std::vector<at::Tensor>> len_out(1);
  for (int r = 0; r < n; ++r) len_out[0].push_back(at::empty({1}, at::kLong));
  group->allgather(len_out, len_in)->wait();
  constexpr int kTag = 7001;
  if (rank != 0) {
    if (!mine.empty()) {
      std::vector<at::Tensor> out{at::from_blob(const_cast<char*>(mine.data()), {static_cast<int64_t>(mine.size())}, at::kByte)};
      group->send(out, 0, kTag)->wait();
    }
    return {};
  }
  std::vector<std::string> result(n);
  result[0] = mine;
  for (int r = 1; r < n; ++r) {
    const int64_t len = len_out[0][r].item<int64_t>();
    if (len == 0) continue;
    std::vector<at::Tensor> in{at::empty({len}, at::kByte)};
    group->recv(in, r, kTag)->wait();
    result[r].assign(static_cast<const char*>(in[0].data_ptr()), static_cast<size_t>(len));
  }
  return result;
}

}  // namespace fsdp
