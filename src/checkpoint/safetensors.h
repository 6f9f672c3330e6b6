// The safetensors file format, the tensor container of fsdp's checkpoints (docs/checkpoints.md):
// an 8-byte little-endian header length N, N bytes of JSON ({"name": {"dtype", "shape",
// "data_offsets": [begin, end)}, ..., "__metadata__": {str: str}}), then raw little-endian data.
// Small and open: Python reads it with `safetensors.torch.load_file`, torch.distributed.checkpoint's
// Hugging Face reader with the sharding in "__metadata__".
//
// The writer streams: the header is fixed from the entries' shapes before any data is written, so
// a full checkpoint can be written one unit at a time. The reader checks the header against the
// file (offsets in order, inside the file, sizes matching shapes) and reads element ranges with
// pread, so a rank reads only the pieces it needs.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace fsdp {

// CRC-32C (Castagnoli: iSCSI, ext4; Python's `crc32c` and `google-crc32c` packages), continued
// from `crc` (0 to start).
uint32_t crc32c_update(uint32_t crc, const void* data, size_t bytes);

// "F32", "BF16", ... for the dtypes safetensors names; throws for others.
std::string safetensors_dtype(c10::ScalarType dtype);
c10::ScalarType dtype_from_safetensors(const std::string& name, const std::string& file);

struct SafetensorsEntry {
  std::string name;
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // byte offsets in the data section
  int64_t numel() const;
};

class SafetensorsWriter {
 public:
  // Creates `path` and writes the header for `entries` (their offsets are assigned here, in order).
  SafetensorsWriter(std::string path, std::vector<SafetensorsEntry> entries,
                    std::map<std::string, std::string> metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The next entry's data, in order (`data` is contiguous with that entry's dtype and numel; its
  // shape may differ, e.g. a 1-D slice of a parameter).
  void write_next(const at::Tensor& data);
  // Every entry written: flush, fsync, close. Returns the CRC-32C of the whole file.
  uint32_t finish();
  int64_t bytes_written() const { return offset_; }
  const std::string& path() const { return path_; }

 private:
  void write_raw(const void* data, size_t bytes);

  std::string path_;
  int fd_ = -1;
  std::vector<SafetensorsEntry> entries_;
  size_t next_ = 0;
  int64_t offset_ = 0;
  uint32_t crc_ = 0;
};

class SafetensorsFile {
 public:
  // Opens and validates `path`; every error names the file and what is wrong with it.
  explicit SafetensorsFile(std::string path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const SafetensorsEntry* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Elements [first, first + out.numel()) of `entry` (flattened) into `out` (contiguous, the
  // entry's dtype).
  void read(const SafetensorsEntry& entry, int64_t first, at::Tensor& out) const;
  // The CRC-32C of the whole file, reading it through once.
  uint32_t crc32c() const;
  int64_t file_bytes() const { return file_bytes_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t data_start_ = 0, file_bytes_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

// fsync a file or folder by path (a rename is durable only once its folder is synced).
void fsync_path(const std::string& path);

}  // namespace fsdp
