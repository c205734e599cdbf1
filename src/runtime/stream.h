// The stream device work is queued on. Each device has one current stream owned by the runtime;
// kernels launch on it and CUDA graphs capture it. On the CPU everything is synchronous and the
// handle is null.
#pragma once

#include "runtime/device.h"

namespace metrale {

// The current stream of `device` as an opaque handle (cudaStream_t in CUDA builds), null for the CPU.
void* current_stream(Device device);
// Waits until all work queued on `device` has finished (no-op on the CPU).
void synchronize(Device device);

}  // namespace metrale
