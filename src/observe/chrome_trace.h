// Chrome trace output of a timeline (include/fsdp/trace.h).
#pragma once

#include <string>
#include <vector>

#include "fsdp/trace.h"

namespace fsdp {

// Writes `spans` as Chrome trace JSON (one process per rank, one track for compute and one per
// collective worker). Unit names label the spans. Written to a temporary file, then renamed.
void write_chrome_trace(const std::string& path, const std::vector<Span>& spans,
                        const std::vector<std::string>& unit_names, int rank);

}  // namespace fsdp
