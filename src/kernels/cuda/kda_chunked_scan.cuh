// Step 3 of the chunked KDA (kda_chunked.cuh): the scan kernel, sequential over each sequence's
// chunks with the state tile in registers, column tiles of a head paired as a cluster.
#pragma once

#include <cooperative_groups.h>

#include "kernels/cuda/kda_chunked_common.cuh"

namespace metrale::kernels::cuda::kda {

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
            attn::split_bf16x2(kdec[0], kdec[1], kdh[e2], kdl[e2]);
            attn::split_bf16x2(kupd[0], kupd[1], kuh[e2], kul[e2]);
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

    // Step 2: V' = T Y (T lower triangular: row tile m takes k-tiles 0..m). Warp w computes the
    // 16 columns 16 (w & 3).. of row tiles {0, 3} (w < 4) or {1, 2}: five k-tiles for every warp
    // and every SMSP (warps w and w + 4 share one), where step 1's layout would give the warps of
    // row tile 3 four times the work of those of row tile 0.
    {
      const int n16 = warp & 3, m_first = warp < 4 ? 0 : 1;
      float vacc[2][2][4] = {};
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int m = t == 0 ? m_first : 3 - m_first;
#pragma unroll
        for (int kk = 0; kk < kChunk / 16; ++kk) {
          if (kk <= m) {
            uint32_t th[4], tl[4], yh[4], yl[4];
            const int offset = (m * 16 + (lane & 15)) * kPadRow + kk * 16 + (lane >> 4) * 8;
            attn::ldmatrix_x4(th, attn::smem_address(t_hi + offset));
            attn::ldmatrix_x4(tl, attn::smem_address(t_lo + offset));
            attn::ldmatrix_x4_trans(yh, b_block(y_hi, kk, n16 * 16));
            attn::ldmatrix_x4_trans(yl, b_block(y_lo, kk, n16 * 16));
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              float(&acc)[4] = vacc[t][nt];
              attn::mma_bf16_16816(acc, th, yh[2 * nt], yh[2 * nt + 1]);
              attn::mma_bf16_16816(acc, th, yl[2 * nt], yl[2 * nt + 1]);
              attn::mma_bf16_16816(acc, tl, yh[2 * nt], yh[2 * nt + 1]);
            }
          }
        }
      }
      __syncthreads();  // every warp has read Y: its buffer takes V'
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int m = t == 0 ? m_first : 3 - m_first;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const int r = m * 16 + group + hr * 8, c = n16 * 16 + nt * 8 + 2 * quad;
            store_split(y_hi, y_lo, r * kPadRow + c, vacc[t][nt][2 * hr], vacc[t][nt][2 * hr + 1]);
          }
        }
      }
      __syncthreads();
    }

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
