#include "checkpoint/file_system.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace fsdp {

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void make_directories(const std::string& path) {
  if (path.empty() || is_directory(path)) return;
  const size_t slash = path.find_last_of('/');
  if (slash != std::string::npos && slash > 0) make_directories(path.substr(0, slash));
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
    throw std::runtime_error("fsdp: cannot create folder " + path + ": " + std::strerror(errno));
  }
}

void remove_tree(const std::string& path) {
  if (!path_exists(path)) return;
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); };
  if (::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0 && path_exists(path)) {
    throw std::runtime_error("fsdp: cannot remove " + path + ": " + std::strerror(errno));
  }
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    throw std::runtime_error("fsdp: cannot rename " + from + " to " + to + ": " + std::strerror(errno));
  }
}

std::vector<std::string> list_directory(const std::string& path) {
  std::vector<std::string> out;
  DIR* d = ::opendir(path.c_str());
  if (!d) return out;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") out.push_back(name);
  }
  ::closedir(d);
  return out;
}

}  // namespace fsdp
