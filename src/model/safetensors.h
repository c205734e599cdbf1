// safetensors files: an 8-byte little-endian header length, a JSON header mapping tensor names to
// {dtype, shape, data_offsets}, then the raw data. Files are mapped, never read into RAM whole.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/mapped_file.h"
#include "runtime/tensor.h"

namespace metrale {

struct SafetensorsEntry {
  std::string dtype_name;           // as written in the header ("BF16", "F32", ...)
  std::optional<DType> dtype;       // empty when the dtype is not supported by metrale
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;      // byte offsets into the data section
};

// A validated header: where the data section starts in the file and the tensors in it.
struct SafetensorsHeader {
  uint64_t data_start = 0;  // 8 + the header length
  std::map<std::string, SafetensorsEntry> entries;
};

// Validates the bytes of a whole safetensors file as the reference loader (the `safetensors` Rust
// crate) does: the header length, JSON (nesting at most 8 deep), each entry's dtype, shape (at most
// Shape::kMaxDims dimensions) and byte size; then the offsets, which sorted must tile the data
// section exactly: the first tensor starts at 0, each starts where the one before ends (no overlap,
// no gap), the last ends at the end of the file. Alignment is not required, as the format does not
// require it (an unpadded header, a 3-element BF16 before an F32): a view may then be unaligned,
// and Weights copies such a tensor to aligned memory. Throws kBadFormat naming `where` and the
// tensor at fault.
SafetensorsHeader parse_safetensors_header(std::span<const std::byte> file, std::string_view where);

class SafetensorsFile {
 public:
  // Maps the file and validates it (parse_safetensors_header).
  explicit SafetensorsFile(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return file_.path(); }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // A CPU view of the tensor's bytes in the mapping. Throws kUnsupported for an unsupported dtype.
  Tensor view(const std::string& name) const;
  // The mapped bytes after the header: every tensor's data.
  std::span<const std::byte> data_bytes() const { return file_.bytes().subspan(data_start_); }

 private:
  MappedFile file_;
  uint64_t data_start_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
};

// Writes a safetensors file (tests and tools). Tensors must be contiguous CPU tensors.
void write_safetensors(const std::filesystem::path& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

std::string safetensors_dtype_name(DType dtype);

}  // namespace metrale
