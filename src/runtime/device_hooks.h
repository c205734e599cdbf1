// The seam between the device-independent runtime and a device backend. The CPU backend is built in;
// the CUDA backend registers its hooks from a static initializer in its own translation unit, so
// builds without CUDA simply have none.
#pragma once

#include <cstddef>

namespace metrale {

struct DeviceHooks {
  virtual ~DeviceHooks() = default;
  virtual int device_count() const = 0;
  virtual void* allocate(int device_index, size_t bytes) = 0;  // throws kOutOfMemory on failure
  virtual void release(int device_index, void* pointer) noexcept = 0;
  // Copies bytes between host and device memory; `to_device`/`from_device` say which side is which.
  virtual void copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, size_t bytes) = 0;
  virtual void memset(void* pointer, int value, size_t bytes) = 0;
  virtual void synchronize(int device_index) = 0;
};

// The registered CUDA hooks, or nullptr in a build (or process) without CUDA.
DeviceHooks* cuda_hooks();
void register_cuda_hooks(DeviceHooks* hooks);

}  // namespace metrale
