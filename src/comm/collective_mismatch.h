// Ranks that issue different collectives (control flow that differs across ranks: a unit skipped
// on some ranks, one rank running an extra forward). When the collectives happen to move the same
// number of bytes, they pair up, and the ranks stop later: a wait that takes long compares the ranks'
// logs (collective_log.h), and the end-of-backward sequence check (Runtime::check_sequence) names
// the ranks that differ. When they do not, Gloo finds it first, inside its own network thread, and ends the
// process (std::terminate on "Received data size doesn't match expected size") before any fsdp
// code can run: no exception reaches the caller. What fsdp can do there is say, on the way out,
// what it means and what to change, on the rank's stderr, whatever launched it.
#pragma once

namespace fsdp::detail {

// The exit code of a rank ended that way (EX_SOFTWARE).
inline constexpr int kCollectiveMismatchExitCode = 70;

// Installs (once per process) a terminate handler that, for Gloo's collective-mismatch errors,
// prints fsdp's explanation with this rank's number and ends the process with
// kCollectiveMismatchExitCode; other errors go to the handler it replaced.
void explain_collective_mismatch_on_terminate(int rank);

}  // namespace fsdp::detail
