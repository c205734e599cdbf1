// Warp-level GEMV building blocks over e4m3 weights with 128x128 block scales, shared by the dense
// FP8 linear (small M) and the FP8 MoE decode kernels. The FP8 twin of gemm_gemv.cuh.
//
// A warp owns R weight rows and M input rows. Lane l reads 16-code (16-byte) chunks l, l + 32,
// l + 64, ... of every row, U chunks per row in flight before the first is used (R * U loads per
// lane: at half the bytes per element of bf16, an FP8 row needs twice the chunks in flight to keep
// the same bytes moving). Codes become fp32 through the hardware pair conversion (e4m3x2 -> f16x2,
// exact), each chunk is dotted with the input unscaled and its block scale applied once: a 16-code
// chunk never crosses a 128-column scale block. Weight rows are read exactly once and bypass L1;
// input rows are reused by every warp of the SM and go through L1.
//
// Requirements (checked by the hosts): K % 16 == 0; weight rows, input rows and their base pointers
// 16-byte aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemm_gemv.cuh"
#include "kernels/linear_fp8.h"

namespace metrale::kernels::cuda::fp8_gemv {

constexpr int kChunk = 16;                                             // e4m3 codes per 16-byte load
constexpr int kChunksPerScale = static_cast<int>(kFp8Block) / kChunk;  // chunks per scale block

// 16 e4m3 codes to fp32, two at a time by the hardware conversion (sm_89+).
__device__ __forceinline__ void codes_to_f32(const uint4& packed, float (&w)[kChunk]) {
  const auto* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&packed);
#pragma unroll
  for (int j = 0; j < kChunk / 2; ++j) {
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[j], __NV_E4M3)));
    w[2 * j] = f.x;
    w[2 * j + 1] = f.y;
  }
}

// 16 consecutive input elements (16-byte aligned) as fp32.
__device__ __forceinline__ void load_x16(const __nv_bfloat16* p, float (&v)[kChunk]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float f[8];
    gemv::unpack_bf16x8(__ldg(reinterpret_cast<const uint4*>(p) + half), f);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[half * 8 + j] = f[j];
  }
}

__device__ __forceinline__ void load_x16(const __half* p, float (&v)[kChunk]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint4 packed = __ldg(reinterpret_cast<const uint4*>(p) + half);
    const auto* pairs = reinterpret_cast<const __half2*>(&packed);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(pairs[j]);
      v[half * 8 + 2 * j] = f.x;
      v[half * 8 + 2 * j + 1] = f.y;
    }
  }
}

__device__ __forceinline__ void load_x16(const float* p, float (&v)[kChunk]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 f = __ldg(reinterpret_cast<const float4*>(p) + q);
    v[4 * q] = f.x;
    v[4 * q + 1] = f.y;
    v[4 * q + 2] = f.z;
    v[4 * q + 3] = f.w;
  }
}

// acc[r][m] += this lane's share of dot(dequant(w[r][0:16*chunks]), x[m][0:16*chunks]); scales[r]
// points at row r's block-scale row ([ceil(K/128)] f32). Rows m >= m_valid are not read. Lanes may
// finish at different iterations; nothing here synchronises the warp.
template <int R, int M, int U, typename XT>
__device__ __forceinline__ void warp_dot_partial(const uint8_t* const (&w)[R], const float* const (&scales)[R],
                                                 const XT* const (&x)[M], int m_valid, int chunks, int lane,
                                                 float (&acc)[R][M]) {
  for (int base = lane; base < chunks; base += 32 * U) {
    // Every weight load of the step issues before the first conversion.
    uint4 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + u * 32;
      if (c < chunks) {
#pragma unroll
        for (int r = 0; r < R; ++r) wv[u][r] = gemv::load_streaming_16(w[r] + static_cast<int64_t>(c) * kChunk);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + u * 32;
      if (c < chunks) {
        float scale[R], wf[R][kChunk];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          scale[r] = __ldg(scales[r] + c / kChunksPerScale);
          codes_to_f32(wv[u][r], wf[r]);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
          if (M == 1 || m < m_valid) {
            float xf[kChunk];
            load_x16(x[m] + static_cast<int64_t>(c) * kChunk, xf);
#pragma unroll
            for (int r = 0; r < R; ++r) {
              float dot = 0.0f;
#pragma unroll
              for (int j = 0; j < kChunk; ++j) dot = fmaf(wf[r][j], xf[j], dot);
              acc[r][m] = fmaf(dot, scale[r], acc[r][m]);
            }
          }
        }
      }
    }
  }
}

}  // namespace metrale::kernels::cuda::fp8_gemv
