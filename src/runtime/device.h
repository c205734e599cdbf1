// Where memory lives and kernels run. The CPU is always present; CUDA devices exist when metrale is
// built with CUDA and a GPU is visible.
#pragma once

#include <string>

namespace metrale {

enum class DeviceKind { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;

  static Device cpu() { return {DeviceKind::kCpu, 0}; }
  static Device cuda(int index = 0) { return {DeviceKind::kCuda, index}; }
  bool is_cpu() const { return kind == DeviceKind::kCpu; }
  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  std::string to_string() const;
  bool operator==(const Device&) const = default;
};

// Parses "cpu", "cuda", "cuda:1"; throws kInvalidArgument otherwise.
Device parse_device(const std::string& text);

// True when this build has CUDA support and at least one GPU is visible.
bool cuda_available();

// The device to use when the user names none: the first GPU when available, else the CPU.
Device default_device();

}  // namespace metrale
