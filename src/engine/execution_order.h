// The order units run in, which prefetching needs (paper §3.3.2, §3.3.3). Recorded afresh every
// iteration, so a model whose control flow changes between iterations is still prefetched from
// what it really did:
//   backward prefetch  uses this iteration's post-forward order, reversed: backward runs roughly
//                      in the reverse of the order in which units' forwards ended;
//   forward prefetch   can only guess from the previous iteration's pre-forward order, which is
//                      why it is meant for static graphs.
// A wrong guess costs memory and bandwidth (a unit gathered that is not used next), never
// correctness: every unit is still gathered where it is used and freed at the end.
#pragma once

#include <cstddef>
#include <vector>

namespace fsdp {

class ExecutionOrder {
 public:
  // A new iteration: this iteration's forward order becomes the guess for the next one.
  void start_iteration();
  void forward_started(size_t unit);  // the unit's forward begins (pre-forward order)
  void forward_ended(size_t unit);    // the unit's forward is over (post-forward order)

  // Up to `count` units that backward will reach after `unit`, nearest first, skipping those for
  // which `skip(u)` is true.
  template <typename Skip>
  std::vector<size_t> next_in_backward(size_t unit, int count, Skip skip) const {
    return next(post_, unit, count, /*forward=*/false, skip);
  }
  // Up to `count` units the previous iteration's forward ran after `unit`, nearest first.
  template <typename Skip>
  std::vector<size_t> next_in_forward(size_t unit, int count, Skip skip) const {
    return next(previous_pre_, unit, count, /*forward=*/true, skip);
  }

 private:
  template <typename Skip>
  static std::vector<size_t> next(const std::vector<size_t>& order, size_t unit, int count, bool forward, Skip skip) {
    std::vector<size_t> out;
    // The unit's last occurrence (a unit may run more than once per iteration).
    long pos = -1;
    for (long i = static_cast<long>(order.size()) - 1; i >= 0; --i) {
      if (order[static_cast<size_t>(i)] == unit) { pos = i; break; }
    }
    if (pos < 0) return out;
    const long step = forward ? 1 : -1;
    for (long i = pos + step; i >= 0 && i < static_cast<long>(order.size()) && static_cast<int>(out.size()) < count; i += step) {
      const size_t u = order[static_cast<size_t>(i)];
      if (u == unit || skip(u)) continue;
      bool seen = false;
      for (size_t v : out) seen = seen || v == u;
      if (!seen) out.push_back(u);
    }
    return out;
  }

  std::vector<size_t> pre_, post_, previous_pre_;
};

}  // namespace fsdp
