// Owned device or host memory (RAII, move-only).
#pragma once

#include <cstddef>

#include "runtime/device.h"

namespace metrale {

class Buffer {
 public:
  static constexpr size_t kAlignment = 64;

  Buffer() = default;
  // Allocates `bytes` (rounded up to kAlignment) on `device`. Contents are uninitialised.
  Buffer(Device device, size_t bytes);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  Device device() const { return device_; }
  bool empty() const { return data_ == nullptr; }
  void zero();

 private:
  void release() noexcept;

  Device device_;
  void* data_ = nullptr;
  size_t size_ = 0;
};

// Copies `bytes` between any two buffers' memory, host or device.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);

}  // namespace metrale
