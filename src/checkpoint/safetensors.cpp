#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace fsdp {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian; so is this writer");

namespace {

// CRC-32C (Castagnoli): the SSE4.2 instruction where the CPU has it (7.8 GB/s here, against
// 1.9 GB/s for the slicing-by-8 tables that remain the fallback), so that checksums cost little
// next to writing and reading the data.
struct CrcTables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  CrcTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
  }
};

uint32_t crc32c_tables(uint32_t crc, const uint8_t* p, size_t bytes) {
  static const CrcTables tables;
  const auto& t = tables.t;
  while (bytes >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^ t[3][hi & 0xFF] ^
          t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    bytes -= 8;
  }
  while (bytes--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const uint8_t* p, size_t bytes) {
  uint64_t c = crc;
  while (bytes >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    bytes -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (bytes--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("fsdp: checkpoint file " + path + ": " + what);
}

std::string errno_text() { return std::strerror(errno); }

const std::map<std::string, c10::ScalarType>& dtype_names() {
  static const std::map<std::string, c10::ScalarType> names = {
      {"F64", c10::kDouble}, {"F32", c10::kFloat}, {"F16", c10::kHalf},  {"BF16", c10::kBFloat16},
      {"I64", c10::kLong},   {"I32", c10::kInt},   {"I16", c10::kShort}, {"I8", c10::kChar},
      {"U8", c10::kByte},    {"BOOL", c10::kBool}};
  return names;
}

}  // namespace

uint32_t crc32c_update(uint32_t crc, const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  if (hardware) return ~crc32c_sse42(~crc, p, bytes);
#endif
  return ~crc32c_tables(~crc, p, bytes);
}

std::string safetensors_dtype(c10::ScalarType dtype) {
  for (const auto& [name, d] : dtype_names()) {
    if (d == dtype) return name;
  }
  throw std::invalid_argument(std::string("fsdp: checkpoints cannot store dtype ") + c10::toString(dtype));
}

c10::ScalarType dtype_from_safetensors(const std::string& name, const std::string& file) {
  auto it = dtype_names().find(name);
  if (it == dtype_names().end()) fail(file, "dtype \"" + name + "\" is not one fsdp reads");
  return it->second;
}

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorsEntry> entries,
                                     std::map<std::string, std::string> metadata)
    : path_(std::move(path)), entries_(std::move(entries)) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (auto& e : entries_) {
    e.begin = offset;
    e.end = offset + e.numel() * static_cast<int64_t>(c10::elementSize(e.dtype));
    offset = e.end;
    header[e.name] = {{"dtype", safetensors_dtype(e.dtype)}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  std::string text = header.dump();
  // The data section starts 8-byte aligned (what the format recommends), padded with spaces.
  text.append((8 - text.size() % 8) % 8, ' ');
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(path_, "cannot create it: " + errno_text());
  const uint64_t n = text.size();
  write_raw(&n, 8);
  write_raw(text.data(), text.size());
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void SafetensorsWriter::write_raw(const void* data, size_t bytes) {
  crc_ = crc32c_update(crc_, data, bytes);
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path_, "write failed: " + errno_text());
    p += n;
    bytes -= static_cast<size_t>(n);
    offset_ += n;
  }
}

void SafetensorsWriter::write_next(const at::Tensor& data) {
  if (next_ >= entries_.size()) fail(path_, "more tensors written than its header names");
  const SafetensorsEntry& e = entries_[next_++];
  const at::Tensor t = data.device().is_cpu() ? data.contiguous() : data.to(c10::kCPU).contiguous();
  TORCH_CHECK(t.scalar_type() == e.dtype && t.numel() == e.numel(), "fsdp: checkpoint entry ", e.name, " expects ",
              e.numel(), " elements of ", c10::toString(e.dtype), ", got ", t.numel(), " of ",
              c10::toString(t.scalar_type()));
  write_raw(t.data_ptr(), t.nbytes());
}

uint32_t SafetensorsWriter::finish() {
  if (next_ != entries_.size()) fail(path_, "closed with " + std::to_string(entries_.size() - next_) + " tensors unwritten");
  if (::fsync(fd_) != 0) fail(path_, "fsync failed: " + errno_text());
  if (::close(fd_) != 0) fail(path_, "close failed: " + errno_text());
  fd_ = -1;
  return crc_;
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail(path_, "cannot open it: " + errno_text());
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail(path_, "cannot stat it: " + errno_text());
  file_bytes_ = st.st_size;
  uint64_t n = 0;
  if (file_bytes_ < 8 || ::pread(fd_, &n, 8, 0) != 8) fail(path_, "truncated: shorter than the 8-byte header length");
  if (n > static_cast<uint64_t>(file_bytes_ - 8) || n > (100u << 20)) {
    fail(path_, "truncated or not safetensors: its header length " + std::to_string(n) + " does not fit in its " +
                    std::to_string(file_bytes_) + " bytes");
  }
  std::string text(n, '\0');
  if (::pread(fd_, text.data(), n, 8) != static_cast<ssize_t>(n)) fail(path_, "cannot read its header: " + errno_text());
  data_start_ = 8 + static_cast<int64_t>(n);
  if (text.empty() || text[0] != '{') fail(path_, "not safetensors: its header does not start with '{'");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    fail(path_, std::string("its header is not valid JSON (corrupt?): ") + e.what());
  }
  if (!header.is_object()) fail(path_, "its header is not a JSON object");
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) fail(path_, "its __metadata__ is not an object of strings");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) fail(path_, "its __metadata__ entry \"" + m.key() + "\" is not a string");
        metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    SafetensorsEntry e;
    e.name = it.key();
    // Checked as Python's safetensors checks it: integers only, no negative dimension, an element
    // count that fits, and (below) data spans that tile the data section exactly.
    auto integer = [&](const nlohmann::json& v, const char* what) -> int64_t {
      if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > (uint64_t{1} << 62)) || v.get<int64_t>() < 0) {
        fail(path_, "tensor \"" + e.name + "\" has " + what + " " + v.dump() + " (not a non-negative integer below 2^62)");
      }
      return v.get<int64_t>();
    };
    try {
      if (!it->is_object()) fail(path_, "tensor \"" + e.name + "\" has a header entry that is not an object");
      e.dtype = dtype_from_safetensors(it->at("dtype").get<std::string>(), path_);
      const auto& shape = it->at("shape");
      if (!shape.is_array()) fail(path_, "tensor \"" + e.name + "\" has a shape that is not a list");
      int64_t numel = 1;
      for (const auto& d : shape) {
        const int64_t n = integer(d, "a dimension");
        if (n != 0 && numel > (int64_t{1} << 62) / n) fail(path_, "tensor \"" + e.name + "\" has more than 2^62 elements");
        numel *= n;
        e.shape.push_back(n);
      }
      const auto& off = it->at("data_offsets");
      if (!off.is_array() || off.size() != 2) fail(path_, "tensor \"" + e.name + "\" has data_offsets that are not [begin, end]");
      e.begin = integer(off[0], "a data offset");
      e.end = integer(off[1], "a data offset");
    } catch (const nlohmann::json::exception& x) {
      fail(path_, "tensor \"" + e.name + "\" has a malformed header entry: " + x.what());
    }
    const int64_t esize = static_cast<int64_t>(c10::elementSize(e.dtype));
    if (e.numel() > file_bytes_ / esize) {
      fail(path_, "truncated: tensor \"" + e.name + "\" has " + std::to_string(e.numel()) + " elements, more than its " +
                      std::to_string(file_bytes_) + "-byte file holds");
    }
    const int64_t bytes = e.numel() * esize;
    if (e.end < e.begin || e.end - e.begin != bytes) {
      fail(path_, "tensor \"" + e.name + "\" spans " + std::to_string(e.end - e.begin) + " bytes, its shape needs " +
                      std::to_string(bytes));
    }
    if (data_start_ + e.end > file_bytes_) {
      fail(path_, "truncated: tensor \"" + e.name + "\" ends at byte " + std::to_string(data_start_ + e.end) +
                      " of a " + std::to_string(file_bytes_) + "-byte file");
    }
    by_name_[e.name] = entries_.size();
    entries_.push_back(std::move(e));
  }
  // The spans, in order of offset, must tile the data section: no overlap, no gap, nothing after.
  std::vector<const SafetensorsEntry*> order;
  for (const auto& e : entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  int64_t cursor = 0;
  for (const SafetensorsEntry* e : order) {
    if (e->begin != cursor) {
      fail(path_, "tensor \"" + e->name + "\" starts at data byte " + std::to_string(e->begin) + ", where " +
                      std::to_string(cursor) + " was expected (" + (e->begin < cursor ? "overlapping" : "a gap between") +
                      " tensors' data)");
    }
    cursor = e->end;
  }
  if (data_start_ + cursor != file_bytes_) {
    fail(path_, std::to_string(file_bytes_ - data_start_ - cursor) + " bytes follow the last tensor's data (the header "
                "accounts for " + std::to_string(cursor) + " of the " + std::to_string(file_bytes_ - data_start_) +
                " data bytes): appended to or not safetensors");
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

void SafetensorsFile::read(const SafetensorsEntry& entry, int64_t first, at::Tensor& out) const {
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == entry.dtype && first >= 0 &&
                  first + out.numel() <= entry.numel(),
              "fsdp: bad read of ", entry.name, " from ", path_);
  const int64_t esize = static_cast<int64_t>(c10::elementSize(entry.dtype));
  auto* p = static_cast<char*>(out.data_ptr());
  int64_t bytes = out.numel() * esize;
  int64_t at = data_start_ + entry.begin + first * esize;
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, p, static_cast<size_t>(bytes), at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(path_, "read of tensor \"" + entry.name + "\" failed: " + (n == 0 ? "unexpected end" : errno_text()));
    p += n;
    at += n;
    bytes -= n;
  }
}

uint32_t SafetensorsFile::crc32c() const {
  std::vector<char> buf(4 << 20);
  uint32_t crc = 0;
  int64_t at = 0;
  while (true) {
    const ssize_t n = ::pread(fd_, buf.data(), buf.size(), at);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path_, "read failed: " + errno_text());
    if (n == 0) break;
    crc = crc32c_update(crc, buf.data(), static_cast<size_t>(n));
    at += n;
  }
  return crc;
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("fsdp: cannot open " + path + " to sync it: " + errno_text());
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw std::runtime_error("fsdp: fsync of " + path + " failed: " + errno_text());
}

}  // namespace fsdp
