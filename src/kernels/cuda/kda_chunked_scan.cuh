// Step 3 of the chunked KDA (kda_chunked.cuh): the scan kernel, sequential over each sequence's
// chunks with the state tile in registers.
#pragma once

#include "kernels/cuda/kda_chunked_common.cuh"

namespace metrale::kernels::cuda::kda {

namespace scan {
constexpr int kTile = kChunk * kKeyDim * 2;                 // [64][128] bf16, swizzled
constexpr int kPadTile = kChunk * kPadRow * 2;              // [64][72] bf16
constexpr int kGTile = kChunk * kKeyDim * 4;                // G [64][128] f32 (g_chunk), then ku hi + lo
constexpr int kOffScalarsInStage = kGTile;                  // beta, rk, rq [64] each
constexpr int kStageBytes = kOffScalarsInStage + 3 * kChunk * 4;
constexpr int kOffStage = 0;                                // 2 stages: G and the row scalars
constexpr int kOffK = 2 * kStageBytes;                      // raw k, then (K^ e^G)_hi
constexpr int kOffQ = kOffK + kTile;                        // raw q, then Q^ e^G
constexpr int kOffKdLo = kOffQ + kTile;                     // (K^ e^G)_lo
constexpr int kOffV = kOffKdLo + kTile;                     // v tile [64][72]
constexpr int kOffTHi = kOffV + kPadTile;                   // [64][72]
constexpr int kOffTLo = kOffTHi + kPadTile;
constexpr int kOffAqk = kOffTLo + kPadTile;
constexpr int kOffSHi = kOffAqk + kPadTile;                 // [128][72]
constexpr int kOffSLo = kOffSHi + kKeyDim * kPadRow * 2;
constexpr int kOffYHi = kOffSLo + kKeyDim * kPadRow * 2;    // Y, then V' [64][72]
constexpr int kOffYLo = kOffYHi + kPadTile;
constexpr int kOffDecay = kOffYLo + kPadTile;               // exp(G_C) [128]
constexpr int kSmemBytes = kOffDecay + kKeyDim * 4;
static_assert(2 * kTile == kGTile, "K^ e^{G_C - G} hi and lo take the place of G");
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

  bf16* kd_hi = reinterpret_cast<bf16*>(smem + scan::kOffK);  // raw k, then (K^ e^G)_hi
  bf16* qd = reinterpret_cast<bf16*>(smem + scan::kOffQ);     // raw q, then Q^ e^G
  bf16* kd_lo = reinterpret_cast<bf16*>(smem + scan::kOffKdLo);
  bf16* v_s = reinterpret_cast<bf16*>(smem + scan::kOffV);
  bf16* t_hi = reinterpret_cast<bf16*>(smem + scan::kOffTHi);
  bf16* t_lo = reinterpret_cast<bf16*>(smem + scan::kOffTLo);
  bf16* aqk = reinterpret_cast<bf16*>(smem + scan::kOffAqk);
  bf16* s_hi = reinterpret_cast<bf16*>(smem + scan::kOffSHi);
  bf16* s_lo = reinterpret_cast<bf16*>(smem + scan::kOffSLo);
  bf16* y_hi = reinterpret_cast<bf16*>(smem + scan::kOffYHi);
  bf16* y_lo = reinterpret_cast<bf16*>(smem + scan::kOffYLo);
  float* chunk_decay = reinterpret_cast<float*>(smem + scan::kOffDecay);
  auto stage_base = [&](int stage) { return smem + scan::kOffStage + stage * scan::kStageBytes; };
  auto record = [&](int ci) { return a.records + static_cast<int64_t>(first_chunk + ci) * a.heads + h; };

