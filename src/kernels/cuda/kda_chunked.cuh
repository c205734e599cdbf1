// The chunked KDA delta rule on tensor cores, for key_head_dim 128 and bf16 activations
// (glm_deepseek.md §2.5). Three launches, all reading the batch metadata on the device only:
//
//  1. offsets_kernel: chunk_offsets[s] = sum over earlier sequences of ceil(q_len / 64).
//  2. prep_kernel, one CTA per (head, chunk), all chunks in parallel: the per-channel cumulative
//     decay G (from the raw forget-gate projection), the l2-norm factors and beta; the intra-chunk
//     matrices
//       Akk_ij = beta_i sum_d k^_i k^_j exp(G_i - G_j)  (j < i),  Aqk_ij = sum_d q^_i k^_j exp(G_i - G_j)  (j <= i)
//     in 16 x 16 blocks on tensor cores, each block (I, J) with a reference row rho between its
//     row and column ranges, exp(G_i - G_j) = exp(G_i - G_rho) exp(G_rho - G_j), so that no factor
//     exceeds 1 off the diagonal (any gate) and none exceeds e^80 on it (the bounded gate with
//     lambda >= -5: |G_i - G_j| <= 16 |lambda| inside a block). Other gates compute the diagonal
//     blocks element by element in fp32 with the exact difference. Then T = (I + Akk)^-1 by 16 x 16
//     blocks (kernels/cuda/unit_lower_inverse.cuh: diagonal blocks by substitution, the others on
//     tensor cores with hi/lo operands), stored as t_hi + t_lo bf16; Aqk as bf16 (it feeds the output only).
//  3. scan_kernel, one CTA of 8 warps per (sequence, head, 64 state columns), sequential over the
//     chunks with the fp32 state tile [128, 64] in registers; the column tiles of a head pair up as
//     a cluster. Per chunk each CTA of the pair recomputes G for half of the rows from the staged
//     gate rows, forms K^ exp(G), Q^ exp(G) and K^ exp(G_C - G) (all factors <= 1) for them and
//     writes them into both CTAs' tiles (distributed shared memory), and then
//       Y  = beta (V - (K^ e^G) S)          S as s_hi + s_lo, K^ e^G as hi + lo (3 products)
//       V' = T Y                             t_hi y_hi + t_hi y_lo + t_lo y_hi
//       O  = (Q^ e^G) S + Aqk V'             s_hi and v'_hi only: output precision
//       S  = diag(e^{G_C}) S + (K^ e^{G_C - G})^T V'   hi/lo on both sides
//     which is the reference's U - W S, Q' S + Aqk V', S' + K'^T V'. The next chunk's q, k and gate
//     rows arrive by cp.async while the current one is computed.
// Products that reach the state use hi/lo bf16 splits (relative error ~2^-16), so the state tracks
// the fp32 reference to ~1e-5; the output carries bf16 operand rounding (~2e-3), below its own.
#pragma once

#include <cuda_bf16.h>

#include <cooperative_groups.h>

#include <cstdint>

#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/unit_lower_inverse.cuh"

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

__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits16) { return __uint_as_float(bits16 << 16); }
__device__ __forceinline__ float bf16_to_f32(bf16 x) { return __bfloat162float(x); }

// hi = bf16(x), lo = bf16(x - hi), as packed pairs.
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = attn::pack_bf16x2(x0, x1);
  lo = attn::pack_bf16x2(x0 - bf16_bits_to_f32(hi & 0xffffu), x1 - bf16_bits_to_f32(hi >> 16));
}
__device__ __forceinline__ void store_split(bf16* hi, bf16* lo, int offset, float x0, float x1) {
  uint32_t h, l;
  split2(x0, x1, h, l);
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

__device__ __forceinline__ int find_sequence(const int32_t* offsets, int count, int value) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (offsets[mid] <= value) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// chunk_offsets[0..S]: exclusive prefix sum of ceil(q_len / 64). One CTA of 1024 threads.
__global__ void __launch_bounds__(1024) offsets_kernel(ChunkArgs a) {
  __shared__ int warp_totals[32];
  __shared__ int carry;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    carry = 0;
    a.chunk_offsets[0] = 0;
  }
  __syncthreads();
  for (int base = 0; base < a.num_seqs; base += 1024) {
    const int s = base + static_cast<int>(threadIdx.x);
    int x = s < a.num_seqs ? (a.cu_q[s + 1] - a.cu_q[s] + kChunk - 1) / kChunk : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, offset);
      if (lane >= offset) x += y;
    }
    if (lane == 31) warp_totals[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int t = warp_totals[lane];
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, t, offset);
        if (lane >= offset) t += y;
      }
      warp_totals[lane] = t;
    }
    __syncthreads();
    const int inclusive = carry + (warp > 0 ? warp_totals[warp - 1] : 0) + x;
    if (s < a.num_seqs) a.chunk_offsets[s + 1] = inclusive;
    __syncthreads();
    if (threadIdx.x == 1023) carry = inclusive;
    __syncthreads();
  }
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

// ---- prep kernel ----
// The 16 x 16 block pairs (I, J), J <= I, of the 64 x 64 intra-chunk matrices: 0-3 the diagonal,
// then (1,0), (2,1), (3,2), (2,0), (3,1), (3,0); I and J of pair p as 4-bit fields (a run-time
// index into a local array would go to the stack).
constexpr uint64_t kPairI = 0x3323213210ull, kPairJ = 0x0102103210ull;

