#include "engine/flat_param_handle.h"

#include <algorithm>
#include <limits>

#include <c10/core/GradMode.h>

#include "init/deferred_init_internal.h"
#include "memory/device.h"

namespace fsdp {
namespace {
std::vector<std::vector<int64_t>> shapes_of(const std::vector<at::Tensor>& params) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : params) shapes.emplace_back(p.sizes().vec());
  return shapes;
}

const std::vector<at::Tensor>& checked(const std::vector<at::Tensor>& params, const std::vector<std::string>& fqns,
                                       int index) {
  TORCH_CHECK(!params.empty(), "fsdp: unit ", index, " has no parameters");
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].dtype() == params[0].dtype() && params[i].device() == params[0].device(),
                "fsdp: a unit mixes dtypes or devices (", fqns[0], " is ", params[0].dtype(), " on ",
                params[0].device(), ", ", fqns[i], " is ", params[i].dtype(), " on ", params[i].device(),
                "). Put parameters of different dtypes in different units.");
  }
  return params;
}
}  // namespace

QuantizedRecord quantization_layout(const FlatParamLayout& layout, int block, std::vector<BlockStarts>* blocks) {
  QuantizedRecord record;
  record.numel = layout.shard_numel();
  for (int64_t r = 0; r < layout.padded_numel() / std::max<int64_t>(layout.shard_numel(), 1); ++r) {
    std::vector<int64_t> runs;
    int64_t end = 0;
    for (const auto& s : layout.slices(r)) {
      if (s.length == 0) continue;
      runs.push_back(s.shard_offset);
      end = std::max(end, s.shard_offset + s.length);
    }
    runs.push_back(end);  // the padding, if the shard has any
    BlockStarts b = quantization_blocks(runs, layout.shard_numel(), block);
    record.max_blocks = std::max(record.max_blocks, static_cast<int64_t>(b.size()));
    if (blocks) blocks->push_back(std::move(b));
  }
  return record;
}

FlatParamHandle::FlatParamHandle(int index, std::vector<std::string> fqns, std::vector<at::Tensor> params,
                                 CommContext& comm, const std::optional<MixedPrecision>& mixed_precision,
                                 std::optional<c10::Device> device)
    : index_(index),
      comm_(comm),
      layout_(fqns, shapes_of(checked(params, fqns, index)), comm.mesh().shard_size),
      params_(std::move(params)),
      dtypes_(unit_dtypes(params_[0].scalar_type(), mixed_precision)) {
  at::NoGradGuard no_grad;
  const int F = comm_.mesh().shard_size;

  // Where the shard lives: the parameters' device, unless they are deferred (meta) or the caller
  // streams them to another device. Then the unit is assembled on the CPU (staged), one unit at a
  // time, and only its shard moves to the target.
  const bool deferred = params_[0].is_meta();
  const c10::Device target = device.value_or(deferred ? c10::Device(c10::kCPU) : params_[0].device());
  const bool staged = deferred || params_[0].device() != target;
  const auto options = params_[0].options().requires_grad(false).device(staged ? c10::Device(c10::kCPU) : target);

  // Flatten, concatenate, right-pad (the padding is zero and stays zero: it never gets a gradient).
  full_ = at::zeros({layout_.padded_numel()}, options);
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries()[i];
    at::Tensor view = full_.narrow(0, e.offset, e.numel).view(e.shape);
    if (deferred) {
      // Replay the parameter's recorded initialization straight into the flat buffer, and make
      // the parameter an ordinary tensor again (same TensorImpl) before it is pointed anywhere.
      materialize_into(params_[i], view);
      adopt(params_[i], view);
    } else {
      view.copy_(params_[i].detach());
    }
    full_views_.push_back(view);
  }
  slices_ = layout_.slices(comm_.mesh().shard_rank);
  if (F == 1) {
    // Replication: the shard is the whole flat parameter and parameters keep their shapes.
    shard_ = staged ? full_.to(target) : full_;
    for (const auto& e : layout_.entries()) {
      sharded_views_.push_back(param_key::keyed(shard_.narrow(0, e.offset, e.numel).view(e.shape)));
    }
  } else {
    shard_ = full_.narrow(0, comm_.mesh().shard_rank * layout_.shard_numel(), layout_.shard_numel())
                 .to(target, /*non_blocking=*/false, /*copy=*/true);
    // 1-D slices. Like every view a parameter is pointed at, keyed (param_key.h): operators on them
    // enter fsdp (to gather the unit in a root's pass, to be guarded outside it).
    for (const auto& s : slices_) sharded_views_.push_back(param_key::keyed(shard_.narrow(0, s.shard_offset, s.length)));
  }
  separate_buffer_ = F > 1 || dtypes_.casts();
  // Parameters point at their shards first, so that the flattening buffer (which adopted deferred
  // parameters still hold) is released before the next allocation: the peak stays at one unit
  // plus the shards.
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(sharded_views_[i]);
  if (F == 1 && !dtypes_.casts()) {
    full_ = shard_;  // no separate buffer: the "unsharded" views are the shard's
    full_views_ = sharded_views_;
  } else if (dtypes_.casts() || staged) {
    // The unsharded buffer on the target device, in the compute dtype. Its views must be made
    // while it has storage; it is emptied right after.
    full_views_.clear();
    full_ = at::Tensor();
    full_ = at::empty({layout_.padded_numel()}, options.device(target).dtype(dtypes_.compute));
    for (const auto& e : layout_.entries()) full_views_.push_back(full_.narrow(0, e.offset, e.numel).view(e.shape));
  }
  if (separate_buffer_) {
    for (auto& v : full_views_) v = param_key::keyed(v);
    resize_unsharded(false);
  }
}

