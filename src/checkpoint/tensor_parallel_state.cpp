#include "checkpoint/tensor_parallel_state.h"

#include "comm/mesh_state.h"

namespace fsdp {

const TensorParallel* tensor_parallel_of(detail::ShardedRoot& root) {
  const auto& tp = root.options().tensor_parallel;
  return tp && tp->size() > 1 ? tp.get() : nullptr;
}

std::optional<TensorParallelPlacement> split_placement(const FlatParamHandle& h, size_t i) {
  auto p = tensor_parallel_placement(h.params()[i]);
  if (!p || p->tp->size() == 1) return std::nullopt;
  return p;
}

std::vector<int64_t> whole_shape(const FlatParamHandle& h, size_t i) {
  const auto p = split_placement(h, i);
  return p ? p->full_shape : h.layout().entries()[i].shape;
}

GroupPtr job_group(detail::ShardedRoot& root) {
  if (const TensorParallel* tp = tensor_parallel_of(root)) return detail::MeshState::of(*tp->world()).world;
  return root.comm().mesh().world_group;
}

int job_rank(detail::ShardedRoot& root) { return job_group(root)->getRank(); }
int job_size(detail::ShardedRoot& root) { return job_group(root)->getSize(); }
bool writes_whole(detail::ShardedRoot& root) { return job_rank(root) == 0; }

at::Tensor whole_of(const FlatParamHandle& h, size_t i, const at::Tensor& part) {
  const auto p = split_placement(h, i);
  return p ? tensor_parallel_whole(part, *p) : part;
}

void read_part(const std::function<void(int64_t, at::Tensor)>& read_range, const std::vector<int64_t>& whole,
               const TensorParallelShard& shard, int rank, int size, int64_t begin, at::Tensor dest) {
  // The whole tensor as [outer, n, inner] around the split dimension; this rank's part as
  // [outer, n / size, inner], its index q along the split dimension being chunk q / slice of the
  // `parts` chunks, element q % slice of this rank's slice of it. A run: consecutive q of one chunk.
  const int64_t dim = shard.dim;
  int64_t outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= whole[d];
  for (size_t d = dim + 1; d < whole.size(); ++d) inner *= whole[d];
  // A padded vocabulary (shard.pad: dimension 0, one part) splits n rounded up to a multiple of
  // `size`; its rows from the saved n on are the padding, zeros.
  const int64_t saved_n = whole[dim];
  const int64_t n = shard.pad ? (saved_n + size - 1) / size * size : saved_n;
  const int64_t local_n = n / size, slice = n / shard.parts / size, chunk = n / shard.parts;
  const int64_t end = begin + dest.numel();
  int64_t at = begin;
  while (at < end) {
    const int64_t o = at / (local_n * inner), within = at % (local_n * inner);
    const int64_t q = within / inner, i = within % inner;
    const int64_t p = q / slice, s = q % slice;
    // From (q, i) to the end of this rank's slice of chunk p, in this outer row.
    int64_t run = std::min(end - at, (slice - s) * inner - i);
    const int64_t row = p * chunk + rank * slice + s;
    if (row >= saved_n) {
      dest.narrow(0, at - begin, run).zero_();  // padding
    } else {
      run = std::min(run, (saved_n - row) * inner - i);  // up to the padding
      read_range((o * saved_n + row) * inner + i, dest.narrow(0, at - begin, run));
    }
    at += run;
  }
}

}  // namespace fsdp