namespace prep {
constexpr int kTile = kChunk * kKeyDim * 2;                      // one [64][128] bf16 tile
constexpr int kOffK = 0;
constexpr int kOffQ = kOffK + kTile;
constexpr int kOffF = kOffQ + kTile;                             // gate rows, then Akk fp32 [64][64]
constexpr int kOffG = kOffF + kTile;                             // G fp32 [64][132]
constexpr int kGRow = kKeyDim + 4;
constexpr int kOffKa = kOffG + kChunk * kGRow * 4;               // off-diagonal B operands hi, lo [48][128]
constexpr int kKaTile = 48 * kKeyDim * 2;
constexpr int kOffScalars = kOffKa + 2 * kKaTile;                // beta, rk, rq [64] each
constexpr int kSmemBytes = kOffScalars + 3 * kChunk * 4;
static_assert(2 * (kSmemBytes + 1024) <= 228 * 1024, "two prep CTAs per SM (1 KiB reserved each)");
static_assert(kChunk * kChunk * 4 <= kTile, "Akk reuses the gate tile");
static_assert(2 * kSmemBytes <= 227 * 1024, "two prep CTAs per SM");
static_assert(tril::kSmemBytes <= 2 * kTile, "T and its scratch fit in the k and q tiles");
}  // namespace prep

