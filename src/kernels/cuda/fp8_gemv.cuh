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
#include <type_traits>

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

// 16 consecutive input elements (16-byte aligned), as loaded; converted to fp32 at use, so a step's
// input loads can issue together with its weight loads.
template <typename XT>
struct InputChunk16 {
  static constexpr int kLoads = kChunk * static_cast<int>(sizeof(XT)) / 16;  // 16-byte loads
  uint4 raw[kLoads];

  __device__ __forceinline__ void load(const XT* p) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) raw[i] = reinterpret_cast<const uint4*>(p)[i];  // coherent: see InputChunk
  }

  __device__ __forceinline__ void to_f32(float (&v)[kChunk]) const {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      if constexpr (sizeof(XT) == 4) {
        v[4 * i] = __uint_as_float(raw[i].x);
        v[4 * i + 1] = __uint_as_float(raw[i].y);
        v[4 * i + 2] = __uint_as_float(raw[i].z);
        v[4 * i + 3] = __uint_as_float(raw[i].w);
      } else if constexpr (std::is_same_v<XT, __half>) {
        const auto* pairs = reinterpret_cast<const __half2*>(&raw[i]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __half22float2(pairs[j]);
          v[8 * i + 2 * j] = f.x;
          v[8 * i + 2 * j + 1] = f.y;
        }
      } else {
        float f[8];
        gemv::unpack_bf16x8(raw[i], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[8 * i + j] = f[j];
      }
    }
  }
};

// acc[r][m] += this lane's share of dot(dequant(w[r][0:16*chunks]), x[m][0:16*chunks]); scales[r]
// points at row r's block-scale row ([ceil(K/128)] f32). Rows m >= m_valid are not read. Lanes may
// finish at different iterations; nothing here synchronises the warp. A step issues its weight,
// scale and input loads before the first conversion; before_inputs() runs once per lane between the
// first step's weight and scale loads and its first input load (also in a lane with no chunk).
template <int R, int M, int U, typename XT, typename BeforeInputs = gemv::NoInputWait>
__device__ __forceinline__ void warp_dot_partial(const uint8_t* const (&w)[R], const float* const (&scales)[R],
                                                 const XT* const (&x)[M], int m_valid, int chunks, int lane,
                                                 float (&acc)[R][M], BeforeInputs before_inputs = {}) {
  bool inputs_ready = false;
  for (int base = lane; base < chunks; base += 32 * U) {
    uint4 wv[U][R];
    float scale[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + u * 32;
      if (c < chunks) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          wv[u][r] = gemv::load_streaming_16(w[r] + static_cast<int64_t>(c) * kChunk);
          scale[u][r] = __ldg(scales[r] + c / kChunksPerScale);
        }
      }
    }
    if (!inputs_ready) {
      before_inputs();
      inputs_ready = true;
    }
    InputChunk16<XT> xv[U][M];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + u * 32;
      if (c < chunks) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          if (M == 1 || m < m_valid) xv[u][m].load(x[m] + static_cast<int64_t>(c) * kChunk);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * 32 < chunks) {
        float wf[R][kChunk];
#pragma unroll
        for (int r = 0; r < R; ++r) codes_to_f32(wv[u][r], wf[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          if (M == 1 || m < m_valid) {
            float xf[kChunk];
            xv[u][m].to_f32(xf);
#pragma unroll
            for (int r = 0; r < R; ++r) {
              float dot = 0.0f;
#pragma unroll
              for (int j = 0; j < kChunk; ++j) dot = fmaf(wf[r][j], xf[j], dot);
              acc[r][m] = fmaf(dot, scale[u][r], acc[r][m]);
            }
          }
        }
      }
    }
  }
  if (!inputs_ready) before_inputs();
}

}  // namespace metrale::kernels::cuda::fp8_gemv
