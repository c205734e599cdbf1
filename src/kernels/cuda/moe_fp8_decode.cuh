// The MoE decode path over FP8 experts (kernels/moe.h: moe_decode_gate_up / moe_decode_down with
// MoeExpertWeights::is_fp8): e4m3 codes [E, 2I, H] / [E, H, I] with fp32 128x128 block scales,
// dequantised in registers. Per (slot, rows) a 4-warp block; each warp streams its weight rows of
// the slot's expert 16 codes a lane (one 16-byte load per row per step, half the bytes of the bf16
// kernels), multiplies each chunk by its block's scale and dots it with the slot's input in fp32.
// A 16-code chunk never crosses a 128-column scale block. Needs H % 16 == 0 and I % 16 == 0.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/linear_fp8.h"

namespace metrale::kernels::cuda::moe_fp8 {

constexpr int kWarps = 4;
constexpr int kGateUpRows = 2;  // intermediate rows per warp (2 gate + 2 up weight rows)
constexpr int kDownRows = 4;    // down rows per warp
constexpr int kCodes = 16;      // codes per lane per load

__device__ __forceinline__ float silu(float g) {
  return g / (1.0f + expf(-g));
}

// 16 codes (one uint4) times `scale`.
__device__ __forceinline__ void dequantise16(const uint4& packed, float scale, float (&w)[kCodes]) {
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(&packed);
#pragma unroll
  for (int j = 0; j < kCodes; ++j) {
    __nv_fp8_e4m3 value;
    value.__x = codes[j];
    w[j] = static_cast<float>(value) * scale;
  }
}

// acc[r] += dot(rows[r], x) over k in [0, k_total) for kRows weight rows of codes; scales[r] points
// at row r's block-scale row. Lane-partial sums (the caller reduces across the warp).
template <int kRows, typename XT>
__device__ __forceinline__ void warp_dot_fp8(const uint8_t* const (&rows)[kRows], const float* const (&scales)[kRows],
                                             const XT* __restrict__ x, int k_total, int lane, float (&acc)[kRows]) {
  for (int k0 = lane * kCodes; k0 < k_total; k0 += 32 * kCodes) {
    float xv[kCodes];
#pragma unroll
    for (int j = 0; j < kCodes; ++j) xv[j] = to_f32(x[k0 + j]);
    uint4 packed[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) packed[r] = *reinterpret_cast<const uint4*>(rows[r] + k0);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float w[kCodes];
      dequantise16(packed[r], scales[r][k0 / kFp8Block], w);
#pragma unroll
      for (int j = 0; j < kCodes; ++j) acc[r] = fmaf(xv[j], w[j], acc[r]);
    }
  }
}

// grid (ceil(I / (kWarps * kGateUpRows)), slots). h [slots, I] f32. gate_up_scale
// [E, 2 ceil(I/128), ceil(H/128)]: gate row i reads block row i / 128, up row i ceil(I/128) + i / 128.
template <typename XT>
__global__ void __launch_bounds__(kWarps * 32)
    gate_up_kernel(const XT* __restrict__ x, int64_t x_stride, const int32_t* __restrict__ ids, int top_k, int experts,
                   const uint8_t* __restrict__ gate_up, const float* __restrict__ gate_up_scale, int inter, int hidden,
                   float limit, float* __restrict__ h) {
  constexpr int R = kGateUpRows;
  const int slot = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i0 = (blockIdx.x * kWarps + warp) * R;
  if (i0 >= inter) return;
  // Route ids are always in range; clamping only keeps a corrupted id from reading outside the weights.
  const int e = min(max(ids[slot], 0), experts - 1);
  const int hidden_blocks = (hidden + kFp8Block - 1) / kFp8Block, inter_blocks = (inter + kFp8Block - 1) / kFp8Block;
  const uint8_t* expert = gate_up + static_cast<int64_t>(e) * 2 * inter * hidden;
  const float* expert_scales = gate_up_scale + static_cast<int64_t>(e) * 2 * inter_blocks * hidden_blocks;
  const uint8_t* rows[2 * R];
  const float* scales[2 * R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = min(i0 + r, inter - 1);
    rows[r] = expert + static_cast<int64_t>(i) * hidden;
    rows[R + r] = expert + static_cast<int64_t>(inter + i) * hidden;
    scales[r] = expert_scales + static_cast<int64_t>(i / kFp8Block) * hidden_blocks;
    scales[R + r] = expert_scales + static_cast<int64_t>(inter_blocks + i / kFp8Block) * hidden_blocks;
  }
  float acc[2 * R] = {};
  warp_dot_fp8<2 * R>(rows, scales, x + static_cast<int64_t>(slot / top_k) * x_stride, hidden, lane, acc);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float gate = warp_sum(acc[r]);
    float up = warp_sum(acc[R + r]);
    if (limit > 0.0f) {  // clamped SwiGLU
      gate = fminf(gate, limit);
      up = fminf(fmaxf(up, -limit), limit);
    }
    if (lane == r && i0 + r < inter) h[static_cast<int64_t>(slot) * inter + i0 + r] = silu(gate) * up;
  }
}

// grid (ceil(H / (kWarps * kDownRows)), slots). h [slots, I] f32; slot_out [slots, H] f32;
// down_scale [E, ceil(H/128), ceil(I/128)].
__global__ void __launch_bounds__(kWarps * 32)
    down_kernel(const float* __restrict__ h, const int32_t* __restrict__ ids, int experts,
                const uint8_t* __restrict__ down, const float* __restrict__ down_scale, int hidden, int inter,
                float* __restrict__ slot_out, int64_t out_stride) {
  constexpr int R = kDownRows;
  const int slot = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + warp) * R;
  if (row0 >= hidden) return;
  const int e = min(max(ids[slot], 0), experts - 1);
  const int hidden_blocks = (hidden + kFp8Block - 1) / kFp8Block, inter_blocks = (inter + kFp8Block - 1) / kFp8Block;
  const uint8_t* expert = down + static_cast<int64_t>(e) * hidden * inter;
  const float* expert_scales = down_scale + static_cast<int64_t>(e) * hidden_blocks * inter_blocks;
  const uint8_t* rows[R];
  const float* scales[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = min(row0 + r, hidden - 1);
    rows[r] = expert + static_cast<int64_t>(row) * inter;
    scales[r] = expert_scales + static_cast<int64_t>(row / kFp8Block) * inter_blocks;
  }
  float acc[R] = {};
  warp_dot_fp8<R>(rows, scales, h + static_cast<int64_t>(slot) * inter, inter, lane, acc);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float total = warp_sum(acc[r]);
    if (lane == r && row0 + r < hidden) slot_out[static_cast<int64_t>(slot) * out_stride + row0 + r] = total;
  }
}

}  // namespace metrale::kernels::cuda::moe_fp8
