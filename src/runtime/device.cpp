#include "runtime/device.h"

#include "core/error.h"
#include "core/strings.h"
#include "runtime/device_hooks.h"

namespace metrale {

std::string Device::to_string() const {
  return kind == DeviceKind::kCpu ? "cpu" : "cuda:" + std::to_string(index);
}

Device parse_device(const std::string& text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda" || text == "gpu") return Device::cuda(0);
  if (starts_with(text, "cuda:")) {
    const auto ids = parse_int_list(text.substr(5), "device index");
    if (ids.size() == 1 && ids[0] >= 0) return Device::cuda(static_cast<int>(ids[0]));
  }
  raise(ErrorCode::kInvalidArgument, "unknown device '{}' (expected cpu, cuda or cuda:N)", text);
}

bool cuda_available() {
  const DeviceHooks* hooks = cuda_hooks();
  return hooks != nullptr && hooks->device_count() > 0;
}

Device default_device() { return cuda_available() ? Device::cuda(0) : Device::cpu(); }

}  // namespace metrale