size_t FlatParamHandle::param_at(const at::Tensor& view) const {
  const bool in_shard = view.storage().unsafeGetStorageImpl() == shard_storage();
  const int64_t offset = view.storage_offset() - (in_shard ? shard_.storage_offset() : full_.storage_offset());
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t begin = in_shard && comm_.mesh().shard_size > 1 ? slices_[i].shard_offset : layout_.entries()[i].offset;
    const int64_t length = in_shard && comm_.mesh().shard_size > 1 ? slices_[i].length : layout_.entries()[i].numel;
    if (offset >= begin && offset < begin + std::max<int64_t>(length, 1)) return i;
  }
  return 0;
}

void FlatParamHandle::guard_gathered() {
  if (state_ == HandleState::UNSHARDED && separate_buffer_) gathered_guarded_ = true;
}

void FlatParamHandle::unguard_gathered() { gathered_guarded_ = false; }

bool FlatParamHandle::guarded() const {
  return gathered_guarded_ || (state_ == HandleState::SHARDED && comm_.mesh().shard_size > 1);
}

void FlatParamHandle::resize_unsharded(bool allocate) {
  const auto bytes = layout_.padded_numel() * static_cast<int64_t>(c10::elementSize(dtypes_.compute));
  resize_storage(full_, allocate ? static_cast<size_t>(bytes) : 0);
}

WorkPtr FlatParamHandle::begin_unshard() {
  if (state_ != HandleState::SHARDED) return nullptr;
  if (!separate_buffer_) {
    state_ = HandleState::UNSHARDED;
    return nullptr;
  }
  at::NoGradGuard no_grad;
  if (comm_.mesh().shard_size == 1) {
    // Replication with mixed precision: the "gather" is the cast, on the compute stream.
    resize_unsharded(true);
    full_.copy_(shard_);
    for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(full_views_[i]);
    state_ = HandleState::UNSHARDED;
    return nullptr;
  }
  // Backward after an hpZ forward gathers the secondary shards within their group; every other
  // gather reads the shards, quantized when asked (floating-point units only).
  const bool from_secondary = secondary_.defined();
  const bool quantized = !from_secondary && comm_.param_quantization() != AllGatherQuantization::NONE &&
                         at::isFloatingType(dtypes_.compute);
  const Over over = from_secondary ? Over::SECONDARY : Over::SHARD_GROUP;
  gather_ = comm_.issue(CommKind::ALL_GATHER, over, index_, "parameters", [&] {
    // On the all-gather stream (CUDA): the block is reused in that stream's order. Mixed
    // precision casts once per unit, here, so the all-gather moves param_dtype bytes.
    resize_unsharded(true);
    if (from_secondary) return Buffers{full_, secondary_};
    if (quantized) {
      if (quant_blocks_.empty()) quant_record_ = quantization_layout(layout_, comm_.quantization_block(), &quant_blocks_);
      const BlockStarts& mine = quant_blocks_[static_cast<size_t>(comm_.mesh().shard_rank)];
      record_ = quantize_shard(shard_, comm_.param_quantization(), quant_record_, mine);
      comm_.quantization_tally().measure(shard_, record_, comm_.param_quantization(), quant_record_, mine);
      records_ = at::empty({comm_.mesh().shard_size * quant_record_.bytes()}, record_.options());
      return Buffers{records_, record_};
    }
    shard_cast_ = dtypes_.casts() ? shard_.to(dtypes_.compute) : shard_;
    return Buffers{full_, shard_cast_};
  }, nullptr, from_secondary ? secondary_size_ : 0);
  state_ = HandleState::GATHERING;
  return gather_.work;
}

int64_t FlatParamHandle::finish_unshard() {
  if (state_ != HandleState::GATHERING) return 0;
  const int64_t blocked = comm_.wait(gather_);
  shard_cast_ = at::Tensor();
  if (records_.defined()) {
    at::NoGradGuard no_grad;
    dequantize_records(full_, records_, comm_.param_quantization(), quant_record_, quant_blocks_);
    // Read here on the compute stream, allocated on the all-gather's: the next all-gather that
    // gets the block waits for the compute stream first (comm_streams.h), dequantization included.
    record_ = records_ = at::Tensor();
  }
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(full_views_[i]);
  state_ = HandleState::UNSHARDED;
  return blocked;
}

