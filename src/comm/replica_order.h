// The order in which gradient all-reduces across replicas are issued on one replicate group, shared
// by every wrapped model (every root) of a mesh (hybrid sharding on CPU, paper §3.2.2).
//
// On CPU a unit's all-reduce across replicas can only be issued once its reduce-scatter is done,
// which a rank notices when it polls: the moment depends on timing. Within one root the runtime
// issued them in its own reductions' order; but the replicate group is the mesh's, shared by every
// root built on it (a GAN's generator and discriminator), and two roots' reductions polled by
// their own runtimes went out interleaved differently on different ranks: Gloo then paired
// collectives of different sizes ("Received data size doesn't match expected size"). So the order
// is the group's: reductions take a ticket when their reduce-scatter is issued (program order,
// the same on every rank, whichever root), and all-reduces go out strictly in ticket order.
//
//   enqueue      a reduce-scatter was issued; `ready` polls it, `issue` waits for it and issues
//                the all-reduce
//   advance      without blocking: issue from the front while the front's reduce-scatter is done
//   issue_through  block until every all-reduce up to this ticket is issued (the tickets before it
//                may belong to another root: their reduce-scatters are waited for here)
#pragma once

#include <cstdint>
#include <deque>
#include <functional>

namespace fsdp {

class ReplicaAllReduceOrder {
 public:
  using Ticket = uint64_t;
  Ticket enqueue(std::function<bool()> ready, std::function<void()> issue);
  void advance();
  void issue_through(Ticket ticket);
  bool issued(Ticket ticket) const { return ticket < next_to_issue_; }
  // A reduction that goes away with its ticket unissued (its model was destroyed mid-backward):
  // its entry is dropped, so the next ones are not held behind it. Every rank does the same.
  void drop(Ticket ticket);

 private:
  struct Entry {
    Ticket ticket;
    std::function<bool()> ready;
    std::function<void()> issue;
  };
  void issue_front();
  std::deque<Entry> queue_;
  Ticket next_ticket_ = 0;
  Ticket next_to_issue_ = 0;  // every ticket below it is issued or dropped
};

}  // namespace fsdp
