// T = (I + A)^-1 for a strictly lower triangular 64 x 64 fp32 matrix A in shared memory, computed by
// one CTA: the chunked delta rules' WY inverse (glm_deepseek.md §2.5, qwen.md §6.6).
//
// By 16 x 16 blocks, with every warp busy instead of one thread per column walking all 64 rows:
//  1. the four diagonal blocks T_II = (I + A_II)^-1 by forward substitution, one thread per column
//     of each block (16 steps);
//  2. the blocks below the diagonal one sub-diagonal d = I - J at a time, one warp per block:
//       P_IJ = sum_{K=J}^{I-1} A_IK T_KJ,   T_IJ = -T_II P_IJ,
//     both on bf16 tensor cores with every fp32 operand split into hi + lo halves and three products
//     (hi hi + hi lo + lo hi), which keeps ~2^-16 relative accuracy: the precision T is stored at.
// Blocks above the diagonal are not written (they are zero; the caller knows).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/attention_mma.cuh"

namespace metrale::kernels::cuda::tril {

constexpr int kDim = 64;
constexpr int kBlock = 16;
constexpr int kTPitch = kDim + 4;                       // fp32 row pitch of T: fewer bank conflicts
constexpr int kTBytes = kDim * kTPitch * 4;             // 17,408
constexpr int kScratchBytes = 3 * kBlock * kBlock * 4;  // one P block per warp of the widest level
constexpr int kSmemBytes = kTBytes + kScratchBytes;

// A fragment (m16 x k16, row-major) of the fp32 block at (row0, col0) of M, as hi and lo halves.
__device__ __forceinline__ void load_a(const float* M, int pitch, int row0, int col0, uint32_t (&hi)[4],
                                       uint32_t (&lo)[4]) {
  const int lane = threadIdx.x & 31, group = lane >> 2, quad = lane & 3;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int row = row0 + group + (r & 1) * 8, col = col0 + 2 * quad + (r >> 1) * 8;
    const float2 v = *reinterpret_cast<const float2*>(M + row * pitch + col);
    attn::split_bf16x2(v.x, v.y, hi[r], lo[r]);
  }
}

// B fragment (k16 x n8) of the fp32 block at (row0, col0) of M (k along rows), as hi and lo halves.
__device__ __forceinline__ void load_b(const float* M, int pitch, int row0, int col0, uint32_t (&hi)[2],
                                       uint32_t (&lo)[2]) {
  const int lane = threadIdx.x & 31, group = lane >> 2, quad = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 2 * quad + h * 8, col = col0 + group;
    attn::split_bf16x2(M[row * pitch + col], M[(row + 1) * pitch + col], hi[h], lo[h]);
  }
}

__device__ __forceinline__ void mma_split(float (&acc)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                          const uint32_t (&bh)[2], const uint32_t (&bl)[2]) {
  attn::mma_bf16_16816(acc, ah, bh[0], bh[1]);
  attn::mma_bf16_16816(acc, ah, bl[0], bl[1]);
  attn::mma_bf16_16816(acc, al, bh[0], bh[1]);
}

// A [64][a_pitch] fp32 (strictly lower; the diagonal and above are not read), T [64][kTPitch] fp32,
// scratch kScratchBytes; all in shared memory, T and scratch not aliasing A. Every thread of the CTA
// (kThreads >= 128, a multiple of 32) calls it; it begins and ends with __syncthreads().
template <int kThreads>
__device__ void invert_unit_lower(const float* A, int a_pitch, float* T, float* scratch) {
  static_assert(kThreads >= 128 && kThreads % 32 == 0, "four warps at least");
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, group = lane >> 2, quad = lane & 3;
  __syncthreads();
  if (tid < 4 * kBlock) {
    const int b0 = (tid >> 4) * kBlock, col = tid & 15;
    float t[kBlock];
#pragma unroll
    for (int i = 0; i < kBlock; ++i) {
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < i; ++j) sum = fmaf(A[(b0 + i) * a_pitch + b0 + j], t[j], sum);
      t[i] = (i == col ? 1.0f : 0.0f) - sum;
    }
#pragma unroll
    for (int i = 0; i < kBlock; ++i) T[(b0 + i) * kTPitch + b0 + col] = t[i];
  }
  __syncthreads();
  for (int d = 1; d < 4; ++d) {
    if (warp < 4 - d) {
      const int J = warp, I = J + d;
      float acc[2][4] = {};
      for (int K = J; K < I; ++K) {
        uint32_t ah[4], al[4];
        load_a(A, a_pitch, I * kBlock, K * kBlock, ah, al);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          uint32_t bh[2], bl[2];
          load_b(T, kTPitch, K * kBlock, J * kBlock + nt * 8, bh, bl);
          mma_split(acc[nt], ah, al, bh, bl);
        }
      }
      float* P = scratch + warp * kBlock * kBlock;  // [16][16], this warp's own
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          *reinterpret_cast<float2*>(P + (group + hr * 8) * kBlock + nt * 8 + 2 * quad) =
              make_float2(acc[nt][2 * hr], acc[nt][2 * hr + 1]);
        }
      }
      __syncwarp();
      float out[2][4] = {};
      uint32_t ah[4], al[4];
      load_a(T, kTPitch, I * kBlock, I * kBlock, ah, al);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        uint32_t bh[2], bl[2];
        load_b(P, kBlock, 0, nt * 8, bh, bl);
        mma_split(out[nt], ah, al, bh, bl);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          *reinterpret_cast<float2*>(T + (I * kBlock + group + hr * 8) * kTPitch + J * kBlock + nt * 8 + 2 * quad) =
              make_float2(-out[nt][2 * hr], -out[nt][2 * hr + 1]);
        }
      }
    }
    __syncthreads();
  }
}

}  // namespace metrale::kernels::cuda::tril