__global__ void __launch_bounds__(kPrepThreads, 2) prep_kernel(ChunkArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int h = blockIdx.x, chunk = blockIdx.y;  // heads fastest: neighbours read neighbouring columns
  if (chunk >= a.chunk_offsets[a.num_seqs]) return;
  const int s = find_sequence(a.chunk_offsets, a.num_seqs, chunk);
  const int row0 = a.cu_q[s] + (chunk - a.chunk_offsets[s]) * kChunk;
  const int valid = min(kChunk, a.cu_q[s + 1] - row0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = lane >> 2, quad = lane & 3;

  bf16* k_tile = reinterpret_cast<bf16*>(smem + prep::kOffK);
  bf16* q_tile = reinterpret_cast<bf16*>(smem + prep::kOffQ);
  bf16* f_tile = reinterpret_cast<bf16*>(smem + prep::kOffF);
  float* akk = reinterpret_cast<float*>(smem + prep::kOffF);  // after G is built
  auto G = reinterpret_cast<float(*)[prep::kGRow]>(smem + prep::kOffG);
  bf16* ka_hi = reinterpret_cast<bf16*>(smem + prep::kOffKa);
  bf16* ka_lo = ka_hi + 48 * kKeyDim;
  float* beta_s = reinterpret_cast<float*>(smem + prep::kOffScalars);
  float* rk = beta_s + kChunk;
  float* rq = rk + kChunk;
  float* total = reinterpret_cast<float*>(smem + prep::kOffKa);  // [128], before the Ka tiles exist

  stage_rows<kPrepThreads>(k_tile, a.k + h * a.k_head, a.k_row, row0, valid);
  stage_rows<kPrepThreads>(q_tile, a.q + h * a.q_head, a.q_row, row0, valid);
  stage_rows<kPrepThreads>(f_tile, a.f + static_cast<int64_t>(h) * kKeyDim, a.f_row, row0, valid);
  attn::cp_async_commit();
  if (tid < kChunk) {
    float bt = 0.0f;
    if (tid < valid) {
      const float logit = bf16_to_f32(a.b[static_cast<int64_t>(row0 + tid) * a.b_row + h]);
      bt = bf16_to_f32(__float2bfloat16_rn(1.0f / (1.0f + expf(-logit))));  // sigmoid in the activation dtype
    }
    beta_s[tid] = bt;
  }
  attn::cp_async_wait<0>();
  __syncthreads();

  // l2-norm factors: warp w takes rows 8w..8w+7, each lane 4 consecutive elements.
  for (int i = 0; i < 8; ++i) {
    const int r = warp * 8 + i;
    const int c = lane * 4, offset = sw(r, c);
    const uint2 kr = *reinterpret_cast<const uint2*>(k_tile + offset);
    const uint2 qr = *reinterpret_cast<const uint2*>(q_tile + offset);
    float ks = 0.0f, qs = 0.0f;
    for (const uint32_t word : {kr.x, kr.y}) {
      const float x0 = bf16_bits_to_f32(word & 0xffffu), x1 = bf16_bits_to_f32(word >> 16);
      ks += x0 * x0 + x1 * x1;
    }
    for (const uint32_t word : {qr.x, qr.y}) {
      const float x0 = bf16_bits_to_f32(word & 0xffffu), x1 = bf16_bits_to_f32(word >> 16);
      qs += x0 * x0 + x1 * x1;
    }
    ks = warp_sum(ks);
    qs = warp_sum(qs);
    if (lane == 0) {
      rk[r] = r < valid ? 1.0f / sqrtf(ks + 1e-6f) : 0.0f;
      rq[r] = r < valid ? a.scale / sqrtf(qs + 1e-6f) : 0.0f;
    }
  }

  // G, channel c per thread pair.
  {
    const int c = tid & 127, half = tid >> 7;
    const float bias = load_weight(a.dt_bias, a.dt_bias_type, static_cast<int64_t>(h) * kKeyDim + c);
    const float rate = expf(load_weight(a.A_log, a.A_log_type, h));
    channel_cumsum(f_tile, c, half, valid, bias, rate, a, total, [&](int i, float g) { G[i][c] = g; });
  }
  __syncthreads();  // G, rk, rq complete; the gate tile is free (Akk lives there)

  // Off-diagonal B operands: block J rows j with the reference rho = 16 (J + 1):
  // Ka_j = k^_j exp(G_rho - G_j) <= 1, as hi + lo.
  for (int idx = tid; idx < 48 * kKeyDim / 2; idx += kPrepThreads) {
    const int j = idx / (kKeyDim / 2), c = (idx % (kKeyDim / 2)) * 2;
    const int rho = (j / 16 + 1) * 16;
    const uint32_t raw = *reinterpret_cast<const uint32_t*>(k_tile + sw(j, c));
    const float x0 = bf16_bits_to_f32(raw & 0xffffu) * rk[j] * __expf(G[rho][c] - G[j][c]);
    const float x1 = bf16_bits_to_f32(raw >> 16) * rk[j] * __expf(G[rho][c + 1] - G[j][c + 1]);
    store_split(ka_hi, ka_lo, sw(j, c), x0, x1);
  }
  for (int idx = tid; idx < kChunk * kChunk; idx += kPrepThreads) akk[idx] = 0.0f;
  __syncthreads();

  ChunkRecord* rec = a.records + static_cast<int64_t>(chunk) * a.heads + h;
  // Block pairs (I, J), J <= I: 0-3 the diagonal, then the off-diagonal ones.
  for (int pair = warp; pair < 10; pair += kPrepThreads / 32) {
    const int I = static_cast<int>((kPairI >> (4 * pair)) & 15u), J = static_cast<int>((kPairJ >> (4 * pair)) & 15u);
    const bool diagonal = I == J;
    if (diagonal && !a.safe_diagonal) {
      // Exact element-wise block: lane takes pairs (i, j) of the lower triangle, then zeros above.
      for (int p = lane; p < 16 * 16; p += 32) {
        const int i = I * 16 + p / 16, j = J * 16 + p % 16;
        float qk = 0.0f, kk = 0.0f;
        if (j <= i) {
          for (int c = 0; c < kKeyDim; ++c) {
            const float e = expf(G[i][c] - G[j][c]);
            const float kj = bf16_to_f32(k_tile[sw(j, c)]) * e;
            qk = fmaf(bf16_to_f32(q_tile[sw(i, c)]), kj, qk);
            kk = fmaf(bf16_to_f32(k_tile[sw(i, c)]), kj, kk);
          }
          qk *= rq[i] * rk[j];
          kk *= rk[i] * rk[j] * beta_s[i];
        }
        rec->aqk[i * kChunk + j] = __float2bfloat16_rn(qk);
        if (j < i) akk[i * kChunk + j] = kk;
      }
      continue;
    }
    // Reference row: the start of block J + 1 off the diagonal, the block's first row on it.
    const int rho = diagonal ? I * 16 : (J + 1) * 16;
    float acc_qk[2][4] = {}, acc_kk[2][4] = {};
#pragma unroll 2
    for (int kk = 0; kk < kKeyDim / 16; ++kk) {
      // A fragments of rows 16 I + group (+8), channels 16 kk + 2 quad (+1, +8, +9), built in
      // registers: q^_i exp(G_i - G_rho) and k^_i exp(G_i - G_rho) (hi + lo).
      uint32_t aq[4], ak_hi[4], ak_lo[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = I * 16 + group + (r & 1) * 8, c = kk * 16 + 2 * quad + (r >> 1) * 8;
        const float e0 = __expf(G[i][c] - G[rho][c]), e1 = __expf(G[i][c + 1] - G[rho][c + 1]);
        const uint32_t qraw = *reinterpret_cast<const uint32_t*>(q_tile + sw(i, c));
        const uint32_t kraw = *reinterpret_cast<const uint32_t*>(k_tile + sw(i, c));
        aq[r] = attn::pack_bf16x2(bf16_bits_to_f32(qraw & 0xffffu) * rq[i] * e0, bf16_bits_to_f32(qraw >> 16) * rq[i] * e1);
        split2(bf16_bits_to_f32(kraw & 0xffffu) * rk[i] * e0, bf16_bits_to_f32(kraw >> 16) * rk[i] * e1, ak_hi[r],
               ak_lo[r]);
      }
      uint32_t bh[4], bl[4];
      if (!diagonal) {
        // B[k = channel][n = j] from the off-diagonal operand tile (rows j as stored).
        const int m = lane >> 3, i8 = lane & 7;
        const int offset = sw(J * 16 + (m >> 1) * 8 + i8, kk * 16 + (m & 1) * 8);
        attn::ldmatrix_x4(bh, attn::smem_address(ka_hi + offset));
        attn::ldmatrix_x4(bl, attn::smem_address(ka_lo + offset));
      } else {
        // k^_j exp(G_rho - G_j) >= 1 for the block's own rows, in registers:
        // b0/b1 of n-tile nt: (channels 2 quad, +1 / +8, +9; column j = 16 J + 8 nt + group).
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int j = J * 16 + nt * 8 + group, c = kk * 16 + 2 * quad + half * 8;
            const uint32_t kraw = *reinterpret_cast<const uint32_t*>(k_tile + sw(j, c));
            const float x0 = bf16_bits_to_f32(kraw & 0xffffu) * rk[j] * __expf(G[rho][c] - G[j][c]);
            const float x1 = bf16_bits_to_f32(kraw >> 16) * rk[j] * __expf(G[rho][c + 1] - G[j][c + 1]);
            split2(x0, x1, bh[nt * 2 + half], bl[nt * 2 + half]);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        attn::mma_bf16_16816(acc_qk[nt], aq, bh[2 * nt], bh[2 * nt + 1]);
        attn::mma_bf16_16816(acc_kk[nt], ak_hi, bh[2 * nt], bh[2 * nt + 1]);
        attn::mma_bf16_16816(acc_kk[nt], ak_hi, bl[2 * nt], bl[2 * nt + 1]);
        attn::mma_bf16_16816(acc_kk[nt], ak_lo, bh[2 * nt], bh[2 * nt + 1]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int i = I * 16 + group + hr * 8, j = J * 16 + nt * 8 + 2 * quad;
        const float q0 = diagonal && j > i ? 0.0f : acc_qk[nt][2 * hr];
        const float q1 = diagonal && j + 1 > i ? 0.0f : acc_qk[nt][2 * hr + 1];
        *reinterpret_cast<uint32_t*>(rec->aqk + i * kChunk + j) = attn::pack_bf16x2(q0, q1);
        if (!diagonal || j < i) akk[i * kChunk + j] = acc_kk[nt][2 * hr] * beta_s[i];
        if (!diagonal || j + 1 < i) akk[i * kChunk + j + 1] = acc_kk[nt][2 * hr + 1] * beta_s[i];
      }
    }
  }
  __syncthreads();  // Akk complete

  // T = (I + Akk)^-1 into the k and q tiles, free now.
  float* t_full = reinterpret_cast<float*>(smem + prep::kOffK);
  tril::invert_unit_lower<kPrepThreads>(akk, kChunk, t_full, t_full + kChunk * tril::kTPitch);
  // Rows of T as hi + lo, 8 columns per 16-byte store; the blocks above the diagonal are zero.
  for (int idx = tid; idx < kChunk * (kChunk / 8); idx += kPrepThreads) {
    const int i = idx >> 3, c0 = (idx & 7) * 8;
    uint32_t hi[4], lo[4];
    const bool below = c0 / 16 <= i / 16;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 x = below ? *reinterpret_cast<const float2*>(t_full + i * tril::kTPitch + c0 + 2 * e) : make_float2(0.0f, 0.0f);
      split2(x.x, x.y, hi[e], lo[e]);
    }
    *reinterpret_cast<uint4*>(rec->t_hi + i * kChunk + c0) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(rec->t_lo + i * kChunk + c0) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
  if (tid < kChunk) {
    rec->beta[tid] = beta_s[tid];
    rec->rk[tid] = rk[tid];
    rec->rq[tid] = rq[tid];
  }
}

// ---- scan kernel ----
namespace scan {
constexpr int kTile = kChunk * kKeyDim * 2;                 // [64][128] bf16, swizzled
constexpr int kPadTile = kChunk * kPadRow * 2;              // [64][72] bf16
constexpr int kOffScalarsInStage = 3 * kTile;               // beta, rk, rq [64] each
constexpr int kStageBytes = kOffScalarsInStage + 3 * kChunk * 4;
constexpr int kOffStage = 0;                                // 2 stages: k, q, gate rows, scalars
constexpr int kOffV = 2 * kStageBytes;                      // v tile [64][72]
constexpr int kOffTHi = kOffV + kPadTile;                   // [64][72]
constexpr int kOffTLo = kOffTHi + kPadTile;
constexpr int kOffAqk = kOffTLo + kPadTile;
constexpr int kOffKdLo = kOffAqk + kPadTile;                // (K^ e^G)_lo [64][128]
constexpr int kOffKuLo = kOffKdLo + kTile;                  // (K^ e^{G_C - G})_lo [64][128]
constexpr int kOffSHi = kOffKuLo + kTile;                   // [128][72]
constexpr int kOffSLo = kOffSHi + kKeyDim * kPadRow * 2;
constexpr int kOffYHi = kOffSLo + kKeyDim * kPadRow * 2;    // Y, then V' [64][72]
constexpr int kOffYLo = kOffYHi + kPadTile;
constexpr int kOffTotal = kOffYHi;  // float [2][16][128] + [2][128] in the Y tiles' space (free during step 0)
constexpr int kOffDecay = kOffYLo + kPadTile;               // exp(G_C) [128], then G_C [128]
constexpr int kSmemBytes = kOffDecay + 2 * kKeyDim * 4;
static_assert((2 * 16 + 2) * kKeyDim * 4 <= 2 * kPadTile && kOffYLo == kOffYHi + kPadTile,
              "the row-group sums and their exclusive sums fit in the two Y tiles");
static_assert(kStageBytes % 16 == 0 && kSmemBytes <= 227 * 1024, "scan shared memory");
}  // namespace scan

__global__ void __launch_bounds__(kScanThreads, 1) scan_kernel(ChunkArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  // Column tiles fastest: the CTAs sharing a head's rows and records run side by side (L2 reuse).
  const int v0 = blockIdx.x * kTileV, h = blockIdx.y, s = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = lane >> 2, quad = lane & 3;
  const int ldm_m = lane >> 3, ldm_i = lane & 7;
  const int seq_begin = a.cu_q[s], seq_end = a.cu_q[s + 1];
  const int q_len = seq_end - seq_begin;
  const int slot = a.slots[s];
  const bool fresh = a.kv_lens[s] == q_len || slot < 0;
  const int first_chunk = a.chunk_offsets[s];
  const int n_chunks = a.chunk_offsets[s + 1] - first_chunk;
  float* state = slot < 0 ? nullptr : a.state + ((static_cast<int64_t>(slot) * a.heads + h) * kKeyDim) * a.dv + v0;

  bf16* v_s = reinterpret_cast<bf16*>(smem + scan::kOffV);
  bf16* t_hi = reinterpret_cast<bf16*>(smem + scan::kOffTHi);
  bf16* t_lo = reinterpret_cast<bf16*>(smem + scan::kOffTLo);
  bf16* aqk = reinterpret_cast<bf16*>(smem + scan::kOffAqk);
  bf16* kd_lo = reinterpret_cast<bf16*>(smem + scan::kOffKdLo);
  bf16* ku_lo = reinterpret_cast<bf16*>(smem + scan::kOffKuLo);
  bf16* s_hi = reinterpret_cast<bf16*>(smem + scan::kOffSHi);
  bf16* s_lo = reinterpret_cast<bf16*>(smem + scan::kOffSLo);
  bf16* y_hi = reinterpret_cast<bf16*>(smem + scan::kOffYHi);
  bf16* y_lo = reinterpret_cast<bf16*>(smem + scan::kOffYLo);
  // The column tiles of a head form a cluster of up to 2 CTAs that share step 0: each transforms
  // half of the chunk's rows and writes them into both CTAs' tiles (distributed shared memory).
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int csize = static_cast<int>(cluster.num_blocks()), crank = static_cast<int>(cluster.block_rank());
  const int own_rows = kChunk / csize, row_base = crank * own_rows;
  const int peer = crank ^ 1;
  float* totals = reinterpret_cast<float*>(smem + scan::kOffTotal);  // [16 row groups][128] of this CTA
  float* offsets = totals + 16 * kKeyDim;                            // [16][128] exclusive sums
  float* half_totals = offsets + 16 * kKeyDim;                       // [128] sum over this CTA's rows
  float* head_offset = half_totals + kKeyDim;                        // [128] sum over the rows before them
  float* chunk_decay = reinterpret_cast<float*>(smem + scan::kOffDecay);
  float* last_s = chunk_decay + kKeyDim;
  auto stage_base = [&](int stage) { return smem + scan::kOffStage + stage * scan::kStageBytes; };

  // The double-buffered part: this CTA's share of the raw k, q and gate rows (the cluster peer
  // stages and transforms the others), and all of the record's row scalars.
  auto load_stage = [&](int ci, int stage) {
    const int r0 = seq_begin + ci * kChunk, valid = min(kChunk, seq_end - r0);
    unsigned char* base = stage_base(stage);
    stage_rows<kScanThreads>(reinterpret_cast<bf16*>(base), a.k + h * a.k_head, a.k_row, r0, valid, row_base, own_rows);
    stage_rows<kScanThreads>(reinterpret_cast<bf16*>(base + scan::kTile), a.q + h * a.q_head, a.q_row, r0, valid,
                             row_base, own_rows);
    stage_rows<kScanThreads>(reinterpret_cast<bf16*>(base + 2 * scan::kTile), a.f + static_cast<int64_t>(h) * kKeyDim,
                             a.f_row, r0, valid, row_base, own_rows);
    const ChunkRecord* rec = a.records + static_cast<int64_t>(first_chunk + ci) * a.heads + h;
    if (tid < 3 * kChunk / 4) {
      attn::cp_async_16(attn::smem_address(base + scan::kOffScalarsInStage + tid * 16), rec->beta + tid * 4, true);
    }
    attn::cp_async_commit();
  };
  // The single-buffered part: v columns, T and Aqk.
  auto load_matrices = [&](int ci) {
    const int r0 = seq_begin + ci * kChunk, valid = min(kChunk, seq_end - r0);
    for (int idx = tid; idx < kChunk * (kTileV / 8); idx += kScanThreads) {
      const int r = idx >> 3, c = (idx & 7) * 8;
      const bool ok = r < valid;
      attn::cp_async_16(attn::smem_address(v_s + r * kPadRow + c),
                        a.v + static_cast<int64_t>(r0 + (ok ? r : 0)) * a.v_row + h * a.v_head + v0 + c, ok);
    }
    const ChunkRecord* rec = a.records + static_cast<int64_t>(first_chunk + ci) * a.heads + h;
    for (int idx = tid; idx < kChunk * (kChunk / 8); idx += kScanThreads) {
      const int r = idx >> 3, c = (idx & 7) * 8;
      attn::cp_async_16(attn::smem_address(t_hi + r * kPadRow + c), rec->t_hi + r * kChunk + c, true);
      attn::cp_async_16(attn::smem_address(t_lo + r * kPadRow + c), rec->t_lo + r * kChunk + c, true);
      attn::cp_async_16(attn::smem_address(aqk + r * kPadRow + c), rec->aqk + r * kChunk + c, true);
    }
    attn::cp_async_commit();
  };

  // The state tile: warp w owns dk rows 16w..16w+15, all 64 columns, as 8 fragments of 16 x 8.
  float st[8][4];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = warp * 16 + group + hr * 8, c = e * 8 + 2 * quad;
      float2 value = make_float2(0.0f, 0.0f);
      if (!fresh) value = *reinterpret_cast<const float2*>(state + static_cast<int64_t>(r) * a.dv + c);
      st[e][2 * hr] = value.x;
      st[e][2 * hr + 1] = value.y;
    }
  }
  const int c8 = tid & 15, rg = tid >> 4;  // step 0: channels 8 c8.., rows 4 rg..
  float bias8[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) bias8[e] = load_weight(a.dt_bias, a.dt_bias_type, static_cast<int64_t>(h) * kKeyDim + c8 * 8 + e);
  const float rate = expf(load_weight(a.A_log, a.A_log_type, h));
  const int mt = warp & 3, ch = warp >> 2;  // steps 1-4: rows 16 mt.., columns 32 ch..
  auto b_block = [&](const bf16* tile, int kk, int col0) {
    return attn::smem_address(tile + (kk * 16 + ldm_i + (ldm_m & 1) * 8) * kPadRow + col0 + (ldm_m >> 1) * 8);
  };

  if (n_chunks > 0) load_stage(0, 0);
  for (int ci = 0; ci < n_chunks; ++ci) {
    const int stage = ci & 1;
    const int r0 = seq_begin + ci * kChunk, valid = min(kChunk, seq_end - r0);
    __syncthreads();  // every warp is done with the previous chunk's buffers
    load_matrices(ci);
    if (ci + 1 < n_chunks) {
      load_stage(ci + 1, stage ^ 1);
    } else {
      attn::cp_async_commit();  // an empty group keeps the counts below aligned
    }
    // S -> shared as hi + lo (the B operand of step 1).
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int r = warp * 16 + group, c = e * 8 + 2 * quad;
      store_split(s_hi, s_lo, r * kPadRow + c, st[e][0], st[e][1]);
      store_split(s_hi, s_lo, (r + 8) * kPadRow + c, st[e][2], st[e][3]);
    }
    attn::cp_async_wait<2>();  // this chunk's stage (the oldest group)
    __syncthreads();

    unsigned char* base = stage_base(stage);
    bf16* kd_hi = reinterpret_cast<bf16*>(base);                 // raw k, then (K^ e^G)_hi
    bf16* qd = reinterpret_cast<bf16*>(base + scan::kTile);      // raw q, then Q^ e^G
    bf16* ku_hi = reinterpret_cast<bf16*>(base + 2 * scan::kTile);  // gate rows, then (K^ e^{G_C - G})_hi
    const float* beta = reinterpret_cast<const float*>(base + scan::kOffScalarsInStage);
    const float* rk = beta + kChunk;
    const float* rq = rk + kChunk;

    // Step 0: G and the decayed operands of this CTA's rows, in place and in the peer's tiles.
    // Thread (rg, c8) takes R = 4 / csize consecutive rows of row group rg and channels
    // 8 c8 .. 8 c8 + 7 with 16-byte accesses; the cumulative sums meet through `totals`.
    {
      const int R = 4 / csize;
      float G[4][8];
      float running[8] = {};
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (r < R) {
          const int i = row_base + rg * R + r;
          const uint4 raw = *reinterpret_cast<const uint4*>(ku_hi + sw(i, c8 * 8));
          const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float f = bf16_bits_to_f32(e & 1 ? words[e >> 1] >> 16 : words[e >> 1] & 0xffffu);
            const float g = i < valid ? forget_gate(f + bias8[e], rate, a.has_lower_bound, a.lower_bound) : 0.0f;
            running[e] += g;
            G[r][e] = running[e];
          }
        }
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) totals[rg * kKeyDim + c8 * 8 + e] = running[e];
      __syncthreads();
      if (tid < kKeyDim) {  // exclusive scan over this CTA's 16 row groups of channel tid
        float sum = 0.0f;
#pragma unroll
        for (int g = 0; g < 16; ++g) {
          const float v = totals[g * kKeyDim + tid];
          offsets[g * kKeyDim + tid] = sum;
          sum += v;
        }
        half_totals[tid] = sum;
      }
      cluster.sync();  // both CTAs' half sums written (and each past its previous chunk)
      if (tid < kKeyDim) {
        // Rank 0 holds the chunk's first rows. One remote load per channel; both CTAs add the two
        // halves in either order and get the same G_C (addition commutes).
        const float own = half_totals[tid];
        const float other = csize > 1 ? cluster.map_shared_rank(half_totals, peer)[tid] : 0.0f;
        head_offset[tid] = crank == 1 ? other : 0.0f;
        const float sum = own + other;
        last_s[tid] = sum;
        chunk_decay[tid] = __expf(sum);
      }
      __syncthreads();
      float offset[8], last[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        offset[e] = offsets[rg * kKeyDim + c8 * 8 + e] + head_offset[c8 * 8 + e];
        last[e] = last_s[c8 * 8 + e];
      }
      bf16* kd_hi_peer = csize > 1 ? cluster.map_shared_rank(kd_hi, peer) : nullptr;
      bf16* kd_lo_peer = csize > 1 ? cluster.map_shared_rank(kd_lo, peer) : nullptr;
      bf16* ku_hi_peer = csize > 1 ? cluster.map_shared_rank(ku_hi, peer) : nullptr;
      bf16* ku_lo_peer = csize > 1 ? cluster.map_shared_rank(ku_lo, peer) : nullptr;
      bf16* qd_peer = csize > 1 ? cluster.map_shared_rank(qd, peer) : nullptr;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        if (r < R) {
          const int i = row_base + rg * R + r, at = sw(i, c8 * 8);
          const uint4 kraw = *reinterpret_cast<const uint4*>(kd_hi + at);
          const uint4 qraw = *reinterpret_cast<const uint4*>(qd + at);
          const uint32_t kw[4] = {kraw.x, kraw.y, kraw.z, kraw.w}, qw[4] = {qraw.x, qraw.y, qraw.z, qraw.w};
          uint32_t kdh[4], kdl[4], kuh[4], kul[4], qdv[4];
#pragma unroll
          for (int e2 = 0; e2 < 4; ++e2) {
            float kdec[2], kupd[2], qdec[2];
#pragma unroll
            for (int b = 0; b < 2; ++b) {
              const int e = 2 * e2 + b;
              // Both factors are <= 1 and feed bf16 hi/lo operands: the fast exponential's ~1e-6
              // relative error stays below the products' own rounding.
              const float g = G[r][e] + offset[e];
              const float e1 = __expf(g), e2f = __expf(last[e] - g);
              const float kv = bf16_bits_to_f32(b ? kw[e2] >> 16 : kw[e2] & 0xffffu) * rk[i];
              const float qv = bf16_bits_to_f32(b ? qw[e2] >> 16 : qw[e2] & 0xffffu) * rq[i];
              kdec[b] = kv * e1;
              kupd[b] = kv * e2f;
              qdec[b] = qv * e1;
            }
            split2(kdec[0], kdec[1], kdh[e2], kdl[e2]);
            split2(kupd[0], kupd[1], kuh[e2], kul[e2]);
            qdv[e2] = attn::pack_bf16x2(qdec[0], qdec[1]);
          }
          const uint4 vkdh = make_uint4(kdh[0], kdh[1], kdh[2], kdh[3]), vkdl = make_uint4(kdl[0], kdl[1], kdl[2], kdl[3]);
          const uint4 vkuh = make_uint4(kuh[0], kuh[1], kuh[2], kuh[3]), vkul = make_uint4(kul[0], kul[1], kul[2], kul[3]);
          const uint4 vqd = make_uint4(qdv[0], qdv[1], qdv[2], qdv[3]);
          *reinterpret_cast<uint4*>(kd_hi + at) = vkdh;
          *reinterpret_cast<uint4*>(kd_lo + at) = vkdl;
          *reinterpret_cast<uint4*>(ku_hi + at) = vkuh;
          *reinterpret_cast<uint4*>(ku_lo + at) = vkul;
          *reinterpret_cast<uint4*>(qd + at) = vqd;
          if (csize > 1) {
            *reinterpret_cast<uint4*>(kd_hi_peer + at) = vkdh;
            *reinterpret_cast<uint4*>(kd_lo_peer + at) = vkdl;
            *reinterpret_cast<uint4*>(ku_hi_peer + at) = vkuh;
            *reinterpret_cast<uint4*>(ku_lo_peer + at) = vkul;
            *reinterpret_cast<uint4*>(qd_peer + at) = vqd;
          }
        }
      }
      // The peer's rows have arrived (and the peer has read this CTA's sums): every tile is whole.
      cluster.sync();
    }
    attn::cp_async_wait<1>();  // v, T and Aqk of this chunk
    __syncthreads();

    // Step 1: KS = (K^ e^G) S (3 products) and QS = (Q^ e^G) s_hi for rows 16 mt.., columns 32 ch..
    float ks[4][4] = {}, qs[4][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKeyDim / 16; ++kk) {
      uint32_t akh[4], akl[4], aq[4];
      const int offset = sw(mt * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8);
      attn::ldmatrix_x4(akh, attn::smem_address(kd_hi + offset));
      attn::ldmatrix_x4(akl, attn::smem_address(kd_lo + offset));
      attn::ldmatrix_x4(aq, attn::smem_address(qd + offset));
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t bh[4], bl[4];
        attn::ldmatrix_x4_trans(bh, b_block(s_hi, kk, ch * 32 + np * 16));
        attn::ldmatrix_x4_trans(bl, b_block(s_lo, kk, ch * 32 + np * 16));
#pragma unroll
        for (int q2 = 0; q2 < 2; ++q2) {
          float(&acc)[4] = ks[np * 2 + q2];
          attn::mma_bf16_16816(acc, akh, bh[2 * q2], bh[2 * q2 + 1]);
          attn::mma_bf16_16816(acc, akh, bl[2 * q2], bl[2 * q2 + 1]);
          attn::mma_bf16_16816(acc, akl, bh[2 * q2], bh[2 * q2 + 1]);
          attn::mma_bf16_16816(qs[np * 2 + q2], aq, bh[2 * q2], bh[2 * q2 + 1]);
        }
      }
    }
    // Y = beta (V - KS), split for T Y.
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = mt * 16 + group + hr * 8, c = ch * 32 + n * 8 + 2 * quad;
        const uint32_t vv = *reinterpret_cast<const uint32_t*>(v_s + r * kPadRow + c);
        const float y0 = beta[r] * (bf16_bits_to_f32(vv & 0xffffu) - ks[n][2 * hr]);
        const float y1 = beta[r] * (bf16_bits_to_f32(vv >> 16) - ks[n][2 * hr + 1]);
        store_split(y_hi, y_lo, r * kPadRow + c, y0, y1);
      }
    }
    __syncthreads();

    // Step 2: V' = T Y (T lower triangular: k-tiles up to the row tile).
    float vacc[4][4] = {};
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      if (kk <= mt) {
        uint32_t th[4], tl[4];
        const int offset = (mt * 16 + (lane & 15)) * kPadRow + kk * 16 + (lane >> 4) * 8;
        attn::ldmatrix_x4(th, attn::smem_address(t_hi + offset));
        attn::ldmatrix_x4(tl, attn::smem_address(t_lo + offset));
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t yh[4], yl[4];
          attn::ldmatrix_x4_trans(yh, b_block(y_hi, kk, ch * 32 + np * 16));
          attn::ldmatrix_x4_trans(yl, b_block(y_lo, kk, ch * 32 + np * 16));
#pragma unroll
          for (int q2 = 0; q2 < 2; ++q2) {
            float(&acc)[4] = vacc[np * 2 + q2];
            attn::mma_bf16_16816(acc, th, yh[2 * q2], yh[2 * q2 + 1]);
            attn::mma_bf16_16816(acc, th, yl[2 * q2], yl[2 * q2 + 1]);
            attn::mma_bf16_16816(acc, tl, yh[2 * q2], yh[2 * q2 + 1]);
          }
        }
      }
    }
    __syncthreads();  // every warp has read Y: its buffer takes V'
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = mt * 16 + group + hr * 8, c = ch * 32 + n * 8 + 2 * quad;
        store_split(y_hi, y_lo, r * kPadRow + c, vacc[n][2 * hr], vacc[n][2 * hr + 1]);
      }
    }
    __syncthreads();

    // Step 3: O = QS + Aqk V'_hi, stored for the valid rows.
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      if (kk <= mt) {
        uint32_t af[4];
        attn::ldmatrix_x4(af, attn::smem_address(aqk + (mt * 16 + (lane & 15)) * kPadRow + kk * 16 + (lane >> 4) * 8));
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bf[4];
          attn::ldmatrix_x4_trans(bf, b_block(y_hi, kk, ch * 32 + np * 16));
          attn::mma_bf16_16816(qs[np * 2], af, bf[0], bf[1]);
          attn::mma_bf16_16816(qs[np * 2 + 1], af, bf[2], bf[3]);
        }
      }
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = mt * 16 + group + hr * 8;
        if (r < valid) {
          bf16* dst = a.out + static_cast<int64_t>(r0 + r) * a.out_row + static_cast<int64_t>(h) * a.out_head + v0 +
                      ch * 32 + n * 8 + 2 * quad;
          *reinterpret_cast<uint32_t*>(dst) = attn::pack_bf16x2(qs[n][2 * hr], qs[n][2 * hr + 1]);
        }
      }
    }

    // Step 4 (all warps): S = diag(e^{G_C}) S + (K^ e^{G_C - G})^T V' (hi/lo on both sides).
    const float decay0 = chunk_decay[warp * 16 + group], decay1 = chunk_decay[warp * 16 + group + 8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      st[e][0] *= decay0;
      st[e][1] *= decay0;
      st[e][2] *= decay1;
      st[e][3] *= decay1;
    }
