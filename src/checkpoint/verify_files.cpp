// Verifying a checkpoint's files against its manifest: each file there with the size the manifest
// lists, and its CRC-32C the manifest's (verify_files, checkpoint_reader.h).
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/piece_reader.h"

#include <sys/stat.h>

#include <sstream>

namespace fsdp {
namespace reading {

void check_listed_file(const std::string& path, int64_t bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw std::runtime_error("fsdp: checkpoint file " + path + " is missing (the manifest lists it); the checkpoint "
                             "is incomplete: copy the whole folder, or load an earlier checkpoint");
  }
  if (st.st_size != bytes) {
    throw std::runtime_error("fsdp: checkpoint file " + path + " has " + std::to_string(st.st_size) +
                             " bytes, the manifest says " + std::to_string(bytes) + " (truncated or replaced)");
  }
}

}  // namespace reading

void verify_files(const std::string& folder, const nlohmann::json& manifest, int rank, int world_size,
                  const std::set<std::string>& files_read) {
  int index = 0;
  for (auto it = manifest["files"].begin(); it != manifest["files"].end(); ++it, ++index) {
    const bool crc_here = index % world_size == rank;
    if (!crc_here && !files_read.count(it.key())) continue;
    const std::string path = folder + "/" + it.key();
    reading::check_listed_file(path, (*it)["bytes"].get<int64_t>());
    if (!crc_here) continue;
    const uint32_t crc = SafetensorsFile(path).crc32c();
    const uint32_t want = (*it)["crc32c"].get<uint32_t>();
    if (crc != want) {
      std::ostringstream msg;
      msg << "fsdp: checkpoint file " << path << " is corrupt: its CRC-32C is " << crc << ", the manifest says " << want
          << " (a changed byte; restore the file from a copy or load an earlier checkpoint)";
      throw std::runtime_error(msg.str());
    }
  }
}

}  // namespace fsdp