  // Three cp.async groups per chunk, each issued as soon as its buffers are free, so that every
  // load has most of a chunk to land: at the top of chunk ci, G and the row scalars of chunk ci + 1
  // (double-buffered: the other stage's G became the K^ e^{G_C - G} that step 4 of chunk ci - 1
  // read) with Aqk of chunk ci (read in step 3); after step 1, the raw k and q rows of chunk ci + 1;
  // after step 2, its v columns and T. In order: ..., GA(ci), KQ(ci + 1), VT(ci + 1), GA(ci + 1), ...
  auto load_g = [&](int ci, int stage) {
    unsigned char* base = stage_base(stage);
    const ChunkRecord* rec = record(ci);
    for (int idx = tid; idx < kChunk * (kKeyDim / 4); idx += kScanThreads) {
      const int r = idx >> 5, c16 = idx & 31;
      attn::cp_async_16(attn::smem_address(base + r * kKeyDim * 4 + g_chunk(c16) * 16), rec->g + r * kKeyDim + c16 * 4,
                        true);
    }
    if (tid < 3 * kChunk / 4) {
      attn::cp_async_16(attn::smem_address(base + scan::kOffScalarsInStage + tid * 16), rec->beta + tid * 4, true);
    }
  };
  auto load_aqk = [&](int ci) {
    const ChunkRecord* rec = record(ci);
    for (int idx = tid; idx < kChunk * (kChunk / 8); idx += kScanThreads) {
      const int r = idx >> 3, c = (idx & 7) * 8;
      attn::cp_async_16(attn::smem_address(aqk + r * kPadRow + c), rec->aqk + r * kChunk + c, true);
    }
  };
  auto load_kq = [&](int ci) {
    const int r0 = seq_begin + ci * kChunk, valid = min(kChunk, seq_end - r0);
    stage_rows<kScanThreads>(kd_hi, a.k + h * a.k_head, a.k_row, r0, valid);
    stage_rows<kScanThreads>(qd, a.q + h * a.q_head, a.q_row, r0, valid);
  };
  auto load_vt = [&](int ci) {
    const int r0 = seq_begin + ci * kChunk, valid = min(kChunk, seq_end - r0);
    for (int idx = tid; idx < kChunk * (kTileV / 8); idx += kScanThreads) {
      const int r = idx >> 3, c = (idx & 7) * 8;
      const bool ok = r < valid;
      attn::cp_async_16(attn::smem_address(v_s + r * kPadRow + c),
                        a.v + static_cast<int64_t>(r0 + (ok ? r : 0)) * a.v_row + h * a.v_head + v0 + c, ok);
    }
    const ChunkRecord* rec = record(ci);
    for (int idx = tid; idx < kChunk * (kChunk / 8); idx += kScanThreads) {
      const int r = idx >> 3, c = (idx & 7) * 8;
      attn::cp_async_16(attn::smem_address(t_hi + r * kPadRow + c), rec->t_hi + r * kChunk + c, true);
      attn::cp_async_16(attn::smem_address(t_lo + r * kPadRow + c), rec->t_lo + r * kChunk + c, true);
    }
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
  const int mt = warp & 3, ch = warp >> 2;  // steps 1-4: rows 16 mt.., columns 32 ch..
  auto b_block = [&](const bf16* tile, int kk, int col0) {
    return attn::smem_address(tile + (kk * 16 + ldm_i + (ldm_m & 1) * 8) * kPadRow + col0 + (ldm_m >> 1) * 8);
  };

  if (n_chunks > 0) {
    load_g(0, 0);
    attn::cp_async_commit();
    load_kq(0);
    attn::cp_async_commit();
    load_vt(0);
    attn::cp_async_commit();
  }
  for (int ci = 0; ci < n_chunks; ++ci) {
    const int stage = ci & 1;
    const int r0 = seq_begin + ci * kChunk, valid = min(kChunk, seq_end - r0);
    const bool more = ci + 1 < n_chunks;
    __syncthreads();  // every warp is done with the previous chunk's step 4 (the other stage, Aqk)
    if (more) load_g(ci + 1, stage ^ 1);
    load_aqk(ci);
    attn::cp_async_commit();
    // S -> shared as hi + lo (the B operand of step 1).
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int r = warp * 16 + group, c = e * 8 + 2 * quad;
      store_split(s_hi, s_lo, r * kPadRow + c, st[e][0], st[e][1]);
      store_split(s_hi, s_lo, (r + 8) * kPadRow + c, st[e][2], st[e][3]);
    }
    attn::cp_async_wait<2>();  // G of this chunk and its k and q rows (VT and GA(ci) may be in flight)
    __syncthreads();

    unsigned char* base = stage_base(stage);
    bf16* ku_hi = reinterpret_cast<bf16*>(base);  // G, then (K^ e^{G_C - G})_hi
    bf16* ku_lo = ku_hi + kChunk * kKeyDim;       // and _lo
    const float* beta = reinterpret_cast<const float*>(base + scan::kOffScalarsInStage);
    const float* rk = beta + kChunk;
    const float* rq = rk + kChunk;

    // Step 0: the decayed operands from G (the prep's), in place. Thread (rg, c8) takes rows
    // 4 rg .. 4 rg + 3 and channels 8 c8 .. 8 c8 + 7 with 16-byte accesses; both column tiles of
    // a head form all 64 rows (computing them twice costs less than sharing them across a cluster).
    {
      const float* g_tile = reinterpret_cast<const float*>(base);
      float G[4][8], last[8];
      const auto read_g = [&](int i, float(&dst)[8]) {
        const float4 lo = *reinterpret_cast<const float4*>(g_tile + i * kKeyDim + g_chunk(2 * c8) * 4);
        const float4 hi = *reinterpret_cast<const float4*>(g_tile + i * kKeyDim + g_chunk(2 * c8 + 1) * 4);
        dst[0] = lo.x, dst[1] = lo.y, dst[2] = lo.z, dst[3] = lo.w;
        dst[4] = hi.x, dst[5] = hi.y, dst[6] = hi.z, dst[7] = hi.w;
      };
#pragma unroll
      for (int r = 0; r < 4; ++r) read_g(rg * 4 + r, G[r]);
      read_g(kChunk - 1, last);  // G_C: padding rows repeat the last valid row
      __syncthreads();           // every thread holds its G: the tile takes K^ e^{G_C - G}
      if (rg == 0) {
#pragma unroll
        for (int e = 0; e < 8; ++e) chunk_decay[c8 * 8 + e] = __expf(last[e]);
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = rg * 4 + r, at = sw(i, c8 * 8);
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
            const float e1 = __expf(G[r][e]), e2f = __expf(last[e] - G[r][e]);
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
        *reinterpret_cast<uint4*>(kd_hi + at) = make_uint4(kdh[0], kdh[1], kdh[2], kdh[3]);
        *reinterpret_cast<uint4*>(kd_lo + at) = make_uint4(kdl[0], kdl[1], kdl[2], kdl[3]);
        *reinterpret_cast<uint4*>(ku_hi + at) = make_uint4(kuh[0], kuh[1], kuh[2], kuh[3]);
        *reinterpret_cast<uint4*>(ku_lo + at) = make_uint4(kul[0], kul[1], kul[2], kul[3]);
        *reinterpret_cast<uint4*>(qd + at) = make_uint4(qdv[0], qdv[1], qdv[2], qdv[3]);
      }
    }
    attn::cp_async_wait<1>();  // v and T of this chunk (GA(ci) may be in flight)
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
    __syncthreads();  // every warp is done with the k, q and v tiles
    if (more) load_kq(ci + 1);
    attn::cp_async_commit();

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
      attn::cp_async_wait<1>();  // Aqk of this chunk (KQ(ci + 1) may be in flight)
      __syncthreads();           // V' whole; every warp is done with T
    }
    if (more) load_vt(ci + 1);
    attn::cp_async_commit();

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
