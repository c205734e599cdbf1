// The per-device cuBLASLt handle and workspace that linear.cu owns, shared with the other cuBLASLt
// users (linear_fp8.cu's FP8 GEMM). Everything here is guarded by cublaslt_mutex(): take it before
// cublaslt_context_locked() and hold it while enqueueing a matmul on the workspace.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
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

// The descriptors of one cached matmul plan (host objects), destroyed with it; plans derive from
// this and fill the handles in their build().
class LtPlanDescriptors {
 public:
  LtPlanDescriptors() = default;
  LtPlanDescriptors(const LtPlanDescriptors&) = delete;
  LtPlanDescriptors& operator=(const LtPlanDescriptors&) = delete;
  ~LtPlanDescriptors() {
    if (preference_ != nullptr) cublasLtMatmulPreferenceDestroy(preference_);
    if (c_ != nullptr) cublasLtMatrixLayoutDestroy(c_);
    if (b_ != nullptr) cublasLtMatrixLayoutDestroy(b_);
    if (a_ != nullptr) cublasLtMatrixLayoutDestroy(a_);
    if (op_ != nullptr) cublasLtMatmulDescDestroy(op_);
  }

 protected:
  // Takes `shared` (another M's algorithm) when cublasLtMatmulAlgoCheck accepts it for these exact
  // descriptors within `max_workspace` bytes; false (nothing changed) otherwise.
  bool take_checked(cublasLtHandle_t handle, const cublasLtMatmulAlgo_t& shared, size_t max_workspace) {
    cublasLtMatmulHeuristicResult_t checked{};
    if (cublasLtMatmulAlgoCheck(handle, op_, a_, b_, c_, c_, &shared, &checked) != CUBLAS_STATUS_SUCCESS ||
        checked.state != CUBLAS_STATUS_SUCCESS || checked.workspaceSize > max_workspace)
      return false;
    algo_ = shared;
    workspace_bytes_ = checked.workspaceSize;
    return true;
  }

  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr;
  cublasLtMatmulPreference_t preference_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  size_t workspace_bytes_ = 0;
};

// The M bucket whose algorithm a problem of M rows takes: the next power of two up to 64K rows,
// then the next multiple of 16K. Mixed steps (prefill chunks, decode and draft rows) give a new M
// almost every step; a heuristic query costs tens to hundreds of microseconds, a check of a known
// algorithm against the exact layouts (cublasLtMatmulAlgoCheck) a few.
inline int64_t m_bucket(int64_t m) {
  constexpr int64_t kPowerLimit = int64_t{1} << 16, kStep = int64_t{1} << 14;
  if (m > kPowerLimit) return (m + kStep - 1) / kStep * kStep;
  int64_t bucket = 1;
  while (bucket < m) bucket <<= 1;
  return bucket;
}

// FNV-1a over 64-bit words: the plan caches' key hash.
class PlanKeyHasher {
 public:
  PlanKeyHasher& mix(uint64_t value) {
    hash_ = (hash_ ^ value) * 1099511628211ull;
    return *this;
  }
  size_t value() const { return static_cast<size_t>(hash_); }

 private:
  uint64_t hash_ = 1469598103934665603ull;
};

}  // namespace metrale::kernels::cuda
