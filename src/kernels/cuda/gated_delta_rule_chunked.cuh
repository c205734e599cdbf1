// The chunked (WY) gated delta rule on tensor cores, for key_head_dim 128 and bf16 q/k/v
// (qwen.md §6.6). Three launches, all reading the batch metadata on the device only:
//
//  1. chunks::offsets_kernel (chunk_offsets.cuh): chunk_offsets[s] = sum over earlier sequences of
//     ceil(q_len / 64), so that every chunk of the batch has one index c and one workspace record per value head.
//  2. chunk_prep_kernel, one CTA per (chunk, key head), all chunks in parallel: the Gram matrices
//     K K^T and Q K^T of the raw bf16 rows on tensor cores (exact products, fp32 sums), scaled by
//     the l2-norm factors; then per value head the gates' cumsum gamma, A = beta_i exp(g_i - g_j)
//     (k_i . k_j) (strict lower), T = (I + A)^-1 by forward substitution in fp32, and
//     Aqk = exp(g_i - g_j) (q_i . k_j) (j <= i). T is stored as two bf16 matrices t_hi + t_lo
//     (about 16 significant bits), Aqk as bf16 (it only feeds the output).
//  3. chunk_scan_kernel, one CTA of 16 warps per (sequence, value head, 32 state columns), sequential over the
//     sequence's chunks with the fp32 state tile [128, 32] in registers:
//       Y  = beta (V - exp(g) rk (K S))       K S on tensor cores, S split as s_hi + s_lo
//       V' = T Y                              t_hi y_hi + t_hi y_lo + t_lo y_hi
//       O  = exp(g) rq (Q S) + Aqk V'         Q s_hi only, Aqk V' in bf16: output precision
//       S  = exp(g_C) S + K^T (exp(g_C - g) rk V')   K^T z_hi + K^T z_lo
//     which is the reference's U - W S, Q' S + Aqk V', S' + K'^T V' with the l2-norm and decay
//     factors moved onto rows, so that the tensor cores see the raw bf16 q/k rows exactly. The next
//     chunk's tiles arrive by cp.async while the current one is computed.
// Products whose result reaches the state use a hi/lo bf16 split of the fp32 operand (relative
// error ~2^-16), so the final state matches the fp32 reference to ~1e-5; the output carries bf16
// rounding of the Q S and Aqk V' operands (~2e-3 relative), below its own bf16 rounding.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/chunk_offsets.cuh"
#include "kernels/cuda/common.cuh"

