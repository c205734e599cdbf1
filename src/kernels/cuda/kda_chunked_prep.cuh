// Step 2 of the chunked KDA (kda_chunked.cuh): the per-(chunk, head) prep kernel, every chunk in
// parallel.
#pragma once

#include "kernels/cuda/kda_chunked_common.cuh"
#include "kernels/cuda/unit_lower_inverse.cuh"

namespace metrale::kernels::cuda::kda {

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
  const int s = sequence_of(a.chunk_offsets, a.num_seqs, chunk);
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

  ChunkRecord* rec = a.records + static_cast<int64_t>(chunk) * a.heads + h;
  // G for the scan, which forms the decayed operands from it (16-byte pieces, coalesced).
  for (int idx = tid; idx < kChunk * (kKeyDim / 4); idx += kPrepThreads) {
    const int i = idx / (kKeyDim / 4), c = (idx % (kKeyDim / 4)) * 4;
    *reinterpret_cast<float4*>(rec->g + i * kKeyDim + c) = *reinterpret_cast<const float4*>(&G[i][c]);
  }

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

  // Block pairs (I, J), J <= I: 0-3 the diagonal, then the off-diagonal ones. A diagonal pair
  // builds both of its operands from exponentials (or runs element by element), about twice an
  // off-diagonal one: warps 0-3 take one diagonal pair each, warps 4-7 the six off-diagonal pairs
  // (4 and 5 take two), instead of warps 0 and 1 carrying a diagonal and an off-diagonal pair.
  static_assert(kPrepThreads == 256, "the pair assignment is written for 8 warps");
  for (int n = 0; n < 2; ++n) {
    const int pair = n == 0 ? warp : (warp == 4 ? 9 : warp == 5 ? 8 : -1);
    if (pair < 0) break;
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
        attn::split_bf16x2(bf16_bits_to_f32(kraw & 0xffffu) * rk[i] * e0, bf16_bits_to_f32(kraw >> 16) * rk[i] * e1, ak_hi[r],
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
            attn::split_bf16x2(x0, x1, bh[nt * 2 + half], bl[nt * 2 + half]);
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
      attn::split_bf16x2(x.x, x.y, hi[e], lo[e]);
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
}  // namespace metrale::kernels::cuda::kda
