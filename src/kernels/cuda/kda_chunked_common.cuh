// What the chunked KDA kernels share (kda_chunked.cuh gives the algorithm): tile and record layouts,
// the launch arguments, the gate, the swizzle and the staging of raw rows, and the per-channel
// cumulative sum of the gates.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/chunk_offsets.cuh"
#include "kernels/cuda/common.cuh"

namespace metrale::kernels::cuda::kda {

using bf16 = __nv_bfloat16;

constexpr int kChunk = 64;
constexpr int kKeyDim = 128;
constexpr int kTileV = 64;  // state columns per scan CTA
constexpr int kPrepThreads = 256;
constexpr int kScanThreads = 256;
constexpr int kPadRow = 72;  // row pitch (bf16) of the 64-wide tiles: conflict-free ldmatrix

// Workspace record of one (chunk, head): written by the prep kernel, read by the scan.
struct ChunkRecord {
  float g[kChunk * kKeyDim];  // G, the per-channel cumulative log decay [64][128], row-major; padding
                              // rows repeat the last valid row (their gates are 0)
  bf16 t_hi[kChunk * kChunk];  // T = (I + Akk)^-1 = t_hi + t_lo, row-major, zero above the diagonal
  bf16 t_lo[kChunk * kChunk];
  bf16 aqk[kChunk * kChunk];  // row-major; entries above the diagonal of the diagonal blocks are 0
  float beta[kChunk];         // 0 on padding rows
  float rk[kChunk];           // 1 / sqrt(|k|^2 + 1e-6), 0 on padding rows
  float rq[kChunk];           // scale / sqrt(|q|^2 + 1e-6), 0 on padding rows
  float pad[kChunk];
};
static_assert(sizeof(ChunkRecord) % 16 == 0, "records are copied in 16-byte pieces");

struct ChunkArgs {
  const bf16* q;  // [T, H, 128], rows and heads strided
  const bf16* k;
  const bf16* v;  // [T, H, dv]
  const bf16* f;  // [T, H * 128] forget-gate projection
  const bf16* b;  // [T, H] beta logits
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, f_row, b_row;  // strides in elements
  const void* A_log;  // [H]
  const void* dt_bias;  // [H * 128]
  WeightType A_log_type, dt_bias_type;
  float* state;  // [slots, H, 128, dv] f32
  const int32_t* cu_q;
  const int32_t* kv_lens;
  const int32_t* slots;
  bf16* out;  // [T, H, dv]
  int64_t out_row, out_head;
  int32_t* chunk_offsets;  // [S + 1] (workspace)
  ChunkRecord* records;    // [max_chunks * H] (workspace)
  int num_seqs, heads, dv;
  float scale;
  bool has_lower_bound;
  float lower_bound;
  bool safe_diagonal;  // bounded gate with lambda >= -5: diagonal blocks on tensor cores
};

// Element offset of (row, col) in a [rows][128] bf16 tile whose 16-byte chunks are XOR-swizzled by
// the row's low three bits (conflict-free ldmatrix without padding).
__device__ __forceinline__ int sw(int row, int col) {
  return row * kKeyDim + ((((col >> 3) ^ (row & 7)) << 3) | (col & 7));
}

// The 16-byte chunk (of 32 per row) where chunk `c16` of a [64][128] fp32 G row sits in the scan's
// shared tile: bit 3 folded into bit 0, so that the 8 lanes of a phase reading chunks 2 c8 (or
// 2 c8 + 1), c8 = 0..7, hit 8 distinct bank quads.
__device__ __forceinline__ int g_chunk(int c16) { return c16 ^ ((c16 >> 3) & 1); }

__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits16) { return __uint_as_float(bits16 << 16); }
__device__ __forceinline__ float bf16_to_f32(bf16 x) { return __bfloat162float(x); }

__device__ __forceinline__ void store_split(bf16* hi, bf16* lo, int offset, float x0, float x1) {
  uint32_t h, l;
  attn::split_bf16x2(x0, x1, h, l);
  *reinterpret_cast<uint32_t*>(hi + offset) = h;
  *reinterpret_cast<uint32_t*>(lo + offset) = l;
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&regs)[2], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(regs[0]), "=r"(regs[1])
               : "r"(address));
}

// The forget gate g of one channel (fp32): phi = f + dt_bias, A = exp(A_log).
__device__ __forceinline__ float forget_gate(float phi, float decay_rate, bool has_lower_bound, float lower_bound) {
  // The fast exponential (~2 ulp) and the hardware reciprocal (~1 ulp; a correctly rounded one is a
  // dozen instructions, which made this gate the prep kernel's second largest cost): G sums 64 of
  // these, so the decays carry ~1e-6 relative error, below what the bf16 operands they scale resolve.
  // A denominator past 2^126 (the gate's sigmoid below 1e-38) gives 0.
  if (has_lower_bound) return __fdividef(lower_bound, 1.0f + __expf(-(decay_rate * phi)));
  const float softplus = phi > 20.0f ? phi : __logf(1.0f + __expf(phi));
  return -decay_rate * softplus;
}

// Stages the raw [64][128] rows of one chunk (q, k or the gate projection) into a swizzled tile,
// padding rows zero-filled. Every thread of the CTA takes part.
template <int kThreads>
__device__ __forceinline__ void stage_rows(bf16* tile, const bf16* base, int64_t row_stride, int row0, int valid,
                                           int first = 0, int count = kChunk) {
  for (int idx = threadIdx.x; idx < count * (kKeyDim / 8); idx += kThreads) {
    const int r = first + (idx >> 4), c = (idx & 15) * 8;
    const bool ok = r < valid;
    attn::cp_async_16(attn::smem_address(tile + sw(r, c)), base + static_cast<int64_t>(row0 + (ok ? r : 0)) * row_stride + c,
                      ok);
  }
}

// G over the chunk's rows for channel c: threads [0, 128) take rows 0-31, [128, 256) rows 32-63;
// `total` [128] exchanges the first half's sums. Padding rows have g = 0 (the reference pads g with
// zeros), so G stays at the last valid row's value. Calls fn(i, G_i) for the thread's 32 rows in
// order and returns G at row 63 (the chunk's total) to every thread of channel c.
template <typename Fn>
__device__ __forceinline__ float channel_cumsum(const bf16* f_tile, int c, int half, int valid, float bias,
                                                float decay_rate, const ChunkArgs& a, float* total, Fn&& fn) {
  float g_rows[32];
  float running = 0.0f;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int i = half * 32 + j;
    const float g = i < valid ? forget_gate(bf16_to_f32(f_tile[sw(i, c)]) + bias, decay_rate, a.has_lower_bound,
                                            a.lower_bound)
                              : 0.0f;
    running += g;
    g_rows[j] = running;
  }
  if (half == 0) total[c] = running;
  __syncthreads();
  const float offset = half == 1 ? total[c] : 0.0f;
  __syncthreads();
  if (half == 1) total[c] = running + offset;
  __syncthreads();
  const float last = total[c];
#pragma unroll
  for (int j = 0; j < 32; ++j) fn(half * 32 + j, g_rows[j] + offset);
  return last;
}

}  // namespace metrale::kernels::cuda::kda
