// The few file-system operations checkpoints need, on POSIX calls. Not std::filesystem: libtorch.so
// exports its own copies of std::filesystem's symbols, and a call can bind to them and crash
// (seen with std::filesystem::remove_all on libtorch 2.11).
#pragma once

#include <string>
#include <vector>

namespace fsdp {

bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
// mkdir -p; throws naming the path.
void make_directories(const std::string& path);
// rm -rf; a missing path is not an error.
void remove_tree(const std::string& path);
// rename(2): atomic within one file system; throws naming both paths.
void rename_path(const std::string& from, const std::string& to);
// The names in a folder (no "." or ".."); empty if it does not exist.
std::vector<std::string> list_directory(const std::string& path);

}  // namespace fsdp
