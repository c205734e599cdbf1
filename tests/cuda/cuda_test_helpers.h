// Copies between host and device for the CUDA tests (header-only: each floor's test binary
// compiles only its own folder's helpers).
#pragma once

#include <vector>

#include "kernels/kernel_helpers.h"
#include "runtime/tensor.h"

namespace metrale::testing {

inline OwnedTensor to_device(const Tensor& host) {
  OwnedTensor device(host.dtype(), host.shape(), Device::cuda());
  copy_tensor(*device, host);
  return device;
}

inline OwnedTensor to_host(const Tensor& device) {
  OwnedTensor host(device.dtype(), device.shape());
  copy_tensor(*host, device);
  return host;
}

// An f32 host copy of a host tensor of any float dtype.
inline OwnedTensor f32_copy(const Tensor& host) {
  OwnedTensor copy(DType::kF32, host.shape());
  const std::vector<double> values = to_doubles(host);
  std::vector<float> floats(values.begin(), values.end());
  fill(*copy, floats);
  return copy;
}

}  // namespace metrale::testing
