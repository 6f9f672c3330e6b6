#include "comm/comm_streams.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace fsdp {
namespace {
c10::Stream current_stream(const c10::Device& device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}
}  // namespace

CommStreams::CommStreams(c10::Device device) : device_(device) {
  active_ = device.is_cuda();
  if (!active_) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  // Normal priority: PyTorch gives its unshard stream high priority, but a high-priority all-gather
  // would not make a bandwidth-bound collective finish sooner, only preempt compute kernels.
  for (auto& s : streams_) s = impl->getStreamFromGlobalPool(device, /*isHighPriority=*/false);
}

CommStreams::Issue::Issue(const CommStreams& streams, CommKind kind) {
  if (!streams.active_) return;
  const c10::Stream& target = *streams.streams_[static_cast<int>(kind)];
  c10::Event ready(streams.device_.type());
  ready.record(current_stream(streams.device_));
  ready.block(target);
  guard_.emplace(target);
}

std::optional<c10::Event> CommStreams::record_current() const {
  if (!active_) return std::nullopt;
  c10::Event e(device_.type());
  e.record(current_stream(device_));
  return e;
}

}  // namespace fsdp
