// linear_fp8 on the GPU: a GEMV for decode. One warp per weight row streams the row's e4m3 codes
// once (16 bytes a lane), dequantises them in registers with the row's 128x128 block scale and
// dots them with up to kRowsPerPass input rows in fp32; more input rows take further passes (each
// rereads the weights: correct for prefill, but slow there until an FP8 GEMM exists).
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/linear_fp8.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kWarps = 8;        // weight rows per block
constexpr int kRowsPerPass = 8;  // input rows dotted with each dequantised chunk
constexpr int kCodesPerLane = 16;

__device__ __forceinline__ float e4m3_to_f32(uint8_t code) {
  __nv_fp8_e4m3 value;
  value.__x = code;
  return static_cast<float>(value);
}

// x [m <= kRowsPerPass, k] rows x_stride apart; w [n, k] codes; scales [ceil(n/128), scale_cols].
// k_vector: the prefix of each row read 16 codes at a time (k when k % 16 == 0 and w is 16-byte aligned, else 0).
template <typename XT, typename OutT>
__global__ void __launch_bounds__(kWarps * 32)
    fp8_gemv_kernel(const XT* __restrict__ x, int64_t x_stride, int m, const uint8_t* __restrict__ w,
                    const float* __restrict__ scales, int64_t scale_cols, OutT* out, int64_t out_stride, int n, int k,
                    int k_vector, bool accumulate) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (row >= n) return;
  const uint8_t* w_row = w + static_cast<int64_t>(row) * k;
  const float* row_scales = scales + static_cast<int64_t>(row / kFp8Block) * scale_cols;
  float acc[kRowsPerPass] = {};
  // A 16-code chunk never crosses a scale block: 128 is a multiple of 16 and chunks start at multiples of 16.
  for (int k0 = lane * kCodesPerLane; k0 < k_vector; k0 += 32 * kCodesPerLane) {
    const uint4 packed = *reinterpret_cast<const uint4*>(w_row + k0);
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(&packed);
    const float scale = row_scales[k0 / kFp8Block];
    float wv[kCodesPerLane];
#pragma unroll
    for (int j = 0; j < kCodesPerLane; ++j) wv[j] = e4m3_to_f32(codes[j]) * scale;
#pragma unroll
    for (int r = 0; r < kRowsPerPass; ++r) {
      if (r < m) {
        const XT* xr = x + r * x_stride + k0;
#pragma unroll
        for (int j = 0; j < kCodesPerLane; ++j) acc[r] = fmaf(to_f32(xr[j]), wv[j], acc[r]);
      }
    }
  }
  for (int c = k_vector + lane; c < k; c += 32) {
    const float wv = e4m3_to_f32(w_row[c]) * row_scales[c / kFp8Block];
#pragma unroll
    for (int r = 0; r < kRowsPerPass; ++r)
      if (r < m) acc[r] = fmaf(to_f32(x[r * x_stride + c]), wv, acc[r]);
  }
#pragma unroll
  for (int r = 0; r < kRowsPerPass; ++r) {
    if (r >= m) break;
    const float sum = warp_sum(acc[r]);
    if (lane == 0) {
      OutT* at = out + r * out_stride + row;
      *at = from_f32<OutT>(accumulate ? sum + to_f32(*at) : sum);
    }
  }
}

void expect(bool condition, const std::string& what) {
  if (!condition) raise_message(ErrorCode::kInternal, "kernel linear_fp8: " + what);
}

}  // namespace

void linear_fp8(const Tensor& x, const Tensor& weight, const Tensor& scale_inv, const Tensor& out, bool accumulate) {
  expect(x.ndim() == 2 && weight.ndim() == 2 && out.ndim() == 2 && scale_inv.ndim() == 2,
         "x, weight, scales and out must be 2-D");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  expect(weight.size(1) == k && out.size(0) == m && out.size(1) == n,
         "shapes x " + x.describe() + " weight " + weight.describe() + " out " + out.describe());
  expect(weight.dtype() == DType::kF8E4M3 && scale_inv.dtype() == DType::kF32 &&
             scale_inv.size(0) == fp8_scale_blocks(n) && scale_inv.size(1) == fp8_scale_blocks(k) &&
             scale_inv.is_contiguous(),
         "weight " + weight.describe() + " with scales " + scale_inv.describe());
  expect(x.device() == out.device() && weight.device() == out.device() && scale_inv.device() == out.device(),
         "tensors on different devices");
  expect(x.stride(1) == 1 && weight.stride(1) == 1 && weight.stride(0) == k && out.stride(1) == 1,
         "needs contiguous rows");
  expect(m < (int64_t{1} << 31) && n < (int64_t{1} << 31) && k < (int64_t{1} << 31), "size over 2^31");
  if (m == 0 || n == 0) return;
  const cudaStream_t stream = stream_of(out);
  const bool aligned = reinterpret_cast<uintptr_t>(weight.data()) % 16 == 0;
  const int k_vector = (k % kCodesPerLane == 0 && aligned) ? static_cast<int>(k) : 0;
  const int blocks = ceil_div(n, kWarps);
  METRALE_DISPATCH_FLOAT(x.dtype(), "linear_fp8 x", [&] {
    using XT = scalar_t;
    METRALE_DISPATCH_FLOAT(out.dtype(), "linear_fp8 out", [&] {
      for (int64_t r0 = 0; r0 < m; r0 += kRowsPerPass) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsPerPass, m - r0));
        fp8_gemv_kernel<XT, scalar_t><<<blocks, kWarps * 32, 0, stream>>>(
            x.data_as<const XT>() + r0 * x.stride(0), x.stride(0), rows, static_cast<const uint8_t*>(weight.data()),
            scale_inv.data_as<const float>(), scale_inv.size(1), out.data_as<scalar_t>() + r0 * out.stride(0),
            out.stride(0), static_cast<int>(n), static_cast<int>(k), k_vector, accumulate);
      }
    });
  });
  METRALE_CHECK_LAUNCH("fp8_gemv_kernel");
}

}  // namespace metrale::kernels::cuda
