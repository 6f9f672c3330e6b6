#include "models/row_sharded_embedding.h"

#include "fsdp/deferred_init.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace models {

namespace {

// Rows are initialized in blocks of this many, each from its own generator (see the header).
constexpr int64_t kInitBlockRows = 256;

uint64_t block_seed(uint64_t seed, int64_t block) {
  uint64_t x = seed ^ (static_cast<uint64_t>(block) * 0x9E3779B97F4A7C15ULL);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;  // splitmix64's finalizer: neighbouring blocks far apart
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<int64_t> to_vector(const torch::Tensor& counts) {
  auto c = counts.to(torch::kCPU, torch::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

int64_t sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

// One all-to-all: rank r sends the rows [sum(in_splits[:j]), +in_splits[j]) of `input` to rank j
// and receives out_splits[j] rows from rank j, in rank order. Waits, and turns a failure (a peer
// gone, a timeout, a backend without alltoall_base) into an exception that says which exchange.
torch::Tensor all_to_all(c10d::Backend& group, const torch::Tensor& input, std::vector<int64_t> out_splits,
                         std::vector<int64_t> in_splits, const char* what, int rank, int world_size) {
  auto in = input.contiguous();
  auto out_sizes = in.sizes().vec();
  out_sizes[0] = sum(out_splits);
  auto out = torch::empty(out_sizes, in.options());
  try {
    auto work = group.alltoall_base(out, in, out_splits, in_splits, c10d::AllToAllOptions());
    if (!work->wait()) throw std::runtime_error("the work did not complete");
  } catch (const std::exception& e) {
    throw std::runtime_error("RowShardedEmbedding: the all-to-all of " + std::string(what) + " failed on rank " +
                             std::to_string(rank) + " of " + std::to_string(world_size) + ": " + e.what());
  }
  return out;
}

// The lookup across ranks, with its gradient sent back to the owners. Arguments after the two
// tensors are constants of the module; backward returns one (undefined) gradient for each.
struct RowAllToAll : torch::autograd::Function<RowAllToAll> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& weight, const torch::Tensor& global_rows,
                               c10::intrusive_ptr<c10d::Backend> group, int64_t rank, int64_t world_size,
                               int64_t row_begin, int64_t rows_per_rank) {
    const int r = static_cast<int>(rank), W = static_cast<int>(world_size);
    // (a) owners of the wanted rows; sorted stably by owner, so each owner's rows are one run.
    auto owner = global_rows.div(rows_per_rank, "floor");
    auto perm = std::get<1>(owner.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
    auto sorted_rows = global_rows.index_select(0, perm);
    auto send_counts = torch::bincount(owner, /*weights=*/{}, /*minlength=*/W);
    // (b) how many rows each rank will ask of this one.
    const std::vector<int64_t> ones(W, 1);
    auto recv_counts = all_to_all(*group, send_counts, ones, ones, "the row counts", r, W);
    const auto send_splits = to_vector(send_counts), recv_splits = to_vector(recv_counts);
    // (c) the row indices to their owners; (d) the owner looks them up among its own rows.
    auto asked = all_to_all(*group, sorted_rows, recv_splits, send_splits, "the row indices", r, W);
    auto local = asked - row_begin;
    if (local.numel() > 0) {
      TORCH_CHECK(local.min().item<int64_t>() >= 0 && local.max().item<int64_t>() < weight.size(0),
                  "RowShardedEmbedding: rank ", r, " was asked for rows outside its range [", row_begin, ", ",
                  row_begin + weight.size(0), "): do all ranks build the embedding with the same shape?");
    }
    auto found = weight.index_select(0, local);
    // (e) the rows back to the ranks that asked, then into the original order.
    auto back = all_to_all(*group, found, send_splits, recv_splits, "the looked-up rows", r, W);
    auto out = torch::empty_like(back).index_copy_(0, perm, back);

    ctx->saved_data["perm"] = perm;
    ctx->saved_data["local"] = local;
    ctx->saved_data["send_splits"] = send_splits;
    ctx->saved_data["recv_splits"] = recv_splits;
    ctx->saved_data["local_rows"] = weight.size(0);
    ctx->saved_data["dim"] = weight.size(1);
    ctx->saved_data["options"] = torch::empty({0}, weight.options());  // dtype and device of a zero gradient
    // A capsule: c10d::Backend is not registered as a TorchScript class, so it cannot be an IValue of its own.
    ctx->saved_data["group"] = c10::IValue::make_capsule(group);
    ctx->saved_data["rank"] = rank;
    ctx->saved_data["world_size"] = world_size;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto perm = ctx->saved_data["perm"].toTensor();
    auto local = ctx->saved_data["local"].toTensor();
    auto send_splits = ctx->saved_data["send_splits"].toIntVector();
    auto recv_splits = ctx->saved_data["recv_splits"].toIntVector();
    const int64_t local_rows = ctx->saved_data["local_rows"].toInt();
    auto group = c10::intrusive_ptr<c10d::Backend>::reclaim_copy(
        static_cast<c10d::Backend*>(ctx->saved_data["group"].toCapsule().get()));
    const int r = static_cast<int>(ctx->saved_data["rank"].toInt());
    const int W = static_cast<int>(ctx->saved_data["world_size"].toInt());

    // The exchange is a collective: an undefined incoming gradient still takes part, as zeros.
    const int64_t dim = ctx->saved_data["dim"].toInt();
    auto grad = grads[0].defined() ? grads[0].reshape({-1, dim})
                                   : torch::zeros({perm.numel(), dim}, ctx->saved_data["options"].toTensor().options());
    auto sorted = grad.index_select(0, perm);
    auto received = all_to_all(*group, sorted, recv_splits, send_splits, "the row gradients", r, W);
    // Rows asked for by several samples (or ranks) accumulate; / W: the gradient convention.
    auto grad_weight = torch::zeros({local_rows, dim}, grad.options());
    grad_weight.index_add_(0, local, received).div_(W);
    return {grad_weight, torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

RowShardedEmbeddingImpl::RowShardedEmbeddingImpl(int64_t num_tables_, int64_t rows_, int64_t dim_,
                                                 c10::intrusive_ptr<c10d::Backend> group, int rank, int world_size)
    : num_tables(num_tables_), rows(rows_), dim(dim_), group_(std::move(group)), rank_(rank), world_size_(world_size) {
  TORCH_CHECK(num_tables > 0 && rows > 0 && dim > 0, "RowShardedEmbedding: num_tables (", num_tables, "), rows (",
              rows, ") and dim (", dim, ") must be positive");
  if (!group_) {
    TORCH_CHECK(rank == 0 && world_size == 1, "RowShardedEmbedding: without a group it is one process holding the "
                "whole table (rank 0 of 1), got rank ", rank, " of ", world_size);
  } else {
    TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "RowShardedEmbedding: rank ", rank,
                " is not in a group of ", world_size);
    TORCH_CHECK(group_->getSize() == world_size && group_->getRank() == rank, "RowShardedEmbedding: the group is rank ",
                group_->getRank(), " of ", group_->getSize(), " but rank ", rank, " of ", world_size, " was given");
  }
  const int64_t N = num_tables * rows;
  rows_per_rank_ = (N + world_size - 1) / world_size;
  row_begin_ = std::min<int64_t>(N, rank * rows_per_rank_);
  local_rows_ = std::min<int64_t>(N, row_begin_ + rows_per_rank_) - row_begin_;

  // One draw from the global RNG, at every world size (see the header), then this rank's rows.
  const uint64_t seed = [] {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get<at::CPUGeneratorImpl>()->random64();
  }();
  // This rank's own rows, 1/W of the table: made now even under fsdp::deferred_init (nothing to
  // defer: fsdp leaves them alone), meta under fsdp::meta_init.
  fsdp::NotDeferred own_rows;
  weight = register_parameter("weight", torch::empty({local_rows_, dim}));
  if (weight.is_meta()) return;
  torch::NoGradGuard no_grad;
  for (int64_t b = row_begin_ / kInitBlockRows; b * kInitBlockRows < row_begin_ + local_rows_; ++b) {
    // Block b, drawn whole from its own generator; the rows of it this rank holds are kept.
    const int64_t b0 = b * kInitBlockRows;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(block_seed(seed, b));
    const auto block = torch::empty({kInitBlockRows, dim}).normal_(0.0, 0.1, gen);
    const int64_t lo = std::max(row_begin_, b0), hi = std::min(row_begin_ + local_rows_, b0 + kInitBlockRows);
    weight.narrow(0, lo - row_begin_, hi - lo).copy_(block.narrow(0, lo - b0, hi - lo));
  }
}

torch::Tensor RowShardedEmbeddingImpl::forward(const torch::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) == num_tables && ids.scalar_type() == torch::kLong,
              "RowShardedEmbedding expects int64 ids [B, ", num_tables, "], got ", ids.scalar_type(), " ",
              ids.sizes());
  const int64_t B = ids.size(0);
  auto ids_here = ids.to(weight.device());
  if (ids_here.numel() > 0) {
    TORCH_CHECK(ids_here.min().item<int64_t>() >= 0 && ids_here.max().item<int64_t>() < rows,
                "RowShardedEmbedding: ids must lie in [0, ", rows, ")");
  }
  auto offsets = torch::arange(num_tables, ids_here.options()) * rows;  // table t starts at t * rows
  auto global_rows = (ids_here + offsets).reshape({-1});
  if (!group_ || world_size_ == 1) return weight.index_select(0, global_rows).reshape({B, num_tables, dim});
  return RowAllToAll::apply(weight, global_rows, group_, static_cast<int64_t>(rank_),
                            static_cast<int64_t>(world_size_), row_begin_, rows_per_rank_)
      .reshape({B, num_tables, dim});
}

}  // namespace models
