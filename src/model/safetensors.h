// safetensors files: an 8-byte little-endian header length, a JSON header mapping tensor names to
// {dtype, shape, data_offsets}, then the raw data. Files are mapped, never read into RAM whole.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
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

class SafetensorsFile {
 public:
  // Maps and validates the file: header length, JSON, every entry's dtype/shape/offsets against the
  // data section. Throws kBadFormat naming the file (and tensor) on any inconsistency.
  explicit SafetensorsFile(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return file_.path(); }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // A CPU view of the tensor's bytes in the mapping. Throws kUnsupported for an unsupported dtype.
  Tensor view(const std::string& name) const;

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
