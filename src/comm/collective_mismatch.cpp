#include "comm/collective_mismatch.h"

#include "comm/collective_log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>

namespace fsdp::detail {
namespace {

std::atomic<int> g_rank{-1};
std::terminate_handler g_previous = nullptr;

bool is_collective_mismatch(const std::string& what) {
  return what.find("doesn't match expected size") != std::string::npos ||
         what.find("collective mismatch") != std::string::npos;
}

[[noreturn]] void on_terminate() {
  // libstdc++ marks an exception that escaped a thread as caught before calling terminate, so it
  // can be looked at here. Nothing below may throw.
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      if (is_collective_mismatch(ex.what())) {
        std::fprintf(stderr,
                     "fsdp: rank %d: the ranks issued different collectives: Gloo received a message of another "
                     "size than this rank's collective expected (%s). %s When the collectives' sizes agree, fsdp "
                     "names the first collective where the ranks differ.\n",
                     g_rank.load(), ex.what(), kSameCollectivesOnEveryRank);
        std::fflush(stderr);
        // An exit code, not SIGABRT: a launcher then blames this rank, where a rank killed by
        // SIGABRT may as well be the victim of a peer's closed connection.
        std::_Exit(kCollectiveMismatchExitCode);
      }
    } catch (...) {
    }
  }
  if (g_previous != nullptr) g_previous();
  std::abort();
}

}  // namespace

void explain_collective_mismatch_on_terminate(int rank) {
  g_rank.store(rank);
  static std::once_flag once;
  std::call_once(once, [] { g_previous = std::set_terminate(on_terminate); });
}

}  // namespace fsdp::detail