namespace metrale::kernels::cuda::gdn {

using bf16 = __nv_bfloat16;

constexpr int kChunk = 64;        // rows per chunk (transformers' chunk size)
constexpr int kKeyDim = 128;      // dk of the tensor-core path
constexpr int kTileV = 32;        // state columns per scan CTA
constexpr int kPrepThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kScanThreads = 512;
constexpr int kKeyRow = kKeyDim + 8;   // shared row pitch (bf16) of K and Q tiles: conflict-free ldmatrix
constexpr int kChunkRow = kChunk + 8;  // of T and Aqk tiles
constexpr int kTileRow = kTileV + 8;   // of V, S, Y, V' and Z tiles

// Workspace record of one (chunk, value head): written by the prep kernel, read by the scan.
struct ChunkRecord {
  bf16 t_hi[kChunk * kChunk];  // T = (I + A)^-1 = t_hi + t_lo, row-major [i][j], zero above the diagonal
  bf16 t_lo[kChunk * kChunk];
  bf16 aqk[kChunk * kChunk];  // (q_i . k_j) exp(gamma_i - gamma_j) for j <= i, else 0 (normalised, scaled q)
  float beta[kChunk];         // beta_i (0 on padding rows)
  float key_decay[kChunk];    // exp(gamma_i) rk_i
  float query_scale[kChunk];  // exp(gamma_i) rq_i (rq includes params.scale)
  float write_scale[kChunk];  // exp(gamma_C - gamma_i) rk_i
  float chunk_decay[kChunk];  // [0] = exp(gamma_C), the rest 0
};
static_assert(sizeof(ChunkRecord) % 16 == 0, "records are copied in 16-byte pieces");
constexpr int kRecordScalars = 5 * kChunk;  // the five float arrays, contiguous

struct ChunkArgs {
  const bf16* q;  // [T, Hk, 128], rows and heads strided
  const bf16* k;
  const bf16* v;  // [T, Hv, dv]
  int64_t q_row, q_head, k_row, k_head, v_row, v_head;  // strides in elements
  const float* g;     // [T, Hv] f32
  const float* beta;  // [T, Hv] f32
  float* state;       // [slots, Hv, 128, dv] f32
  const int32_t* cu_q;
  const int32_t* kv_lens;
  const int32_t* slots;
  bf16* out;  // [T, Hv, dv]
  int64_t out_row, out_head;
  int32_t* chunk_offsets;  // [S + 1] (workspace)
  ChunkRecord* records;    // [max_chunks * Hv] (workspace)
  int num_seqs, k_heads, v_heads, dv;
  float scale;
  bool l2norm;
};

__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// Stores (x0, x1) at `offset` of the hi and lo tiles: hi = bf16(x), lo = bf16(x - hi).
__device__ __forceinline__ void store_split(bf16* hi, bf16* lo, int offset, float x0, float x1) {
  const uint32_t h = attn::pack_bf16x2(x0, x1);
  const float r0 = x0 - bf16_bits_to_f32(h & 0xffffu), r1 = x1 - bf16_bits_to_f32(h >> 16);
  *reinterpret_cast<uint32_t*>(hi + offset) = h;
  *reinterpret_cast<uint32_t*>(lo + offset) = attn::pack_bf16x2(r0, r1);
}

// Two 8x8 b16 matrices, transposed; lanes 0-7 and 8-15 give the row addresses (the others are ignored).
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&regs)[2], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(regs[0]), "=r"(regs[1])
               : "r"(address));
}

// ---- prep kernel ----
namespace prep {
constexpr int kTileBytes = kChunk * kKeyRow * 2;               // one bf16 K or Q tile
constexpr int kOffK = 0;                                       // K tile, later the two A matrices
constexpr int kOffQ = kTileBytes;                              // Q tile
constexpr int kOffGkk = 2 * kTileBytes;                        // float [64][65]
constexpr int kOffGqk = kOffGkk + kChunk * (kChunk + 1) * 4;   // float [64][65]
constexpr int kOffNorms = kOffGqk + kChunk * (kChunk + 1) * 4;  // rk[64], rq[64]
constexpr int kOffGates = kOffNorms + 2 * kChunk * 4;          // gamma[2][64], beta[2][64]
constexpr int kOffScan = kOffGates + 4 * kChunk * 4;           // float [2][2]
constexpr int kSmemBytes = kOffScan + 16;
static_assert(2 * kChunk * kChunk * 4 <= 2 * kTileBytes, "the A matrices reuse the K/Q tiles");
}  // namespace prep

