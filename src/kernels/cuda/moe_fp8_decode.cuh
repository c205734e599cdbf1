// The MoE decode path over FP8 experts (kernels/moe.h: moe_decode_gate_up / moe_decode_down with
// MoeExpertWeights::is_fp8): e4m3 codes [E, 2I, H] / [E, H, I] with fp32 128x128 block scales,
// dequantised in registers. Per (slot, rows) a 4-warp block; each warp streams its weight rows of
// the slot's expert through fp8_gemv::warp_dot_partial (16 codes a lane per load, every row's loads
// of a step in flight together, each chunk's block scale applied once) and dots them with the slot's
// input in fp32. Needs H % 16 == 0, I % 16 == 0 and 16-byte aligned input rows.
#pragma once

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_gemv.cuh"
#include "kernels/linear_fp8.h"

namespace metrale::kernels::cuda::moe_fp8 {

constexpr int kWarps = 4;
constexpr int kGateUpRows = 2;   // intermediate rows per warp (2 gate + 2 up weight rows)
constexpr int kGateUpLoads = 4;  // chunks per row in flight per lane (H = 2048: all of a lane's)
constexpr int kDownRows = 8;     // down rows per warp (I = 512 is one chunk a lane: depth comes from rows)
constexpr int kDownLoads = 1;

__device__ __forceinline__ float silu(float g) {
  return g / (1.0f + expf(-g));
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
  float acc[2 * R][1] = {};
  const XT* const x_rows[1] = {x + static_cast<int64_t>(slot / top_k) * x_stride};
  fp8_gemv::warp_dot_partial<2 * R, 1, kGateUpLoads>(rows, scales, x_rows, 1, hidden / fp8_gemv::kChunk, lane, acc);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float gate = warp_sum(acc[r][0]);
    float up = warp_sum(acc[R + r][0]);
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
  float acc[R][1] = {};
  const float* const h_rows[1] = {h + static_cast<int64_t>(slot) * inter};
  fp8_gemv::warp_dot_partial<R, 1, kDownLoads>(rows, scales, h_rows, 1, inter / fp8_gemv::kChunk, lane, acc);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float total = warp_sum(acc[r][0]);
    if (lane == r && row0 + r < hidden) slot_out[static_cast<int64_t>(slot) * out_stride + row0 + r] = total;
  }
}

}  // namespace metrale::kernels::cuda::moe_fp8
