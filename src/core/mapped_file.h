// A read-only memory mapping of a whole file (RAII). Weights are read through mappings so that a
// checkpoint is never copied in full into RAM.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>

namespace metrale {

class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const std::byte> bytes() const { return {static_cast<const std::byte*>(data_), size_}; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  void release() noexcept;

  std::filesystem::path path_;
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace metrale
