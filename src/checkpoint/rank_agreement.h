// What every rank of a checkpoint operation must agree on before anything changes: one error for
// all (a failure on one rank fails the operation everywhere, instead of leaving the others waiting
// in a later collective), one folder decided by rank 0, the same optimizer groups, and which
// buffers differ across ranks. Every function here is a collective over `group`.
#pragma once

#include <optional>
#include <string>

#include <c10/util/Exception.h>

#include "checkpoint/state_dict.h"

namespace fsdp {

// The first line of an exception's message, for messages that quote another library's error.
inline std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// Runs fn; returns its exception's message ("" when it returned), so that the message can be
// agreed on by every rank before anyone throws.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
    return "";
  } catch (const c10::Error& e) {
    // The message the other ranks get too: without this rank's backtrace.
    std::string msg = e.what_without_backtrace();
    return msg.empty() ? "unknown error" : msg;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    return msg.empty() ? "unknown error" : msg;
  }
}

// Every rank's error (empty: none); throws on every rank, naming the first rank that failed, when
// any did. Every rank calls it at the same point, so a failure on one rank cannot leave the others
// waiting in a later collective.
void agree(const GroupPtr& group, const std::string& mine, const std::string& what);

// Which checkpoint `path` means (itself when it holds a manifest, else the newest good one under
// it), decided by rank 0 alone and sent to every rank.
std::optional<std::string> decided_by_rank0(const GroupPtr& group, const std::string& path);

// The names of the buffers whose values differ across ranks ("" when none do), for the warning a
// save gives: a checkpoint holds rank 0's.
std::string buffers_that_differ(const GroupPtr& group, detail::ShardedRoot& root);

// Throws on every rank, naming the rank and the parameters, when the ranks' optimizers step
// different parameters or group them otherwise.
void check_same_optimizer_on_all_ranks(const GroupPtr& group, const RankState& rs);

}  // namespace fsdp
