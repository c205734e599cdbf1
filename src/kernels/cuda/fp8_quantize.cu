// quantize_fp8_rows on the GPU: one warp per (token, 128-wide group). Each lane holds 4 consecutive
// values, the warp reduces their amax by shuffles, and each lane writes its 4 codes; the group's
// scale goes to scales[group, token], so the warps of one block (consecutive tokens of one group)
// write adjacent scales.
#include <cuda_fp8.h>

#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/fp8_quantize.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kWarps = 8;  // tokens per block
constexpr int kValuesPerLane = 4;
static_assert(32 * kValuesPerLane == kFp8Block, "a warp covers one scale group");

// x [m, k] rows x_stride apart -> codes [m, k], scales [ceil(k/128), m] rows scale_stride apart;
// grid (ceil(m/8), groups).
template <typename XT>
__global__ void __launch_bounds__(kWarps * 32)
    quantize_fp8_rows_kernel(const XT* __restrict__ x, int64_t x_stride, int m, int k, uint8_t* __restrict__ codes,
                             float* __restrict__ scales, int64_t scale_stride) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (row >= m) return;
  const int group = blockIdx.y;
  const int first = group * static_cast<int>(kFp8Block) + lane * kValuesPerLane;
  const XT* x_row = x + static_cast<int64_t>(row) * x_stride;
  float values[kValuesPerLane];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kValuesPerLane; ++j) {
    values[j] = first + j < k ? to_f32(x_row[first + j]) : 0.0f;
    amax = fmaxf(amax, fabsf(values[j]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = amax > 0.0f ? __fdiv_rn(amax, kE4M3Max) : 1.0f;
  if (lane == 0) scales[static_cast<int64_t>(group) * scale_stride + row] = scale;
  uint8_t out[kValuesPerLane];
#pragma unroll
  for (int j = 0; j < kValuesPerLane; ++j) {
    out[j] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(values[j], scale), __NV_SATFINITE, __NV_E4M3));
  }
  uint8_t* code_row = codes + static_cast<int64_t>(row) * k;
  if ((k & 3) == 0 && first + kValuesPerLane <= k) {
    // Row starts are 4-byte aligned (k % 4 == 0, codes 4-byte aligned): one 32-bit store.
    *reinterpret_cast<uint32_t*>(code_row + first) =
        out[0] | (uint32_t{out[1]} << 8) | (uint32_t{out[2]} << 16) | (uint32_t{out[3]} << 24);
  } else {
#pragma unroll
    for (int j = 0; j < kValuesPerLane; ++j) {
      if (first + j < k) code_row[first + j] = out[j];
    }
  }
}

void expect(bool condition, const std::string& what) {
  if (!condition) raise_message(ErrorCode::kInternal, "kernel quantize_fp8_rows: " + what);
}

}  // namespace

void quantize_fp8_rows(const Tensor& x, const Tensor& codes, const Tensor& scales) {
  expect(x.ndim() == 2 && codes.ndim() == 2 && scales.ndim() == 2, "x, codes and scales must be 2-D");
  const int64_t m = x.size(0), k = x.size(1), groups = fp8_scale_blocks(k);
  expect(codes.size(0) == m && codes.size(1) == k && codes.dtype() == DType::kF8E4M3 && codes.is_contiguous(),
         "codes " + codes.describe() + " for x " + x.describe());
  expect(scales.size(0) == groups && scales.size(1) == m && scales.dtype() == DType::kF32 && scales.stride(1) == 1 &&
             (groups <= 1 || scales.stride(0) >= m),
         "scales " + scales.describe() + " for x " + x.describe());
  expect(x.stride(1) == 1 && x.stride(0) >= k, "x needs contiguous rows: " + x.describe());
  expect(x.device() == codes.device() && scales.device() == codes.device(), "tensors on different devices");
  expect(m < (int64_t{1} << 31) && k < (int64_t{1} << 31) && groups <= 65535, "size out of range");
  expect(reinterpret_cast<uintptr_t>(codes.data()) % 4 == 0, "codes must be 4-byte aligned");
  if (m == 0 || k == 0) return;
  const cudaStream_t stream = stream_of(codes);
  const dim3 grid(static_cast<unsigned>(ceil_div(m, kWarps)), static_cast<unsigned>(groups));
  auto* code_bytes = static_cast<uint8_t*>(codes.data());
  switch (x.dtype()) {
    case DType::kBF16:
      quantize_fp8_rows_kernel<__nv_bfloat16><<<grid, kWarps * 32, 0, stream>>>(
          x.data_as<const __nv_bfloat16>(), x.stride(0), static_cast<int>(m), static_cast<int>(k), code_bytes,
          scales.data_as<float>(), scales.stride(0));
      break;
    case DType::kF32:
      quantize_fp8_rows_kernel<float><<<grid, kWarps * 32, 0, stream>>>(
          x.data_as<const float>(), x.stride(0), static_cast<int>(m), static_cast<int>(k), code_bytes,
          scales.data_as<float>(), scales.stride(0));
      break;
    default:
      expect(false, "x must be bf16 or f32, got " + x.describe());
  }
  METRALE_CHECK_LAUNCH("quantize_fp8_rows_kernel");
}

}  // namespace metrale::kernels::cuda
