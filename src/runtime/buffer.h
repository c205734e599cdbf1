// Owned device or host memory (RAII, move-only).
#pragma once

#include <cstddef>
#include <span>

#include "runtime/device.h"
#include "runtime/device_hooks.h"

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

// Page-locked host memory (RAII) for asynchronous copies; plain host memory in CPU-only builds.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void release() noexcept;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool pinned_ = false;
};

// Copies `bytes` between any two buffers' memory, host or device.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
// Like copy_bytes, but queued on the device's stream without waiting when a device is involved;
// host memory must then be pinned and stay untouched until the stream reaches the copy.
void copy_bytes_async(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
// copy_bytes_async of every segment, each between `device`'s memory and pinned host memory (either
// direction), queued as one batch: on the CPU, in order.
void copy_segments_async(Device device, std::span<const CopySegment> segments);

// Free and total bytes on a device (for the CPU: 0 and 0, meaning "not tracked").
void device_memory_info(Device device, size_t& free_bytes, size_t& total_bytes);

}  // namespace metrale
