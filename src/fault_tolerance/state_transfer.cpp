// What a joining replica group receives from a live one (live_rank.h): the source's parameters
// (this rank's shards), its optimizer state, its step and the user's own registered state, sent
// over the round's replica group. The members that hold the state already receive it too, which
// keeps each piece one broadcast; only a joining group loads the user's state.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "checkpoint/optimizer_state.h"
#include "fault_tolerance/live_rank.h"
#include "fault_tolerance/value_signing.h"

namespace fsdp {
namespace detail {

Packed pack(const std::vector<at::Tensor>& tensors) {
  Packed p;
  std::map<c10::ScalarType, size_t> buffer_of;
  std::vector<int64_t> sizes;
  for (const auto& t : tensors) {
    auto [it, fresh] = buffer_of.try_emplace(t.scalar_type(), sizes.size());
    if (fresh) sizes.push_back(0);
    p.where.emplace_back(it->second, sizes[it->second]);
    sizes[it->second] += t.numel();
  }
  for (const auto& [dtype, b] : buffer_of) {
    p.buffers.resize(std::max(p.buffers.size(), b + 1));
    p.buffers[b] = at::empty({sizes[b]}, at::TensorOptions().dtype(dtype));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto [b, off] = p.where[i];
    p.buffers[b].narrow(0, off, tensors[i].numel()).copy_(tensors[i].reshape({-1}));
  }
  return p;
}

void unpack(const Packed& p, std::vector<at::Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto [b, off] = p.where[i];
    tensors[i].copy_(p.buffers[b].narrow(0, off, tensors[i].numel()).view(tensors[i].sizes()));
  }
}

}  // namespace detail

int64_t LiveReplicas::Impl::sync_state(int64_t held_step, const std::vector<at::Tensor>& params,
                                       torch::optim::Optimizer* optimizer, int64_t* bytes) {
  const int root =
      static_cast<int>(std::find(round.members.begin(), round.members.end(), round.source) - round.members.begin());
  std::unique_ptr<OptimizerStateAdapter> adapter;
  if (optimizer) adapter = OptimizerStateAdapter::for_optimizer(*optimizer);
  const std::vector<std::string> keys = adapter ? adapter->tensor_keys() : std::vector<std::string>{};
  const int64_t per = 2 + static_cast<int64_t>(keys.size());
  // The header: the step, then per parameter whether it has state, its step and which tensors.
  at::Tensor header = at::zeros({1 + static_cast<int64_t>(params.size()) * per}, at::kLong);
  auto h = header.accessor<int64_t, 1>();
  h[0] = held_step;
  for (size_t i = 0; i < params.size() && adapter; ++i) {
    const ParamOptimState s = adapter->get(*optimizer, params[i]);
    h[1 + i * per] = s.present ? 1 : 0;
    h[2 + i * per] = s.step;
    for (size_t k = 0; k < keys.size(); ++k) h[3 + i * per + k] = s.tensors.count(keys[k]) ? 1 : 0;
  }
  broadcast({header}, root);
  // Every member's state takes the source's shape, then the source's values.
  std::vector<at::Tensor> tensors;
  for (size_t i = 0; i < params.size(); ++i) tensors.push_back(params[i].detach());
  for (size_t i = 0; i < params.size() && adapter; ++i) {
    ParamOptimState mine = adapter->get(*optimizer, params[i]);
    ParamOptimState want;
    want.present = h[1 + i * per] != 0;
    want.step = h[2 + i * per];
    for (size_t k = 0; k < keys.size() && want.present; ++k) {
      if (h[3 + i * per + k] == 0) continue;
      auto it = mine.tensors.find(keys[k]);
      want.tensors[keys[k]] = it != mine.tensors.end() && it->second.sizes() == params[i].sizes()
                                  ? it->second
                                  : at::zeros_like(params[i].detach());
      tensors.push_back(want.tensors[keys[k]]);
    }
    adapter->set(*optimizer, params[i], want);
  }
  detail::Packed packed = detail::pack(tensors);
  broadcast(packed.buffers, root);
  detail::unpack(packed, tensors);
  *bytes = 0;
  for (const auto& b : packed.buffers) *bytes += b.numel() * static_cast<int64_t>(b.element_size());
  const bool receiving = round.source != replica && (round.synchronize || std::count(round.joining.begin(),
                                                                                     round.joining.end(), replica) > 0);
  sync_user_states(root, receiving, bytes);
  return h[0];
}

// The registered states, in name order: their count first (a group that registered other states
// is refused here, before any is loaded), their lengths, then one buffer of their bytes.
void LiveReplicas::Impl::sync_user_states(int root, bool receiving, int64_t* bytes) {
  const bool sending = round.source == replica;
  std::vector<std::string> saved;
  for (const auto& [name, state] : user_states) saved.push_back(sending ? state.save() : std::string());
  at::Tensor count = at::full({1}, static_cast<int64_t>(saved.size()), at::kLong);
  broadcast({count}, root);
  if (count.item<int64_t>() != static_cast<int64_t>(saved.size())) {
    throw std::runtime_error("the source group registered " + std::to_string(count.item<int64_t>()) +
                             " user state(s) (LiveReplicas::register_state) and this group " +
                             std::to_string(saved.size()) + ": every rank must register the same states");
  }
  if (saved.empty()) return;
  at::Tensor lengths = at::zeros({static_cast<int64_t>(saved.size())}, at::kLong);
  for (size_t i = 0; i < saved.size(); ++i) lengths[static_cast<int64_t>(i)] = static_cast<int64_t>(saved[i].size());
  broadcast({lengths}, root);
  const int64_t total = lengths.sum().item<int64_t>();
  at::Tensor buffer = at::empty({total}, at::kByte);
  if (sending) {
    int64_t off = 0;
    for (const auto& text : saved) {
      std::memcpy(buffer.data_ptr<uint8_t>() + off, text.data(), text.size());
      off += static_cast<int64_t>(text.size());
    }
  }
  if (total > 0) broadcast({buffer}, root);
  *bytes += total;
  if (!receiving) return;
  int64_t off = 0;
  size_t i = 0;
  for (auto& [name, state] : user_states) {
    const int64_t n = lengths[static_cast<int64_t>(i++)].item<int64_t>();
    state.load(std::string(reinterpret_cast<const char*>(buffer.data_ptr<uint8_t>()) + off, static_cast<size_t>(n)));
    off += n;
  }
}

void LiveReplicas::Impl::declare_user_states() {
  std::string mine;
  for (const auto& [name, state] : user_states) mine += (mine.empty() ? "" : ", ") + name;
  std::string stored;
  try {
    stored = detail::to_string(
        store->compareSet(key("user_states"), {}, detail::to_bytes(detail::sign_value(options.secret, "user_states", mine))));
  } catch (const std::exception& e) {
    lost("lost", e);
  }
  const std::string theirs = detail::verify_value(options.secret, "user_states", stored).value_or(stored);
  if (theirs != mine) {
    throw std::invalid_argument("fsdp: " + who() + " registered the live states [" + mine + "] but the job's ranks [" +
                                theirs + "] (LiveReplicas::register_state, LiveManager::register_state): a joiner "
                                "would load another state's bytes. It does not join, and the groups in the job train "
                                "on; register the same names on every rank, before the first step");
  }
  user_states_declared = true;
}

}  // namespace fsdp
