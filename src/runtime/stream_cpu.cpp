// Builds without CUDA: there is no stream and nothing to wait for.
#include "runtime/device_hooks.h"
#include "runtime/stream.h"

namespace metrale {

DeviceHooks* cuda_hooks() { return nullptr; }
void* current_stream(Device /*device*/) { return nullptr; }
void synchronize(Device /*device*/) {}
void set_current_device(Device /*device*/) {}

}  // namespace metrale