void FlatParamHandle::reshard(bool keep_secondary) {
  if (state_ == HandleState::GATHERING) finish_unshard();
  const int N = secondary_size_;
  if (!keep_secondary || N == 0) {
    secondary_ = at::Tensor();
  } else if (state_ == HandleState::UNSHARDED && separate_buffer_) {
    // This rank's 1/N of the unit as forward computed with it: the secondary group's ranks hold
    // the N parts in group order, which is what backward's all-gather over them reassembles.
    at::NoGradGuard no_grad;
    const int64_t part = layout_.padded_numel() / N;
    secondary_ = full_.narrow(0, (comm_.mesh().shard_rank % N) * part, part).clone();
  }
  if (state_ == HandleState::SHARDED) return;
  if (separate_buffer_) {
    for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(sharded_views_[i]);
    resize_unsharded(false);
  }
  gathered_guarded_ = false;
  state_ = HandleState::SHARDED;
}

void FlatParamHandle::summon(bool keep) {
  TORCH_INTERNAL_ASSERT(state_ == HandleState::SHARDED, "fsdp: summon_full_params needs every unit at rest");
  at::NoGradGuard no_grad;
  at::Tensor full;
  if (comm_.mesh().shard_size == 1) {
    // The shard is the whole parameter already, but the scope gets a copy of its own all the same:
    // what it changes must reach the shard only through end_summon, as with F > 1 (writeback =
    // false discards it, rank0_only's rank 0 must not keep changes the others never see).
    if (!keep) return;
    full = shard_.clone();
  } else {
    InFlight f = comm_.issue(CommKind::ALL_GATHER, Over::SHARD_GROUP, index_, "parameters (summon_full_params)", [&] {
      full = at::empty({layout_.padded_numel()}, shard_.options());
      return Buffers{full, shard_};
    });
    comm_.wait(f);
    if (!keep) return;
  }
  summoned_ = full;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& e = layout_.entries()[i];
    params_[i].set_data(summoned_.narrow(0, e.offset, e.numel).view(e.shape));
  }
}

void FlatParamHandle::end_summon(bool writeback) {
  if (!summoned_.defined()) return;
  at::NoGradGuard no_grad;
  if (writeback) {
    shard_.copy_(summoned_.narrow(0, comm_.mesh().shard_rank * layout_.shard_numel(), layout_.shard_numel()));
  }
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(sharded_views_[i]);
  summoned_ = at::Tensor();
}

std::vector<int64_t> FlatParamHandle::summoned_checksums() const {
  std::vector<int64_t> out;
  if (!summoned_.defined()) return out;
  at::NoGradGuard no_grad;
  const size_t size = summoned_.element_size();
  const auto word = size == 8 ? at::kLong : size == 4 ? at::kInt : size == 2 ? at::kShort : at::kByte;
  constexpr int64_t kChunk = 1 << 20;
  for (const auto& e : layout_.entries()) {
    // The sum of each word times an odd weight, wrapping modulo 2^64: odd weights are invertible,
    // so a change of any single word changes it.
    const at::Tensor words = summoned_.narrow(0, e.offset, e.numel).view(word);
    int64_t h = 0;
    for (int64_t b = 0; b < e.numel; b += kChunk) {
      const int64_t n = std::min(kChunk, e.numel - b);
      const auto longs = at::TensorOptions().dtype(at::kLong).device(summoned_.device());
      const at::Tensor w = words.narrow(0, b, n).to(at::kLong);
      h = static_cast<int64_t>(static_cast<uint64_t>(h) +
                               static_cast<uint64_t>(w.mul_(at::arange(b, b + n, longs).mul_(2).add_(1)).sum().item<int64_t>()));
    }
    out.push_back(h);
  }
  return out;
}

void FlatParamHandle::poison() {
  if (state_ == HandleState::UNSHARDED) return;
  gather_ = InFlight{};  // failed or abandoned: the backend writes into the buffer no more
  shard_cast_ = record_ = records_ = secondary_ = at::Tensor();
  if (separate_buffer_) {
    at::NoGradGuard no_grad;
    resize_unsharded(true);
    full_.fill_(at::isFloatingType(dtypes_.compute) ? std::numeric_limits<double>::quiet_NaN() : 0.0);
    for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(full_views_[i]);
  }
  state_ = HandleState::UNSHARDED;
}

int64_t FlatParamHandle::sharded_param_bytes() const {
  return layout_.shard_numel() * static_cast<int64_t>(c10::elementSize(dtypes_.master));
}

int64_t FlatParamHandle::unsharded_bytes() const {
  const int64_t secondary = secondary_.defined() ? secondary_.numel() * static_cast<int64_t>(secondary_.element_size()) : 0;
  return (separate_buffer_ ? static_cast<int64_t>(full_.storage().nbytes()) : 0) + secondary;
}

}  // namespace fsdp