__global__ void __launch_bounds__(kPrepThreads) chunk_prep_kernel(ChunkArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int hk = blockIdx.x, chunk = blockIdx.y;  // heads fastest: neighbours read neighbouring columns
  if (chunk >= a.chunk_offsets[a.num_seqs]) return;
  const int s = sequence_of(a.chunk_offsets, a.num_seqs, chunk);
  const int row0 = a.cu_q[s] + (chunk - a.chunk_offsets[s]) * kChunk;
  const int valid = min(kChunk, a.cu_q[s + 1] - row0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int quad_row = lane >> 2, quad_col = lane & 3;

  bf16* k_tile = reinterpret_cast<bf16*>(smem + prep::kOffK);
  bf16* q_tile = reinterpret_cast<bf16*>(smem + prep::kOffQ);
  auto gkk = reinterpret_cast<float(*)[kChunk + 1]>(smem + prep::kOffGkk);
  auto gqk = reinterpret_cast<float(*)[kChunk + 1]>(smem + prep::kOffGqk);
  float* rk = reinterpret_cast<float*>(smem + prep::kOffNorms);
  float* rq = rk + kChunk;
  auto gamma_s = reinterpret_cast<float(*)[kChunk]>(smem + prep::kOffGates);
  auto beta_s = reinterpret_cast<float(*)[kChunk]>(smem + prep::kOffGates + 2 * kChunk * 4);
  auto scan_s = reinterpret_cast<float(*)[2]>(smem + prep::kOffScan);

  // Raw K and Q rows of the chunk (padding rows zero-filled).
  for (int idx = tid; idx < kChunk * (kKeyDim / 8); idx += kPrepThreads) {
    const int r = idx >> 4, c = (idx & 15) * 8;
    const bool ok = r < valid;
    const int64_t row = row0 + (ok ? r : 0);
    attn::cp_async_16(attn::smem_address(k_tile + r * kKeyRow + c), a.k + row * a.k_row + hk * a.k_head + c, ok);
    attn::cp_async_16(attn::smem_address(q_tile + r * kKeyRow + c), a.q + row * a.q_row + hk * a.q_head + c, ok);
  }
  attn::cp_async_commit();
  attn::cp_async_wait<0>();
  __syncthreads();

  // l2-norm factors: warp w takes rows 16w..16w+15 of K, then of Q; each lane 4 columns.
  for (int i = 0; i < 32; ++i) {
    const int r = warp * 16 + (i & 15);
    const bf16* tile = i < 16 ? k_tile : q_tile;
    const uint2 raw = *reinterpret_cast<const uint2*>(tile + r * kKeyRow + lane * 4);
    const float x0 = bf16_bits_to_f32(raw.x & 0xffffu), x1 = bf16_bits_to_f32(raw.x >> 16);
    const float x2 = bf16_bits_to_f32(raw.y & 0xffffu), x3 = bf16_bits_to_f32(raw.y >> 16);
    const float sum = warp_sum(x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3);
    if (lane == 0) {
      float inv = a.l2norm ? rsqrtf(sum + 1e-6f) : 1.0f;
      if (r >= valid) inv = 0.0f;
      if (i < 16) {
        rk[r] = inv;
      } else {
        rq[r] = inv * a.scale;
      }
    }
  }

  // Lower triangles of K K^T and Q K^T; warp w owns rows 16w..16w+15, column tiles up to its diagonal.
  float acc_k[8][4] = {}, acc_q[8][4] = {};
#pragma unroll
  for (int kk = 0; kk < kKeyDim / 16; ++kk) {
    uint32_t ak[4], aq[4];
    const int a_offset = (warp * 16 + (lane & 15)) * kKeyRow + kk * 16 + (lane >> 4) * 8;
    attn::ldmatrix_x4(ak, attn::smem_address(k_tile + a_offset));
    attn::ldmatrix_x4(aq, attn::smem_address(q_tile + a_offset));
#pragma unroll
    for (int jp = 0; jp < 4; ++jp) {
      if (jp <= warp) {
        // B[k][n] = K[n][k]: the K rows as stored give the col-major B fragment without transposing.
        const int m = lane >> 3, i = lane & 7;
        uint32_t b[4];
        attn::ldmatrix_x4(b, attn::smem_address(k_tile + (jp * 16 + (m >> 1) * 8 + i) * kKeyRow + kk * 16 + (m & 1) * 8));
        attn::mma_bf16_16816(acc_k[2 * jp], ak, b[0], b[1]);
        attn::mma_bf16_16816(acc_k[2 * jp + 1], ak, b[2], b[3]);
        attn::mma_bf16_16816(acc_q[2 * jp], aq, b[0], b[1]);
        attn::mma_bf16_16816(acc_q[2 * jp + 1], aq, b[2], b[3]);
      }
    }
  }
  __syncthreads();  // rk, rq visible
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    if (nt <= 2 * warp + 1) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = warp * 16 + quad_row + (e >> 1) * 8, j = nt * 8 + 2 * quad_col + (e & 1);
        gkk[i][j] = acc_k[nt][e] * rk[i] * rk[j];
        gqk[i][j] = acc_q[nt][e] * rq[i] * rk[j];
      }
    }
  }
  __syncthreads();  // Gram matrices complete; the K/Q tiles are free for the A matrices

  // Per value head of this key head, two at a time (threads 0-63 and 64-127); thread `col` owns
  // row `col` for the gates and column `col` of A, Aqk and T.
  const int group = tid >> 6, col = tid & 63;
  const int ratio = a.v_heads / a.k_heads;
  float* A = reinterpret_cast<float*>(smem + prep::kOffK) + group * kChunk * kChunk;
  for (int j0 = 0; j0 < ratio; j0 += 2) {
    const int jv = j0 + group;
    const bool active = jv < ratio;
    const int h = hk * ratio + jv;
    float gv = 0.0f, bv = 0.0f;
    if (active && col < valid) {
      gv = a.g[static_cast<int64_t>(row0 + col) * a.v_heads + h];
      bv = a.beta[static_cast<int64_t>(row0 + col) * a.v_heads + h];
    }
    float x = gv;  // inclusive cumsum over the 64 rows (two warps)
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, x, offset);
      if (lane >= offset) x += y;
    }
    if (lane == 31) scan_s[group][warp & 1] = x;
    __syncthreads();
    if (warp & 1) x += scan_s[group][0];
    gamma_s[group][col] = x * kLog2e;  // gamma in log2 units: every decay below is one exp2
    beta_s[group][col] = bv;
    __syncthreads();

    ChunkRecord* rec = a.records + static_cast<int64_t>(chunk) * a.v_heads + h;
    if (active) {
      const float gamma_j = gamma_s[group][col];
      for (int i = 0; i < kChunk; ++i) {
        float a_ij = 0.0f, q_ij = 0.0f;
        if (col <= i) {
          const float decay = exp2f(gamma_s[group][i] - gamma_j);
          if (col < i) a_ij = beta_s[group][i] * decay * gkk[i][col];
          q_ij = decay * gqk[i][col];
        }
        A[i * kChunk + col] = a_ij;
        rec->aqk[i * kChunk + col] = __float2bfloat16_rn(q_ij);
      }
      const float gamma_last = gamma_s[group][kChunk - 1], gamma_i = gamma_s[group][col];
      const float decay_i = exp2f(gamma_i);
      rec->beta[col] = beta_s[group][col];
      rec->key_decay[col] = decay_i * rk[col];
      rec->query_scale[col] = decay_i * rq[col];
      rec->write_scale[col] = exp2f(gamma_last - gamma_i) * rk[col];
      rec->chunk_decay[col] = col == 0 ? exp2f(gamma_last) : 0.0f;
    }
    __syncthreads();  // A complete

    if (active) {
      // Column `col` of T = (I + A)^-1: t_i = [i == col] - sum_{j<i} A_ij t_j (t_j = 0 for j < col).
      float t[kChunk];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // four chains: a quarter of the dependent latency
#pragma unroll
        for (int j = 0; j < i; j += 4) {
          const float4 a4 = *reinterpret_cast<const float4*>(A + i * kChunk + j);
          sum[0] = fmaf(a4.x, t[j], sum[0]);
          if (j + 1 < i) sum[1] = fmaf(a4.y, t[j + 1], sum[1]);
          if (j + 2 < i) sum[2] = fmaf(a4.z, t[j + 2], sum[2]);
          if (j + 3 < i) sum[3] = fmaf(a4.w, t[j + 3], sum[3]);
        }
        t[i] = (i == col ? 1.0f : 0.0f) - ((sum[0] + sum[1]) + (sum[2] + sum[3]));
      }
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        const bf16 hi = __float2bfloat16_rn(t[i]);
        rec->t_hi[i * kChunk + col] = hi;
        rec->t_lo[i * kChunk + col] = __float2bfloat16_rn(t[i] - __bfloat162float(hi));
      }
    }
    __syncthreads();  // A is rewritten by the next pair of heads
  }
}

