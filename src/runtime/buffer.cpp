#include "runtime/buffer.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "core/error.h"
#include "core/strings.h"
#include "runtime/device_hooks.h"

namespace metrale {
namespace {

DeviceHooks& require_cuda() {
  DeviceHooks* hooks = cuda_hooks();
  if (hooks == nullptr) raise(ErrorCode::kUnsupported, "this build of metrale has no CUDA support");
  if (hooks->device_count() == 0) raise(ErrorCode::kUnsupported, "no CUDA device is available on this machine");
  return *hooks;
}

}  // namespace

Buffer::Buffer(Device device, size_t bytes) : device_(device) {
  size_ = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (size_ == 0) return;
  if (device.is_cpu()) {
    data_ = std::aligned_alloc(kAlignment, size_);
    if (data_ == nullptr) raise(ErrorCode::kOutOfMemory, "cannot allocate {} of host memory", format_bytes(size_));
  } else {
    data_ = require_cuda().allocate(device.index, size_);
  }
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& other) noexcept
    : device_(other.device_), data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    device_ = other.device_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void Buffer::zero() {
  if (data_ == nullptr) return;
  if (device_.is_cpu()) {
    std::memset(data_, 0, size_);
  } else {
    require_cuda().memset(data_, 0, size_);
  }
}

void Buffer::release() noexcept {
  if (data_ == nullptr) return;
  if (device_.is_cpu()) {
    std::free(data_);
  } else if (DeviceHooks* hooks = cuda_hooks()) {
    hooks->release(device_.index, data_);
  }
  data_ = nullptr;
  size_ = 0;
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memmove(dst, src, bytes);
    return;
  }
  require_cuda().copy(dst, dst_device.is_cuda(), src, src_device.is_cuda(), bytes);
}

}  // namespace metrale

namespace metrale {

PinnedBuffer::PinnedBuffer(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  if (DeviceHooks* hooks = cuda_hooks(); hooks != nullptr && hooks->device_count() > 0) {
    data_ = hooks->allocate_pinned(bytes);
    pinned_ = true;
  } else {
    data_ = std::aligned_alloc(Buffer::kAlignment, (bytes + Buffer::kAlignment - 1) / Buffer::kAlignment * Buffer::kAlignment);
    if (data_ == nullptr) raise(ErrorCode::kOutOfMemory, "cannot allocate {} of host memory", format_bytes(bytes));
  }
}

PinnedBuffer::~PinnedBuffer() { release(); }

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)), pinned_(other.pinned_) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    pinned_ = other.pinned_;
  }
  return *this;
}

void PinnedBuffer::release() noexcept {
  if (data_ == nullptr) return;
  if (pinned_) {
    // pinned_ implies the CUDA hooks that pinned the buffer exist.
    if (DeviceHooks* hooks = cuda_hooks()) hooks->release_pinned(data_);
  } else {
    std::free(data_);
  }
  data_ = nullptr;
  size_ = 0;
}

void copy_bytes_async(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memmove(dst, src, bytes);
    return;
  }
  require_cuda().copy_async(dst, dst_device.is_cuda(), src, src_device.is_cuda(), bytes);
}

void copy_segments_async(Device device, std::span<const CopySegment> segments) {
  if (segments.empty()) return;
  if (device.is_cpu()) {
    for (const CopySegment& segment : segments)
      if (segment.bytes > 0) std::memmove(segment.dst, segment.src, segment.bytes);
    return;
  }
  require_cuda().copy_batch_async(device.index, segments, nullptr);
}

void device_memory_info(Device device, size_t& free_bytes, size_t& total_bytes) {
  free_bytes = total_bytes = 0;
  if (device.is_cuda()) require_cuda().memory_info(device.index, free_bytes, total_bytes);
}

}  // namespace metrale