#pragma unroll
    for (int kk = 0; kk < kChunk / 16; ++kk) {
      uint32_t ah[4], al[4];  // A = (K_upd)^T: rows dk 16 w.., columns chunk rows 16 kk..
      const int offset = sw(kk * 16 + ldm_i + (ldm_m >> 1) * 8, warp * 16 + (ldm_m & 1) * 8);
      attn::ldmatrix_x4_trans(ah, attn::smem_address(ku_hi + offset));
      attn::ldmatrix_x4_trans(al, attn::smem_address(ku_lo + offset));
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bh[4], bl[4];
        attn::ldmatrix_x4_trans(bh, b_block(y_hi, kk, np * 16));
        attn::ldmatrix_x4_trans(bl, b_block(y_lo, kk, np * 16));
#pragma unroll
        for (int q2 = 0; q2 < 2; ++q2) {
          float(&acc)[4] = st[np * 2 + q2];
          attn::mma_bf16_16816(acc, ah, bh[2 * q2], bh[2 * q2 + 1]);
          attn::mma_bf16_16816(acc, ah, bl[2 * q2], bl[2 * q2 + 1]);
          attn::mma_bf16_16816(acc, al, bh[2 * q2], bh[2 * q2 + 1]);
        }
      }
    }
  }
  attn::cp_async_wait<0>();
  if (state == nullptr) return;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = warp * 16 + group + hr * 8, c = e * 8 + 2 * quad;
      *reinterpret_cast<float2*>(state + static_cast<int64_t>(r) * a.dv + c) = make_float2(st[e][2 * hr], st[e][2 * hr + 1]);
    }
  }
}

}  // namespace metrale::kernels::cuda::kda