// ---- scan kernel ----
namespace scan {
constexpr int kOffK = 0;                                   // bf16 [64][kKeyRow]
constexpr int kOffQ = kOffK + kChunk * kKeyRow * 2;        // bf16 [64][kKeyRow]
constexpr int kOffV = kOffQ + kChunk * kKeyRow * 2;        // bf16 [64][kTileRow]
constexpr int kOffTHi = kOffV + kChunk * kTileRow * 2;     // bf16 [64][kChunkRow]
constexpr int kOffTLo = kOffTHi + kChunk * kChunkRow * 2;  // bf16 [64][kChunkRow]
constexpr int kOffAqk = kOffTLo + kChunk * kChunkRow * 2;  // bf16 [64][kChunkRow]
constexpr int kOffScalars = kOffAqk + kChunk * kChunkRow * 2;  // float [5][64]
constexpr int kStageBytes = kOffScalars + kRecordScalars * 4;
constexpr int kOffSHi = 2 * kStageBytes;                     // bf16 [128][kTileRow]
constexpr int kOffSLo = kOffSHi + kKeyDim * kTileRow * 2;    // bf16 [128][kTileRow]
constexpr int kOffYHi = kOffSLo + kKeyDim * kTileRow * 2;    // bf16 [64][kTileRow]
constexpr int kOffYLo = kOffYHi + kChunk * kTileRow * 2;
constexpr int kOffVn = kOffYLo + kChunk * kTileRow * 2;      // V' bf16 [64][kTileRow]
constexpr int kOffZHi = kOffVn + kChunk * kTileRow * 2;
constexpr int kOffZLo = kOffZHi + kChunk * kTileRow * 2;
constexpr int kSmemBytes = kOffZLo + kChunk * kTileRow * 2;
static_assert(kStageBytes % 16 == 0 && kSmemBytes <= 227 * 1024, "scan shared memory");
}  // namespace scan

