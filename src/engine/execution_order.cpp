#include "engine/execution_order.h"

#include <utility>

namespace fsdp {

void ExecutionOrder::start_iteration() {
  if (!pre_.empty()) previous_pre_ = std::move(pre_);
  pre_.clear();
  post_.clear();
}

void ExecutionOrder::forward_started(size_t unit) { pre_.push_back(unit); }

void ExecutionOrder::forward_ended(size_t unit) { post_.push_back(unit); }

}  // namespace fsdp
