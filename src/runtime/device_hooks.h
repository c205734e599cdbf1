// The seam between the device-independent runtime and a device backend. The CPU backend is built
// in; CUDA builds compile runtime/cuda/cuda_runtime.cpp, which provides the hooks, and other builds
// compile runtime/stream_cpu.cpp, which has none.
#pragma once

#include <cstddef>
#include <span>

namespace metrale {

// One piece of a batched copy.
struct CopySegment {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

struct DeviceHooks {
  virtual ~DeviceHooks() = default;
  virtual int device_count() const = 0;
  virtual void* allocate(int device_index, size_t bytes) = 0;  // throws kOutOfMemory on failure
  virtual void release(int device_index, void* pointer) noexcept = 0;
  // Copies bytes between host and device memory; the flags say which side each pointer is on.
  virtual void copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, size_t bytes) = 0;
  virtual void memset(void* pointer, int value, size_t bytes) = 0;
  virtual void synchronize(int device_index) = 0;
  // Page-locked host memory, so that copies to and from the device can be asynchronous.
  virtual void* allocate_pinned(size_t bytes) = 0;
  virtual void release_pinned(void* pointer) noexcept = 0;
  // Copies on the device's current stream without waiting (the host side must be pinned).
  virtual void copy_async(void* dst, bool dst_on_device, const void* src, bool src_on_device, size_t bytes) = 0;
  // copy_async of every segment between device `device_index`'s memory and pinned host memory (or
  // within the device), in any direction, as one batch on `stream` (null: the device's current
  // stream): one call instead of one per segment (a host-tier block is a segment per layer and
  // cache tensor).
  virtual void copy_batch_async(int device_index, std::span<const CopySegment> segments, void* stream) = 0;
  // Streams and events of the device's own (CopyLane); a null stream is the current stream.
  virtual void* create_stream(int device_index) = 0;
  virtual void destroy_stream(void* stream) noexcept = 0;
  virtual void* create_event(int device_index) = 0;
  virtual void destroy_event(void* event) noexcept = 0;
  virtual void record_event(int device_index, void* event, void* stream) = 0;
  // Work queued on `stream` after this waits (on the device) for the event's point.
  virtual void wait_event(int device_index, void* stream, void* event) = 0;
  virtual bool event_done(void* event) = 0;
  virtual void synchronize_event(void* event) = 0;
  virtual void synchronize_stream(void* stream) = 0;
  // Free and total bytes of device memory.
  virtual void memory_info(int device_index, size_t& free_bytes, size_t& total_bytes) = 0;
};

// The CUDA hooks, or nullptr in a build without CUDA.
DeviceHooks* cuda_hooks();

}  // namespace metrale
