#include "comm/replica_order.h"

#include <algorithm>
#include <utility>

namespace fsdp {

ReplicaAllReduceOrder::Ticket ReplicaAllReduceOrder::enqueue(std::function<bool()> ready, std::function<void()> issue) {
  const Ticket t = next_ticket_++;
  queue_.push_back(Entry{t, std::move(ready), std::move(issue)});
  return t;
}

void ReplicaAllReduceOrder::issue_front() {
  // Popped first: `issue` may wait, and what it calls may look at the queue again.
  Entry e = std::move(queue_.front());
  queue_.pop_front();
  next_to_issue_ = queue_.empty() ? next_ticket_ : queue_.front().ticket;
  e.issue();
}

void ReplicaAllReduceOrder::advance() {
  while (!queue_.empty() && queue_.front().ready()) issue_front();
}

void ReplicaAllReduceOrder::issue_through(Ticket ticket) {
  while (!queue_.empty() && queue_.front().ticket <= ticket) issue_front();
}

void ReplicaAllReduceOrder::drop(Ticket ticket) {
  queue_.erase(std::remove_if(queue_.begin(), queue_.end(), [&](const Entry& e) { return e.ticket == ticket; }),
               queue_.end());
  next_to_issue_ = queue_.empty() ? next_ticket_ : queue_.front().ticket;
}

}  // namespace fsdp
