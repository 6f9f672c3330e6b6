// Whether the calling thread is inside a tensor-parallel layer (fsdp's own or a user's
// TensorParallelLayerScope): the engine lets operators on split parameters pass there and refuses
// them elsewhere in forward (fsdp/tensor_parallel.h).
#pragma once

namespace fsdp::detail {
bool in_tensor_parallel_layer();
}  // namespace fsdp::detail
