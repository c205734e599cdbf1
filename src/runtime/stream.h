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
// Makes `device` the calling thread's current CUDA device (no-op on the CPU): a thread that launches
// kernels on a GPU other than 0 (a tensor-parallel rank) calls it first.
void set_current_device(Device device);

}  // namespace metrale
