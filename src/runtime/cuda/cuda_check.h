// Checked CUDA runtime calls. A failing call throws metrale::Error naming the call, the file and
// the line; an error that poisons the CUDA context (illegal address, launch failure, ...) cannot
// be recovered from, so it ends the process with that message instead.
#pragma once

#include <cuda_runtime_api.h>

namespace metrale {

[[noreturn]] void cuda_fail(cudaError_t error, const char* what, const char* file, int line);

// Checks the launch that just happened on this thread (cudaGetLastError); `kernel` names it.
void check_launch(const char* kernel, const char* file, int line);

}  // namespace metrale

#define METRALE_CUDA_CHECK(call)                                                  \
  do {                                                                            \
    const cudaError_t metrale_cuda_error_ = (call);                               \
    if (metrale_cuda_error_ != cudaSuccess) [[unlikely]]                          \
      ::metrale::cuda_fail(metrale_cuda_error_, #call, __FILE__, __LINE__);       \
  } while (0)

#define METRALE_CHECK_LAUNCH(kernel) ::metrale::check_launch(kernel, __FILE__, __LINE__)
