// Warp-level building blocks of the attention kernels (sm_80+ instructions, used on sm_90a):
// asynchronous 16-byte global->shared copies, ldmatrix fragment loads, the bf16 m16n8k16 tensor-core
// product with fp32 accumulation, and the XOR swizzle of shared-memory tiles.
//
// Fragment layouts of mma.m16n8k16 (lane = 4 * group + quad_lane, group = lane / 4):
//   A (16 x 16, row-major, 4 x b32): a0 = (row group,     cols 2q, 2q+1)   a1 = (row group + 8, cols 2q, 2q+1)
//                                    a2 = (row group,     cols 2q+8, +9)   a3 = (row group + 8, cols 2q+8, +9)
//   B (16 x 8, k x n, 2 x b32):      b0 = (k 2q, 2q+1, col group)          b1 = (k 2q+8, 2q+9, col group)
//   C (16 x 8, fp32, 4 floats):      c0, c1 = (row group, cols 2q, 2q+1)   c2, c3 = (row group + 8, cols 2q, 2q+1)
// where q = quad_lane. The lower column (or k) index sits in the low 16 bits of a b32 register.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace metrale::kernels::cuda::attn {

__device__ __forceinline__ uint32_t smem_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Copies 16 bytes global -> shared without going through registers. When `valid` is false nothing is
// read and the 16 destination bytes are zero-filled (the source must still be a mapped address).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register i of every
// lane receives its part of matrix i (lane l: row l/4, columns 2(l%4), 2(l%4)+1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&regs)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(address));
}
// The same with each matrix transposed: lane l receives rows 2(l%4), 2(l%4)+1 of column l/4.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&regs)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
               : "r"(address));
}

// acc (16 x 8 fp32) += a (16 x 16 bf16) * b (16 x 8 bf16).
__device__ __forceinline__ void mma_bf16_16816(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 values as a bf16x2 register, round to nearest even; `lo` goes to the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// An fp32 pair as two bf16x2 registers hi = bf16(x), lo = bf16(x - hi): operands that keep ~16
// significant bits through bf16 tensor cores (hi hi + hi lo + lo hi).
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack_bf16x2(x0, x1);
  lo = pack_bf16x2(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

// Element offset of the 16-byte chunk `chunk` of row `row` in a shared tile of rows of kHeadDim
// bf16. Chunks are XOR-swizzled with the row's low three bits, so that the 8 rows read by one
// ldmatrix matrix (or written by 8 consecutive 16-byte stores of one row) fall in 8 different bank
// groups. Needs kHeadDim >= 64 (8 chunks per row).
template <int kHeadDim>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  static_assert(kHeadDim % 64 == 0, "the swizzle needs at least 8 chunks of 16 bytes per row");
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x; -inf -> +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {
  return __log2f(x);
}

__device__ __forceinline__ float quad_max(float value) {
  value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, 1));
  return fmaxf(value, __shfl_xor_sync(0xffffffffu, value, 2));
}
__device__ __forceinline__ float quad_sum(float value) {
  value += __shfl_xor_sync(0xffffffffu, value, 1);
  return value + __shfl_xor_sync(0xffffffffu, value, 2);
}

// One online-softmax step for the two rows (group, group + 8) of an m16 fragment that this thread
// holds: `scores` [kKeyTiles][4] are log2-domain scores (masked ones -inf) and become the
// probabilities P; `acc` [kDimTiles][4] (the output accumulator) and `row_sum` are rescaled.
template <int kKeyTiles, int kDimTiles>
__device__ __forceinline__ void online_softmax(float (&scores)[kKeyTiles][4], float (&acc)[kDimTiles][4],
                                               float (&row_max)[2], float (&row_sum)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt)
      tile_max = fmaxf(tile_max, fmaxf(scores[nt][2 * half], scores[nt][2 * half + 1]));
    tile_max = attn::quad_max(tile_max);
    const float new_max = fmaxf(row_max[half], tile_max);
    // A row with no unmasked key yet keeps max -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
    const float base = new_max == -INFINITY ? 0.0f : new_max;
    const float rescale = fast_exp2(row_max[half] - base);
    row_max[half] = new_max;
    row_sum[half] *= rescale;
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) {
      acc[dt][2 * half] *= rescale;
      acc[dt][2 * half + 1] *= rescale;
    }
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
      for (int e = 2 * half; e < 2 * half + 2; ++e) {
        const float p = fast_exp2(scores[nt][e] - base);
        scores[nt][e] = p;
        row_sum[half] += p;
      }
    }
  }
}

// scores = Q . K^T for one warp's 16 keys: `q_frag` the A fragments of the m16 query rows over
// kHeadDim, `k_tile` the warp's 16 key rows of a swizzled [keys, kHeadDim] bf16 tile. Raw dot
// products (the caller scales and masks).
template <int kHeadDim>
__device__ __forceinline__ void warp_scores_16keys(const uint32_t (&q_frag)[kHeadDim / 16][4],
                                                   const __nv_bfloat16* k_tile, int lane, float (&scores)[2][4]) {
  const int matrix = lane >> 3, matrix_row = lane & 7;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) scores[nt][0] = scores[nt][1] = scores[nt][2] = scores[nt][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    uint32_t k_frag[4];
    ldmatrix_x4(k_frag, smem_address(k_tile + swizzled_offset<kHeadDim>((matrix >> 1) * 8 + matrix_row,
                                                                        ks * 2 + (matrix & 1))));
    mma_bf16_16816(scores[0], q_frag[ks], k_frag[0], k_frag[1]);
    mma_bf16_16816(scores[1], q_frag[ks], k_frag[2], k_frag[3]);
  }
}

