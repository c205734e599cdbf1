// The per-device cuBLASLt handle and workspace that linear.cu owns, shared with the other cuBLASLt
// users (linear_fp8.cu's FP8 GEMM). Everything here is guarded by cublaslt_mutex(): take it before
// cublaslt_context_locked() and hold it while enqueueing a matmul on the workspace.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>

namespace metrale::kernels::cuda {

struct CublasLtContext {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;  // workspace_bytes of device memory, ordered on the device's stream
  size_t workspace_bytes = 0;
};

std::mutex& cublaslt_mutex();
// The device's handle and workspace, created on first use (see linear_prepare); raises instead of
// allocating when `stream` (may be null) is capturing a CUDA graph. Caller holds cublaslt_mutex().
CublasLtContext cublaslt_context_locked(int device_index, cudaStream_t stream);

}  // namespace metrale::kernels::cuda