__global__ void __launch_bounds__(kScanThreads, 1) chunk_scan_kernel(ChunkArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  // Column tiles fastest: the CTAs sharing a head's K, Q and records run side by side (L2 reuse).
  const int v0 = blockIdx.x * kTileV, h = blockIdx.y, s = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int quad_row = lane >> 2, quad_col = lane & 3;
  const int ldm_m = lane >> 3, ldm_i = lane & 7;  // ldmatrix: matrix and row this lane addresses
  const int hk = h / (a.v_heads / a.k_heads);
  const int seq_begin = a.cu_q[s], seq_end = a.cu_q[s + 1];
  const int q_len = seq_end - seq_begin;
  const bool fresh = a.kv_lens[s] == q_len;
  const int first_chunk = a.chunk_offsets[s];
  const int n_chunks = a.chunk_offsets[s + 1] - first_chunk;
  float* state = a.state + ((static_cast<int64_t>(a.slots[s]) * a.v_heads + h) * kKeyDim) * a.dv + v0;

  bf16* s_hi = reinterpret_cast<bf16*>(smem + scan::kOffSHi);
  bf16* s_lo = reinterpret_cast<bf16*>(smem + scan::kOffSLo);
  bf16* y_hi = reinterpret_cast<bf16*>(smem + scan::kOffYHi);
  bf16* y_lo = reinterpret_cast<bf16*>(smem + scan::kOffYLo);
  bf16* vn = reinterpret_cast<bf16*>(smem + scan::kOffVn);
  bf16* z_hi = reinterpret_cast<bf16*>(smem + scan::kOffZHi);
  bf16* z_lo = reinterpret_cast<bf16*>(smem + scan::kOffZLo);

  auto stage_ptr = [&](int stage, int offset) { return smem + stage * scan::kStageBytes + offset; };
  auto load_stage = [&](int ci, int stage) {
    const int r0 = seq_begin + ci * kChunk, valid = min(kChunk, seq_end - r0);
    bf16* k_s = reinterpret_cast<bf16*>(stage_ptr(stage, scan::kOffK));
    bf16* q_s = reinterpret_cast<bf16*>(stage_ptr(stage, scan::kOffQ));
    for (int idx = tid; idx < kChunk * (kKeyDim / 8); idx += kScanThreads) {
      const int r = idx >> 4, c = (idx & 15) * 8;
      const bool ok = r < valid;
      const int64_t row = r0 + (ok ? r : 0);
      attn::cp_async_16(attn::smem_address(k_s + r * kKeyRow + c), a.k + row * a.k_row + hk * a.k_head + c, ok);
      attn::cp_async_16(attn::smem_address(q_s + r * kKeyRow + c), a.q + row * a.q_row + hk * a.q_head + c, ok);
    }
    if (tid < kChunk * (kTileV / 8)) {
      const int r = tid >> 2, c = (tid & 3) * 8;
      const bool ok = r < valid;
      const int64_t row = r0 + (ok ? r : 0);
      bf16* v_s = reinterpret_cast<bf16*>(stage_ptr(stage, scan::kOffV));
      attn::cp_async_16(attn::smem_address(v_s + r * kTileRow + c), a.v + row * a.v_row + h * a.v_head + v0 + c, ok);
    }
    const ChunkRecord* rec = a.records + static_cast<int64_t>(first_chunk + ci) * a.v_heads + h;
    for (int idx = tid; idx < kChunk * (kChunk / 8); idx += kScanThreads) {
      const int r = idx >> 3, c = (idx & 7) * 8;
      attn::cp_async_16(attn::smem_address(reinterpret_cast<bf16*>(stage_ptr(stage, scan::kOffTHi)) + r * kChunkRow + c),
                        rec->t_hi + r * kChunk + c, true);
      attn::cp_async_16(attn::smem_address(reinterpret_cast<bf16*>(stage_ptr(stage, scan::kOffTLo)) + r * kChunkRow + c),
                        rec->t_lo + r * kChunk + c, true);
      attn::cp_async_16(attn::smem_address(reinterpret_cast<bf16*>(stage_ptr(stage, scan::kOffAqk)) + r * kChunkRow + c),
                        rec->aqk + r * kChunk + c, true);
    }
    if (tid < kRecordScalars / 4) {
      attn::cp_async_16(attn::smem_address(reinterpret_cast<float*>(stage_ptr(stage, scan::kOffScalars)) + tid * 4),
                        rec->beta + tid * 4, true);
    }
    attn::cp_async_commit();
  };

  // Warp roles: wl = warp % 8 picks rows, ch = warp / 8 the 16-column half of the 32-column tile.
  // The state tile: warp (wl, ch) owns dk rows 16 wl..16 wl+15, columns 16 ch..16 ch+15, as two
  // 16x8 accumulator fragments (st[e]: columns 16 ch + 8 e ..).
  const int wl = warp & 7, ch = warp >> 3;
  float st[2][4];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = wl * 16 + quad_row + hr * 8, c = ch * 16 + e * 8 + 2 * quad_col;
      float2 value = make_float2(0.0f, 0.0f);
      if (!fresh) value = *reinterpret_cast<const float2*>(state + static_cast<int64_t>(r) * a.dv + c);
      st[e][2 * hr] = value.x;
      st[e][2 * hr + 1] = value.y;
    }
  }

  const bool key_warp = wl < 4;  // step 1: K S (roles 0-3) or Q S (roles 4-7)
  const int m0 = (wl & 3) * 16;
  // ldmatrix.trans offset of the 16x16 B block (chunk rows 16 kk.., columns 16 ch..) in a kTileRow tile.
  auto b_block = [&](int kk) { return (kk * 16 + ldm_i + (ldm_m & 1) * 8) * kTileRow + ch * 16 + (ldm_m >> 1) * 8; };
  if (n_chunks > 0) load_stage(0, 0);
  for (int ci = 0; ci < n_chunks; ++ci) {
    const int stage = ci & 1;
    const int r0 = seq_begin + ci * kChunk, valid = min(kChunk, seq_end - r0);
    __syncthreads();  // every warp is done with the previous chunk (its stage, S, V', Z)
    if (ci + 1 < n_chunks) load_stage(ci + 1, stage ^ 1);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = wl * 16 + quad_row, c = ch * 16 + e * 8 + 2 * quad_col;
      store_split(s_hi, s_lo, r * kTileRow + c, st[e][0], st[e][1]);
      store_split(s_hi, s_lo, (r + 8) * kTileRow + c, st[e][2], st[e][3]);
    }
    if (ci + 1 < n_chunks) {
      attn::cp_async_wait<1>();
    } else {
      attn::cp_async_wait<0>();
    }
    __syncthreads();

    const bf16* k_s = reinterpret_cast<const bf16*>(stage_ptr(stage, scan::kOffK));
    const bf16* q_s = reinterpret_cast<const bf16*>(stage_ptr(stage, scan::kOffQ));
    const bf16* v_s = reinterpret_cast<const bf16*>(stage_ptr(stage, scan::kOffV));
    const bf16* t_hi = reinterpret_cast<const bf16*>(stage_ptr(stage, scan::kOffTHi));
    const bf16* t_lo = reinterpret_cast<const bf16*>(stage_ptr(stage, scan::kOffTLo));
    const bf16* aqk = reinterpret_cast<const bf16*>(stage_ptr(stage, scan::kOffAqk));
    const float* scalars = reinterpret_cast<const float*>(stage_ptr(stage, scan::kOffScalars));
    const float* beta = scalars;
    const float* key_decay = scalars + kChunk;
    const float* query_scale = scalars + 2 * kChunk;
    const float* write_scale = scalars + 3 * kChunk;
    const float* chunk_decay = scalars + 4 * kChunk;

    // Step 1: rows m0.. x columns 16 ch.. of K S (S as hi + lo) or Q S (S hi).
    float acc[2][4] = {};
    {
      const bf16* a_tile = key_warp ? k_s : q_s;
#pragma unroll
      for (int kk = 0; kk < kKeyDim / 16; ++kk) {
        uint32_t af[4], bf[4];
        attn::ldmatrix_x4(af, attn::smem_address(a_tile + (m0 + (lane & 15)) * kKeyRow + kk * 16 + (lane >> 4) * 8));
        attn::ldmatrix_x4_trans(bf, attn::smem_address(s_hi + b_block(kk)));
        attn::mma_bf16_16816(acc[0], af, bf[0], bf[1]);
        attn::mma_bf16_16816(acc[1], af, bf[2], bf[3]);
        if (key_warp) {
          attn::ldmatrix_x4_trans(bf, attn::smem_address(s_lo + b_block(kk)));
          attn::mma_bf16_16816(acc[0], af, bf[0], bf[1]);
          attn::mma_bf16_16816(acc[1], af, bf[2], bf[3]);
        }
      }
    }
    if (key_warp) {
      // Y = beta (V - exp(gamma) rk (K S)), split into hi + lo for the T Y product.
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = m0 + quad_row + hr * 8, c = ch * 16 + e * 8 + 2 * quad_col;
          const uint32_t vv = *reinterpret_cast<const uint32_t*>(v_s + r * kTileRow + c);
          const float b = beta[r], kd = key_decay[r];
          const float y0 = b * (bf16_bits_to_f32(vv & 0xffffu) - kd * acc[e][2 * hr]);
          const float y1 = b * (bf16_bits_to_f32(vv >> 16) - kd * acc[e][2 * hr + 1]);
          store_split(y_hi, y_lo, r * kTileRow + c, y0, y1);
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[e][j] *= query_scale[m0 + quad_row + (j >> 1) * 8];
      }
    }
    __syncthreads();

    // Step 3: V' = T Y (T lower triangular: k-tiles up to the row tile). Warp w: row tile w % 4,
    // columns 8 (w / 4) .. +7.
    {
      const int mt = warp & 3, nt = warp >> 2;
      float vacc[4] = {};
#pragma unroll
      for (int kk = 0; kk < kChunk / 16; ++kk) {
        if (kk <= mt) {
          uint32_t th[4], tl[4], yh[2], yl[2];
          const int a_offset = (mt * 16 + (lane & 15)) * kChunkRow + kk * 16 + (lane >> 4) * 8;
          attn::ldmatrix_x4(th, attn::smem_address(t_hi + a_offset));
          attn::ldmatrix_x4(tl, attn::smem_address(t_lo + a_offset));
          const int b_offset = (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kTileRow + nt * 8;
          ldmatrix_x2_trans(yh, attn::smem_address(y_hi + b_offset));
          ldmatrix_x2_trans(yl, attn::smem_address(y_lo + b_offset));
          attn::mma_bf16_16816(vacc, th, yh[0], yh[1]);
          attn::mma_bf16_16816(vacc, th, yl[0], yl[1]);
          attn::mma_bf16_16816(vacc, tl, yh[0], yh[1]);
        }
      }
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = mt * 16 + quad_row + hr * 8, c = nt * 8 + 2 * quad_col;
        const float x0 = vacc[2 * hr], x1 = vacc[2 * hr + 1];
        *reinterpret_cast<uint32_t*>(vn + r * kTileRow + c) = attn::pack_bf16x2(x0, x1);
        const float w = write_scale[r];
        store_split(z_hi, z_lo, r * kTileRow + c, w * x0, w * x1);
      }
    }
    __syncthreads();

    // Step 4 (roles 4-7): O = exp(gamma) rq (Q S) + Aqk V', stored for the valid rows.
    if (!key_warp) {
      const int mt = wl - 4;
#pragma unroll
      for (int kk = 0; kk < kChunk / 16; ++kk) {
        if (kk <= mt) {
          uint32_t af[4], bf[4];
          attn::ldmatrix_x4(af, attn::smem_address(aqk + (mt * 16 + (lane & 15)) * kChunkRow + kk * 16 + (lane >> 4) * 8));
          attn::ldmatrix_x4_trans(bf, attn::smem_address(vn + b_block(kk)));
          attn::mma_bf16_16816(acc[0], af, bf[0], bf[1]);
          attn::mma_bf16_16816(acc[1], af, bf[2], bf[3]);
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = m0 + quad_row + hr * 8;
          if (r < valid) {
            bf16* dst = a.out + static_cast<int64_t>(r0 + r) * a.out_row + static_cast<int64_t>(h) * a.out_head + v0 +
                        ch * 16 + e * 8 + 2 * quad_col;
            *reinterpret_cast<uint32_t*>(dst) = attn::pack_bf16x2(acc[e][2 * hr], acc[e][2 * hr + 1]);
          }
        }
      }
    }

    // Step 5 (all warps): S = exp(gamma_C) S + K^T Z, Z = exp(gamma_C - gamma) rk V' (hi + lo).
    const float decay = chunk_decay[0];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int j = 0; j < 4; ++j) st[e][j] *= decay;
    }
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      uint32_t af[4], bf[4];  // A = K^T: rows dk 16 wl.., columns chunk rows 16 kk..; transposed from the K tile
      attn::ldmatrix_x4_trans(
          af, attn::smem_address(k_s + (kk * 16 + ldm_i + (ldm_m >> 1) * 8) * kKeyRow + wl * 16 + (ldm_m & 1) * 8));
      attn::ldmatrix_x4_trans(bf, attn::smem_address(z_hi + b_block(kk)));
      attn::mma_bf16_16816(st[0], af, bf[0], bf[1]);
      attn::mma_bf16_16816(st[1], af, bf[2], bf[3]);
      attn::ldmatrix_x4_trans(bf, attn::smem_address(z_lo + b_block(kk)));
      attn::mma_bf16_16816(st[0], af, bf[0], bf[1]);
      attn::mma_bf16_16816(st[1], af, bf[2], bf[3]);
    }
  }

#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = wl * 16 + quad_row + hr * 8, c = ch * 16 + e * 8 + 2 * quad_col;
      *reinterpret_cast<float2*>(state + static_cast<int64_t>(r) * a.dv + c) = make_float2(st[e][2 * hr], st[e][2 * hr + 1]);
    }
  }
}

}  // namespace metrale::kernels::cuda::gdn
