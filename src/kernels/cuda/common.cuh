// Device helpers shared by the CUDA kernels: the launch stream, dtype loads/stores, warp and block
// reductions. Kernels compute in fp32 and store activations as bf16 (or f32 where asked).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "core/error_base.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"

namespace metrale::kernels::cuda {

inline cudaStream_t stream_of(const Tensor& t) { return static_cast<cudaStream_t>(current_stream(t.device())); }

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Raises `kernel`'s dynamic shared-memory limit to `bytes` on the current device, once per
// (kernel, device, bytes). cudaFuncSetAttribute is not a stream operation, so this is also safe
// during graph capture.
inline void allow_dynamic_smem(const void* kernel, int bytes) {
  static std::mutex mutex;
  static std::set<std::pair<std::pair<const void*, int>, int>> done;
  int device = 0;
  METRALE_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lock(mutex);
  if (!done.insert({{kernel, device}, bytes}).second) return;
  METRALE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// Scalar loads and stores of the storage dtypes as fp32.
template <typename T>
__device__ __forceinline__ float to_f32(T value);
template <>
__device__ __forceinline__ float to_f32<float>(float value) { return value; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 value) { return __bfloat162float(value); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half value) { return __half2float(value); }

template <typename T>
__device__ __forceinline__ T from_f32(float value);
template <>
__device__ __forceinline__ float from_f32<float>(float value) { return value; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float value) { return __float2bfloat16_rn(value); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float value) { return __float2half_rn(value); }

// The sequence that owns batch row `row` of a ragged batch: the largest s in [0, num_seqs) with
// cu_q[s] <= row (a binary search over cu_q [S + 1] in device memory).
__device__ __forceinline__ int sequence_of(const int32_t* cu_q, int num_seqs, int64_t row) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu_q[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// Sum over a block of up to 1024 threads; every thread gets the result. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  value = warp_sum(value);
  __syncthreads();
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  value = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(value);
}

// N elements of T as one aligned vector, for 8- and 16-byte loads and stores.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// The float dtype of a weight vector (norm weights, conv taps), for kernels that accept any of them.
enum class WeightType : int { kF32, kBF16, kF16 };

// Host: the WeightType of `weight`; kUnsupported (naming `op`) for other dtypes.
inline WeightType weight_type_of(const Tensor& weight, const char* op) {
  switch (weight.dtype()) {
    case DType::kF32: return WeightType::kF32;
    case DType::kBF16: return WeightType::kBF16;
    case DType::kF16: return WeightType::kF16;
    default:
      raise_message(ErrorCode::kUnsupported, std::string(op) + ": weight dtype " +
                                                 std::string(dtype_name(weight.dtype())) + " is not supported on CUDA");
  }
}

// Element i of a weight vector of type `type`, as fp32.
__device__ __forceinline__ float load_weight(const void* weight, WeightType type, int64_t i) {
  switch (type) {
    case WeightType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(weight)[i]);
    case WeightType::kF16: return __half2float(static_cast<const __half*>(weight)[i]);
    default: return static_cast<const float*>(weight)[i];
  }
}

}  // namespace metrale::kernels::cuda

// Dispatches on a floating storage dtype: runs `body` with `scalar_t` bound to the C++ type.
#define METRALE_DISPATCH_FLOAT(dtype, what, ...)                                                   \
  [&] {                                                                                            \
    switch (dtype) {                                                                               \
      case ::metrale::DType::kF32: { using scalar_t = float; return __VA_ARGS__(); }               \
      case ::metrale::DType::kBF16: { using scalar_t = __nv_bfloat16; return __VA_ARGS__(); }      \
      case ::metrale::DType::kF16: { using scalar_t = __half; return __VA_ARGS__(); }              \
      default:                                                                                     \
        ::metrale::raise_message(::metrale::ErrorCode::kUnsupported, std::string(what) + ": dtype " + \
                                 std::string(::metrale::dtype_name(dtype)) + " is not supported on CUDA"); \
    }                                                                                              \
  }()