// acc += P . V for one warp's 16 keys: `p` the probabilities of the m16 x 16-key fragment (the
// scores after online_softmax, rounded to bf16 here as flash-attention does), `v_tile` the warp's 16
// value rows of a swizzled [keys, kHeadDim] bf16 tile.
template <int kHeadDim>
__device__ __forceinline__ void warp_pv_16keys(const float (&p)[2][4], const __nv_bfloat16* v_tile, int lane,
                                               float (&acc)[kHeadDim / 8][4]) {
  const int matrix = lane >> 3, matrix_row = lane & 7;
  uint32_t p_frag[4];
  p_frag[0] = pack_bf16x2(p[0][0], p[0][1]);
  p_frag[1] = pack_bf16x2(p[0][2], p[0][3]);
  p_frag[2] = pack_bf16x2(p[1][0], p[1][1]);
  p_frag[3] = pack_bf16x2(p[1][2], p[1][3]);
#pragma unroll
  for (int dp = 0; dp < kHeadDim / 16; ++dp) {
    uint32_t v_frag[4];
    ldmatrix_x4_trans(v_frag, smem_address(v_tile + swizzled_offset<kHeadDim>((matrix & 1) * 8 + matrix_row,
                                                                              dp * 2 + (matrix >> 1))));
    mma_bf16_16816(acc[2 * dp], p_frag, v_frag[0], v_frag[1]);
    mma_bf16_16816(acc[2 * dp + 1], p_frag, v_frag[2], v_frag[3]);
  }
}

// Stages this warp's online-softmax state of its m16 fragment's rows (group, group + 8) for the
// cross-warp combine: max[warp * kRows + r], sum[warp * kRows + r] (the quad-reduced row sum) and
// acc[(warp * kRows + r) * stride + d].
template <int kRows, int kDimTiles>
__device__ __forceinline__ void stage_warp_state(const float (&row_max)[2], const float (&row_sum)[2],
                                                 const float (&acc)[kDimTiles][4], int warp, int lane, float* max,
                                                 float* sum, float* acc_out, int stride) {
  const int group = lane >> 2, quad = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = group + 8 * half;
    const float total = quad_sum(row_sum[half]);
    if (quad == 0) {
      max[warp * kRows + r] = row_max[half];
      sum[warp * kRows + r] = total;
    }
    float* dst = acc_out + (warp * kRows + r) * stride + quad * 2;
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) {
      *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(acc[dt][2 * half], acc[dt][2 * half + 1]);
    }
  }
}

// The cross-warp combine at the end of a split-KV CTA: each of kWarps warps holds an online-softmax
// state (row max and sum in the log2 domain, unnormalised accumulator) of the same kRows rows over
// its own keys, staged in shared memory as max[w * kRows + r], sum[w * kRows + r] and
// acc[(w * kRows + r) * stride + d]. For row r: each warp's weight, the weighted sum and the overall
// max (-inf and a zero total when no warp saw a key).
template <int kWarps>
struct WarpWeights {
  float weight[kWarps];
  float total;
  float max;
};

template <int kWarps, int kRows>
__device__ __forceinline__ WarpWeights<kWarps> combine_warp_weights(const float* max, const float* sum, int row) {
  WarpWeights<kWarps> c;
  c.max = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) c.max = fmaxf(c.max, max[w * kRows + row]);
  c.total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    c.weight[w] = c.max == -INFINITY ? 0.0f : fast_exp2(max[w * kRows + row] - c.max);
    c.total += c.weight[w] * sum[w * kRows + row];
  }
  return c;
}

// sum_w weight[w] * acc[w][row][d, d + 4), scaled by `scale`.
template <int kWarps, int kRows>
__device__ __forceinline__ float4 combine_warp_acc(const float* acc, int stride, int row, int d,
                                                   const WarpWeights<kWarps>& c, float scale) {
  float4 value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const float4 piece = *reinterpret_cast<const float4*>(acc + (w * kRows + row) * stride + d);
    value.x += c.weight[w] * piece.x;
    value.y += c.weight[w] * piece.y;
    value.z += c.weight[w] * piece.z;
    value.w += c.weight[w] * piece.w;
  }
  return make_float4(value.x * scale, value.y * scale, value.z * scale, value.w * scale);
}

// Launches `kernel` on `stream`. (A function rather than the <<<>>> syntax at every call site, so
// that the launch is one place to change.)
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                   Args&&... args) {
  kernel<<<grid, block, smem_bytes, stream>>>(static_cast<Params>(args)...);
}

}  // namespace metrale::kernels::cuda::attn
