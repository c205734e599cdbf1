// DSA cache writes, pool selection and the MLA absorption on the GPU (glm_deepseek.md §2.6; the
// attention itself is dsa_attention.cu). Every launch reads the batch metadata on the device and
// sizes its grid from tensor shapes and host bounds, so all of it can be captured in a CUDA graph.
//
//   dsa_latent_write   one CTA per row, 16-byte copies into the paged cache.
//   dsa_index_write    one warp per new token: LayerNorm of k^I (fp32, two passes over registers) and
//                      the [k^I || gamma] row; then a second launch, one warp per token that
//                      completes a pool: the kp rows read back from the cache, a softmax per channel
//                      over the slots, the pooled key in the activation dtype.
//   dsa_select         scores: CTA per (query row, 64 pools), q^I [H_I, d_I] x K_p^T [d_I, 64] on
//                      tensor cores (bf16; exact products, fp32 sums), relu, head weights, the sum
//                      over heads by warp shuffles; fp32 rows [T, P] in the workspace. Top-k: CTA
//                      per query row, a 4-pass radix select (8 bits a pass) of the K-th largest
//                      score, then the selected pools in ascending order by block-wide prefix
//                      sums: everything above the threshold, and of the ties at it the lowest pool
//                      indices. Rows with n_cand <= K take every candidate without sorting.
//   mla_absorb         T <= 16: a GEMV per head that streams each weight row once for all rows;
//                      T <= 1024: a tensor-core GEMM of 64 x 64 tiles over (rows, outputs, heads);
//                      longer: kernels::linear (cuBLASLt) per head on strided views.
#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/dsa.h"
#include "kernels/linear.h"

namespace metrale::kernels {
namespace cuda {
namespace {

using bf16 = __nv_bfloat16;


// ---- dsa_latent_write ----

template <typename T>
__global__ void __launch_bounds__(128) latent_write_kernel(const T* rows, int64_t row_stride, const int32_t* slots,
                                                           T* cache, int width, int64_t cache_rows) {
  const int t = blockIdx.x;
  const int slot = slots[t];
  if (slot < 0 || slot >= cache_rows) return;
  const T* src = rows + static_cast<int64_t>(t) * row_stride;
  T* dst = cache + static_cast<int64_t>(slot) * width;
  for (int i = threadIdx.x; i < width; i += 128) dst[i] = src[i];
}

// ---- dsa_index_write ----

constexpr int kMaxIndexDim = 256;

struct IndexWriteArgs {
  const void* k_raw;  // [T, d]
  const void* gate;   // [T, d]
  int64_t k_row, gate_row;
  const void* ln_weight;
  const void* ln_bias;
  const void* ape;  // [kp, d]
  WeightType w_type, b_type, ape_type;
  const int32_t* slots;
  void* index_cache;  // [rows, 2 d]
  void* pool_cache;   // [rows / kp, d]
  int64_t cache_rows;
  int tokens, dim, kp, block_size;
  float eps;
};

// One warp per token; lane l holds channels l, l + 32, ...
template <typename T>
__global__ void __launch_bounds__(128) index_rows_kernel(IndexWriteArgs a) {
  const int t = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (t >= a.tokens) return;
  const int slot = a.slots[t];
  if (slot < 0 || slot >= a.cache_rows) return;
  constexpr int kPer = kMaxIndexDim / 32;
  const T* k = static_cast<const T*>(a.k_raw) + static_cast<int64_t>(t) * a.k_row;
  const T* g = static_cast<const T*>(a.gate) + static_cast<int64_t>(t) * a.gate_row;
  float x[kPer];
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int d = lane + 32 * j;
    x[j] = d < a.dim ? to_f32(k[d]) : 0.0f;
    sum += x[j];
  }
  const float mean = warp_sum(sum) / static_cast<float>(a.dim);
  float var = 0.0f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int d = lane + 32 * j;
    if (d < a.dim) var += (x[j] - mean) * (x[j] - mean);
  }
  const float inv = rsqrtf(warp_sum(var) / static_cast<float>(a.dim) + a.eps);
  T* row = static_cast<T*>(a.index_cache) + static_cast<int64_t>(slot) * 2 * a.dim;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int d = lane + 32 * j;
    if (d < a.dim) {
      row[d] = from_f32<T>((x[j] - mean) * inv * load_weight(a.ln_weight, a.w_type, d) +
                           load_weight(a.ln_bias, a.b_type, d));
      row[a.dim + d] = g[d];
    }
  }
}

// One warp per token that completes its pool (slot % kp == kp - 1).
template <typename T>
__global__ void __launch_bounds__(128) pool_keys_kernel(IndexWriteArgs a) {
  const int t = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (t >= a.tokens) return;
  const int slot = a.slots[t];
  if (slot < 0 || slot >= a.cache_rows || slot % a.kp != a.kp - 1) return;
  const T* rows = static_cast<const T*>(a.index_cache) + static_cast<int64_t>(slot - a.kp + 1) * 2 * a.dim;
  const int block = slot / a.block_size, offset = slot % a.block_size;
  T* key = static_cast<T*>(a.pool_cache) +
           (static_cast<int64_t>(block) * (a.block_size / a.kp) + offset / a.kp) * a.dim;
  for (int d = lane; d < a.dim; d += 32) {
    float mx = -INFINITY;
    for (int j = 0; j < a.kp; ++j) {
      mx = fmaxf(mx, to_f32(rows[static_cast<int64_t>(j) * 2 * a.dim + a.dim + d]) +
                         load_weight(a.ape, a.ape_type, static_cast<int64_t>(j) * a.dim + d));
    }
    float sum = 0.0f;
    for (int j = 0; j < a.kp; ++j) {
      sum += expf(to_f32(rows[static_cast<int64_t>(j) * 2 * a.dim + a.dim + d]) +
                  load_weight(a.ape, a.ape_type, static_cast<int64_t>(j) * a.dim + d) - mx);
    }
    float pooled = 0.0f;
    for (int j = 0; j < a.kp; ++j) {
      const float logit = to_f32(rows[static_cast<int64_t>(j) * 2 * a.dim + a.dim + d]) +
                          load_weight(a.ape, a.ape_type, static_cast<int64_t>(j) * a.dim + d);
      const float w = to_f32(from_f32<T>(expf(logit - mx) / sum));
      pooled += to_f32(from_f32<T>(w * to_f32(rows[static_cast<int64_t>(j) * 2 * a.dim + d])));
    }
    key[d] = from_f32<T>(pooled);
  }
}

// ---- dsa_select: scores ----

constexpr int kPoolTile = 64;
constexpr int kMaxIndexHeads = 64;

struct SelectArgs {
  const void* q;  // [T, H_I, d_I]
  int64_t q_row, q_head;
  const void* w;  // [T, H_I]
  int64_t w_row;
  WeightType w_type;
  const void* pools;  // [blocks, block_size / kp, d_I]
  const int32_t* cu_q;
  const int32_t* kv_lens;
  const int32_t* tables;  // [S, max_blocks]
  int max_blocks, num_seqs, heads, dim, kp, block_size, top;
  int64_t score_row;  // floats per row of the scores scratch (>= the largest candidate count)
  float score_scale, weight_scale;
  float* scores;  // [T, score_row]
  int32_t* selected;  // [T, top]
};

struct QueryPos {
  int seq, candidates;
};

__device__ __forceinline__ QueryPos query_pos(const SelectArgs& a, int t) {
  const int s = sequence_of(a.cu_q, a.num_seqs, t);
  const int pos = a.kv_lens[s] - (a.cu_q[s + 1] - a.cu_q[s]) + (t - a.cu_q[s]);
  return {s, (pos + 1) / a.kp};
}

__device__ __forceinline__ const void* pool_row(const SelectArgs& a, int s, int p, size_t element) {
  const int64_t pos = static_cast<int64_t>(p) * a.kp;
  const int block = a.tables[static_cast<int64_t>(s) * a.max_blocks + pos / a.block_size];
  const int64_t row = static_cast<int64_t>(block) * (a.block_size / a.kp) + (pos % a.block_size) / a.kp;
  return static_cast<const char*>(a.pools) + row * a.dim * static_cast<int64_t>(element);
}

// bf16, d_I = kDim: CTA of 4 warps per (64-pool tile, query row); warp w takes pools 16w..16w+15.
template <int kDim>
__global__ void __launch_bounds__(128) scores_mma_kernel(SelectArgs a) {
  constexpr int kRow = kDim + 8;
  __shared__ __align__(16) bf16 q_s[kMaxIndexHeads][kRow];
  __shared__ __align__(16) bf16 k_s[kPoolTile][kRow];
  __shared__ float w_s[kMaxIndexHeads];
  const int tile = blockIdx.x, t = blockIdx.y;
  const QueryPos qp = query_pos(a, t);
  const int p0 = tile * kPoolTile;
  if (p0 >= qp.candidates) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = lane >> 2, quad = lane & 3;
  const int m_tiles = (a.heads + 15) / 16;
  const bf16* q = static_cast<const bf16*>(a.q) + static_cast<int64_t>(t) * a.q_row;
  for (int idx = tid; idx < m_tiles * 16 * (kDim / 8); idx += 128) {
    const int h = idx / (kDim / 8), c = (idx % (kDim / 8)) * 8;
    const bool ok = h < a.heads;
    attn::cp_async_16(attn::smem_address(&q_s[h][c]), q + static_cast<int64_t>(ok ? h : 0) * a.q_head + c, ok);
  }
  // Pool rows looked up once per pool (one dependent block-table load each), then copied.
  __shared__ const bf16* rows_s[kPoolTile];
  if (tid < kPoolTile) {
    rows_s[tid] = p0 + tid < qp.candidates ? static_cast<const bf16*>(pool_row(a, qp.seq, p0 + tid, sizeof(bf16)))
                                           : nullptr;
  }
  __syncthreads();
  for (int idx = tid; idx < kPoolTile * (kDim / 8); idx += 128) {
    const int p = idx / (kDim / 8), c = (idx % (kDim / 8)) * 8;
    const bf16* row = rows_s[p];
    attn::cp_async_16(attn::smem_address(&k_s[p][c]), (row != nullptr ? row : q) + c, row != nullptr);
  }
  attn::cp_async_commit();
  if (tid < kMaxIndexHeads) {
    w_s[tid] = tid < a.heads ? load_weight(a.w, a.w_type, static_cast<int64_t>(t) * a.w_row + tid) * a.weight_scale
                             : 0.0f;
  }
  attn::cp_async_wait<0>();
  __syncthreads();
  float acc[4][2][4] = {};
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk) {
    uint32_t bf[4];
    const int m = lane >> 3, i8 = lane & 7;
    attn::ldmatrix_x4(bf, attn::smem_address(&k_s[warp * 16 + (m >> 1) * 8 + i8][kk * 16 + (m & 1) * 8]));
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      if (mt < m_tiles) {
        uint32_t af[4];
        attn::ldmatrix_x4(af, attn::smem_address(&q_s[mt * 16 + (lane & 15)][kk * 16 + (lane >> 4) * 8]));
        attn::mma_bf16_16816(acc[mt][0], af, bf[0], bf[1]);
        attn::mma_bf16_16816(acc[mt][1], af, bf[2], bf[3]);
      }
    }
  }
  // score(p) = sum_h w_h relu(scale * acc[h][p]): this lane's 8 head rows, then the 8 groups.
  float part[2][2] = {};
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = mt * 16 + group + (e >> 1) * 8;
        part[nt][e & 1] += w_s[h] * fmaxf(0.0f, acc[mt][nt][e] * a.score_scale);
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float v = part[nt][c];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      part[nt][c] = v;
    }
  }
  if (group == 0) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int p = p0 + warp * 16 + nt * 8 + 2 * quad + c;
        if (p < qp.candidates) a.scores[static_cast<int64_t>(t) * a.score_row + p] = part[nt][c] + 0.0f;
      }
    }
  }
}

// Any dtype: CTA of 64 threads per (64-pool tile, query row), one pool per thread, CUDA cores.
template <typename T>
__global__ void __launch_bounds__(kPoolTile) scores_simple_kernel(SelectArgs a) {
  const int tile = blockIdx.x, t = blockIdx.y;
  const QueryPos qp = query_pos(a, t);
  const int p = tile * kPoolTile + threadIdx.x;
  if (p >= qp.candidates) return;
  const T* key = static_cast<const T*>(pool_row(a, qp.seq, p, sizeof(T)));
  const T* q = static_cast<const T*>(a.q) + static_cast<int64_t>(t) * a.q_row;
  float score = 0.0f;
  for (int h = 0; h < a.heads; ++h) {
    float dot = 0.0f;
    for (int c = 0; c < a.dim; ++c) dot += to_f32(q[static_cast<int64_t>(h) * a.q_head + c]) * to_f32(key[c]);
    score += load_weight(a.w, a.w_type, static_cast<int64_t>(t) * a.w_row + h) * a.weight_scale *
             fmaxf(0.0f, dot * a.score_scale);
  }
  a.scores[static_cast<int64_t>(t) * a.score_row + p] = score + 0.0f;
}

// ---- dsa_select: top-k ----

constexpr int kTopThreads = 256;

// Order-preserving key of a score (larger score, larger key); -0 and +0 map to one key.
__device__ __forceinline__ uint32_t order_key(float score) {
  const uint32_t u = __float_as_uint(score == 0.0f ? 0.0f : score);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Block-wide exclusive prefix sum of one int per thread; `total` receives the sum.
__device__ __forceinline__ int block_exclusive_scan(int value, int* warp_sums, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += y;
  }
  __syncthreads();
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kTopThreads / 32; ++w) {
    if (w < warp) before += warp_sums[w];
    total += warp_sums[w];
  }
  return before + x - value;
}

__global__ void __launch_bounds__(kTopThreads) topk_kernel(SelectArgs a) {
  __shared__ int hist[256];
  __shared__ int warp_sums[kTopThreads / 32];
  __shared__ uint32_t prefix_s;
  __shared__ int remaining_s;
  const int t = blockIdx.x, tid = threadIdx.x;
  const QueryPos qp = query_pos(a, t);
  const int n = qp.candidates;
  int32_t* out = a.selected + static_cast<int64_t>(t) * a.top;
  if (n <= a.top) {  // every candidate (the dense regime), ascending, padded with -1
    for (int j = tid; j < a.top; j += kTopThreads) out[j] = j < n ? j : -1;
    return;
  }
  const float* scores = a.scores + static_cast<int64_t>(t) * a.score_row;
  // Radix select of the top-th largest key, 8 bits a pass from the top.
  uint32_t prefix = 0, mask = 0;
  int remaining = a.top;  // keys still to place at or below the current prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kTopThreads) hist[i] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += kTopThreads) {
      const uint32_t key = order_key(scores[i]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
    }
    __syncthreads();
    if (tid < 32) {
      // The bin holding the remaining-th largest key: lane l sums bins 255 - 8l .. 248 - 8l (from
      // the top), a warp prefix sum finds the lane, the lane finds the bin.
      int mine = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) mine += hist[255 - 8 * tid - b];
      int inclusive = mine;
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (tid >= offset) inclusive += y;
      }
      const int before = inclusive - mine;
      const unsigned hit = __ballot_sync(0xffffffffu, before < remaining && inclusive >= remaining);
      if (tid == __ffs(hit) - 1) {
        int above = before, bin = 255 - 8 * tid;
        for (int b = 0; b < 7; ++b, --bin) {
          if (above + hist[bin] >= remaining) break;
          above += hist[bin];
        }
        prefix_s = prefix | (static_cast<uint32_t>(bin) << shift);
        remaining_s = remaining - above;
      }
    }
    __syncthreads();
    prefix = prefix_s;
    remaining = remaining_s;
    mask |= 255u << shift;
    __syncthreads();
  }
  // `prefix` is the threshold key; `remaining` of the keys equal to it are taken, lowest pools first.
  const uint32_t threshold = prefix;
  int written = 0, ties_taken = 0;
  for (int base = 0; base < n; base += kTopThreads) {
    const int i = base + tid;
    const uint32_t key = i < n ? order_key(scores[i]) : 0u;
    const bool tie = i < n && key == threshold;
    int tie_total = 0;
    const int tie_rank = ties_taken + block_exclusive_scan(tie ? 1 : 0, warp_sums, tie_total);
    const bool take = i < n && (key > threshold || (tie && tie_rank < remaining));
    int take_total = 0;
    const int at = written + block_exclusive_scan(take ? 1 : 0, warp_sums, take_total);
    if (take) out[at] = i;
    written += take_total;
    ties_taken += tie_total;
  }
  for (int j = written + tid; j < a.top; j += kTopThreads) out[j] = -1;
}

// ---- mla_absorb ----

constexpr int kAbsorbWarps = 4;
constexpr int kAbsorbRows = 8;  // weight rows per warp, all loaded before the products
constexpr int kAbsorbMaxT = 16;
constexpr int kAbsorbMaxStaged = 12288;  // fp32 x values staged per CTA (48 KiB of shared memory)
constexpr int kAbsorbMaxK = 512;

// T <= 16: grid (ceil(N / 32), H); the head's x rows staged in shared memory as fp32; warp w takes
// weight rows 8w..8w+7 of the CTA's 32 and issues every 16-byte load of them before the products.
__global__ void __launch_bounds__(kAbsorbWarps * 32) absorb_gemv_kernel(const bf16* x, int64_t x_row, int64_t x_head,
                                                                       const bf16* w, int64_t w_head, bf16* out,
                                                                       int64_t out_row, int64_t out_head, int tokens,
                                                                       int K, int N) {
  extern __shared__ float x_s[];  // [tokens][K]
  const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int idx = threadIdx.x; idx < tokens * K; idx += kAbsorbWarps * 32) {
    const int t = idx / K, c = idx % K;
    x_s[idx] = __bfloat162float(x[static_cast<int64_t>(t) * x_row + static_cast<int64_t>(h) * x_head + c]);
  }
  __syncthreads();
  const int n0 = (blockIdx.x * kAbsorbWarps + warp) * kAbsorbRows;
  const bf16* wh = w + static_cast<int64_t>(h) * w_head;
  constexpr int kChunks = kAbsorbMaxK / 256;  // 16-byte pieces per lane and row
  uint4 raw[kAbsorbRows][kChunks];
#pragma unroll
  for (int r = 0; r < kAbsorbRows; ++r) {
    const int n = min(n0 + r, N - 1);
#pragma unroll
    for (int q = 0; q < kChunks; ++q) {
      const int c = q * 256 + lane * 8;
      raw[r][q] = c < K ? *reinterpret_cast<const uint4*>(wh + static_cast<int64_t>(n) * K + c) : make_uint4(0, 0, 0, 0);
    }
  }
  for (int t = 0; t < tokens; ++t) {
    float acc[kAbsorbRows] = {};
#pragma unroll
    for (int q = 0; q < kChunks; ++q) {
      const int c = q * 256 + lane * 8;
      if (c >= K) break;
      const float4 x0 = *reinterpret_cast<const float4*>(x_s + t * K + c);
      const float4 x1 = *reinterpret_cast<const float4*>(x_s + t * K + c + 4);
      const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
      for (int r = 0; r < kAbsorbRows; ++r) {
        const uint32_t words[4] = {raw[r][q].x, raw[r][q].y, raw[r][q].z, raw[r][q].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc[r] += __uint_as_float(words[e] << 16) * xv[2 * e] + __uint_as_float(words[e] & 0xffff0000u) * xv[2 * e + 1];
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kAbsorbRows; ++r) {
      const float total = warp_sum(acc[r]);
      if (lane == r && n0 + r < N) {
        out[static_cast<int64_t>(t) * out_row + static_cast<int64_t>(h) * out_head + n0 + r] = __float2bfloat16_rn(total);
      }
    }
  }
}

// 16 < T <= 1024: grid (ceil(N / 64), ceil(T / 64), H); CTA of 4 warps computes a 64 x 64 tile of
// out[:, h, :] on tensor cores, K staged 32 at a time (double-buffered cp.async).
constexpr int kGemmTile = 64;
constexpr int kGemmK = 32;
constexpr int kGemmRow = kGemmK + 8;

__global__ void __launch_bounds__(128) absorb_mma_kernel(const bf16* x, int64_t x_row, int64_t x_head, const bf16* w,
                                                        int64_t w_head, bf16* out, int64_t out_row, int64_t out_head,
                                                        int tokens, int K, int N) {
  __shared__ __align__(16) bf16 a_s[2][kGemmTile][kGemmRow];
  __shared__ __align__(16) bf16 b_s[2][kGemmTile][kGemmRow];
  const int n0 = blockIdx.x * kGemmTile, t0 = blockIdx.y * kGemmTile, h = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = lane >> 2, quad = lane & 3;
  const int wm = warp & 1, wn = warp >> 1;  // warp tile: rows 32 wm.., columns 32 wn..
  const bf16* xh = x + static_cast<int64_t>(h) * x_head;
  const bf16* wh = w + static_cast<int64_t>(h) * w_head;
  auto load = [&](int k0, int buffer) {
    for (int idx = tid; idx < kGemmTile * (kGemmK / 8); idx += 128) {
      const int r = idx / (kGemmK / 8), c = (idx % (kGemmK / 8)) * 8;
      const bool ok_a = t0 + r < tokens, ok_b = n0 + r < N;
      attn::cp_async_16(attn::smem_address(&a_s[buffer][r][c]),
                        xh + static_cast<int64_t>(ok_a ? t0 + r : 0) * x_row + k0 + c, ok_a);
      attn::cp_async_16(attn::smem_address(&b_s[buffer][r][c]), wh + static_cast<int64_t>(ok_b ? n0 + r : 0) * K + k0 + c,
                        ok_b);
    }
    attn::cp_async_commit();
  };
  float acc[2][4][4] = {};
  const int steps = K / kGemmK;
  load(0, 0);
  for (int step = 0; step < steps; ++step) {
    const int buffer = step & 1;
    if (step + 1 < steps) {
      load((step + 1) * kGemmK, buffer ^ 1);
      attn::cp_async_wait<1>();
    } else {
      attn::cp_async_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kGemmK / 16; ++kk) {
      uint32_t af[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        attn::ldmatrix_x4(af[mi], attn::smem_address(&a_s[buffer][wm * 32 + mi * 16 + (lane & 15)][kk * 16 + (lane >> 4) * 8]));
      }
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t bf[4];
        const int m = lane >> 3, i8 = lane & 7;
        attn::ldmatrix_x4(bf, attn::smem_address(&b_s[buffer][wn * 32 + np * 16 + (m >> 1) * 8 + i8][kk * 16 + (m & 1) * 8]));
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          attn::mma_bf16_16816(acc[mi][np * 2], af[mi], bf[0], bf[1]);
          attn::mma_bf16_16816(acc[mi][np * 2 + 1], af[mi], bf[2], bf[3]);
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int t = t0 + wm * 32 + mi * 16 + group + hr * 8, n = n0 + wn * 32 + ni * 8 + 2 * quad;
        if (t < tokens && n < N) {
          *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(t) * out_row + static_cast<int64_t>(h) * out_head + n) =
              attn::pack_bf16x2(acc[mi][ni][2 * hr], acc[mi][ni][2 * hr + 1]);
        }
      }
    }
  }
}

void check_cuda(const char* op, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    METRALE_EXPECT(t->device().is_cuda(), std::string(op) + ": tensors must be on the GPU (" + t->describe() + ")");
  }
}

void check_paged(const char* op, const Tensor& cache) {
  METRALE_EXPECT(cache.ndim() == 3 && cache.is_contiguous(),
                 std::string(op) + ": cache " + cache.describe() + " must be contiguous [blocks, rows, width]");
}

}  // namespace

void dsa_latent_write(const Tensor& rows, const Tensor& slot_mapping, const Tensor& cache) {
  const char* op = "dsa_latent_write";
  check_cuda(op, {&rows, &slot_mapping, &cache});
  check_paged(op, cache);
  METRALE_EXPECT(rows.ndim() == 2 && rows.size(1) == cache.size(2) && rows.stride(1) == 1 &&
                     rows.dtype() == cache.dtype() && slot_mapping.dtype() == DType::kI32 &&
                     slot_mapping.numel() == rows.size(0),
                 std::string(op) + ": rows " + rows.describe() + " slots " + slot_mapping.describe() + " cache " +
                     cache.describe());
  const int64_t tokens = rows.size(0);
  if (tokens == 0) return;
  METRALE_EXPECT(tokens <= INT32_MAX, std::string(op) + ": too many rows");
  METRALE_DISPATCH_FLOAT(rows.dtype(), op, [&] {
    latent_write_kernel<scalar_t><<<static_cast<unsigned>(tokens), 128, 0, stream_of(cache)>>>(
        rows.data_as<const scalar_t>(), rows.stride(0), slot_mapping.data_as<const int32_t>(),
        cache.data_as<scalar_t>(), static_cast<int>(cache.size(2)), cache.size(0) * cache.size(1));
  });
  METRALE_CHECK_LAUNCH(op);
}

void dsa_index_write(const Tensor& k_raw, const Tensor& gate, const Tensor& ln_weight, const Tensor& ln_bias,
                     const Tensor& ape, const Tensor& slot_mapping, const Tensor& index_cache,
                     const Tensor& pool_cache, const DsaIndexWriteParams& params) {
  const char* op = "dsa_index_write";
  check_cuda(op, {&k_raw, &gate, &ln_weight, &ln_bias, &ape, &slot_mapping, &index_cache, &pool_cache});
  check_paged(op, index_cache);
  check_paged(op, pool_cache);
  const int64_t tokens = k_raw.size(0), dim = k_raw.size(1), kp = params.kpool;
  METRALE_EXPECT(kp >= 1 && index_cache.size(1) % kp == 0 && pool_cache.size(1) * kp == index_cache.size(1) &&
                     pool_cache.size(0) == index_cache.size(0) && index_cache.size(2) == 2 * dim &&
                     pool_cache.size(2) == dim && dim <= kMaxIndexDim,
                 std::string(op) + ": caches " + index_cache.describe() + " " + pool_cache.describe() + " for d_I " +
                     std::to_string(dim) + " and kp " + std::to_string(kp));
  METRALE_EXPECT(k_raw.ndim() == 2 && k_raw.stride(1) == 1 && gate.ndim() == 2 && gate.size(0) == tokens &&
                     gate.size(1) == dim && gate.stride(1) == 1 && k_raw.dtype() == index_cache.dtype() &&
                     gate.dtype() == index_cache.dtype() && pool_cache.dtype() == index_cache.dtype(),
                 std::string(op) + ": k_raw " + k_raw.describe() + " gate " + gate.describe());
  METRALE_EXPECT(ln_weight.numel() == dim && ln_bias.numel() == dim && ape.numel() == kp * dim &&
                     slot_mapping.dtype() == DType::kI32 && slot_mapping.numel() == tokens,
                 std::string(op) + ": ln_weight " + ln_weight.describe() + " ape " + ape.describe());
  if (tokens == 0) return;
  IndexWriteArgs a{};
  a.k_raw = k_raw.data();
  a.gate = gate.data();
  a.k_row = k_raw.stride(0);
  a.gate_row = gate.stride(0);
  a.ln_weight = ln_weight.data();
  a.ln_bias = ln_bias.data();
  a.ape = ape.data();
  a.w_type = weight_type_of(ln_weight, op);
  a.b_type = weight_type_of(ln_bias, op);
  a.ape_type = weight_type_of(ape, op);
  a.slots = slot_mapping.data_as<const int32_t>();
  a.index_cache = index_cache.data();
  a.pool_cache = pool_cache.data();
  a.cache_rows = index_cache.size(0) * index_cache.size(1);
  a.tokens = static_cast<int>(tokens);
  a.dim = static_cast<int>(dim);
  a.kp = static_cast<int>(kp);
  a.block_size = static_cast<int>(index_cache.size(1));
  a.eps = params.ln_eps;
  const auto grid = static_cast<unsigned>(ceil_div(tokens, 4));
  const cudaStream_t stream = stream_of(index_cache);
  METRALE_DISPATCH_FLOAT(index_cache.dtype(), op, [&] {
    index_rows_kernel<scalar_t><<<grid, 128, 0, stream>>>(a);
    METRALE_CHECK_LAUNCH("dsa index rows");
    pool_keys_kernel<scalar_t><<<grid, 128, 0, stream>>>(a);
  });
  METRALE_CHECK_LAUNCH("dsa pool keys");
}

void dsa_select(const Tensor& q_index, const Tensor& weights, const Tensor& pool_cache, const Tensor& cu_q,
                const Tensor& kv_lens, const Tensor& block_tables, const Tensor& selected,
                const DsaSelectParams& params) {
  const char* op = "dsa_select";
  check_cuda(op, {&q_index, &weights, &pool_cache, &cu_q, &kv_lens, &block_tables, &selected});
  check_paged(op, pool_cache);
  METRALE_EXPECT(q_index.ndim() == 3 && q_index.stride(2) == 1 && q_index.dtype() == pool_cache.dtype(),
                 std::string(op) + ": q_index " + q_index.describe());
  const int64_t tokens = q_index.size(0), heads = q_index.size(1), dim = q_index.size(2);
  const int64_t kp = params.kpool, top = params.top_pools, block_size = pool_cache.size(1) * kp;
  METRALE_EXPECT(pool_cache.size(2) == dim && kp >= 1 && top >= 1 && heads <= kMaxIndexHeads,
                 std::string(op) + ": pool cache " + pool_cache.describe() + " for q_index " + q_index.describe());
  METRALE_EXPECT(weights.ndim() == 2 && weights.size(0) == tokens && weights.size(1) == heads &&
                     weights.stride(1) == 1,
                 std::string(op) + ": weights " + weights.describe());
  METRALE_EXPECT(selected.ndim() == 2 && selected.size(0) == tokens && selected.size(1) == top &&
                     selected.dtype() == DType::kI32 && selected.is_contiguous(),
                 std::string(op) + ": selected " + selected.describe());
  const int64_t num_seqs = kv_lens.numel();
  METRALE_EXPECT(cu_q.numel() == num_seqs + 1 && block_tables.ndim() == 2 && block_tables.size(0) == num_seqs &&
                     block_tables.is_contiguous(),
                 std::string(op) + ": cu_q " + cu_q.describe() + " block_tables " + block_tables.describe());
  if (tokens == 0) return;
  const int64_t max_kv = params.max_kv_len > 0 ? params.max_kv_len : block_tables.size(1) * block_size;
  const int64_t max_pools = max_kv / kp;
  SelectArgs a{};
  a.q = q_index.data();
  a.q_row = q_index.stride(0);
  a.q_head = q_index.stride(1);
  a.w = weights.data();
  a.w_row = weights.stride(0);
  a.w_type = weight_type_of(weights, op);
  a.pools = pool_cache.data();
  a.cu_q = cu_q.data_as<const int32_t>();
  a.kv_lens = kv_lens.data_as<const int32_t>();
  a.tables = block_tables.data_as<const int32_t>();
  a.max_blocks = static_cast<int>(block_tables.size(1));
  a.num_seqs = static_cast<int>(num_seqs);
  a.heads = static_cast<int>(heads);
  a.dim = static_cast<int>(dim);
  a.kp = static_cast<int>(kp);
  a.block_size = static_cast<int>(block_size);
  a.top = static_cast<int>(top);
  a.score_row = std::max<int64_t>(max_pools, 1);
  a.score_scale = params.score_scale;
  a.weight_scale = params.weight_scale;
  a.selected = selected.data_as<int32_t>();
  const cudaStream_t stream = stream_of(selected);
  if (max_pools > top) {
    const size_t needed = dsa_select_workspace_bytes(selected.device(), tokens, max_kv, kp);
    const Tensor& ws = params.workspace;
    METRALE_EXPECT(!ws.empty() && ws.device().is_cuda() && ws.nbytes() >= needed,
                   std::string(op) + ": workspace " + ws.describe() + " below the " + std::to_string(needed) +
                       " bytes of dsa_select_workspace_bytes");
    a.scores = ws.data_as<float>();
    METRALE_EXPECT(tokens <= 65535, std::string(op) + ": too many query rows for one call");
    const dim3 grid(static_cast<unsigned>(ceil_div(max_pools, kPoolTile)), static_cast<unsigned>(tokens));
    const bool mma = q_index.dtype() == DType::kBF16 && (dim == 64 || dim == 128) && q_index.stride(1) % 8 == 0 &&
                     q_index.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(q_index.data()) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(pool_cache.data()) % 16 == 0;
    if (mma && dim == 128) {
      scores_mma_kernel<128><<<grid, 128, 0, stream>>>(a);
    } else if (mma) {
      scores_mma_kernel<64><<<grid, 128, 0, stream>>>(a);
    } else {
      METRALE_DISPATCH_FLOAT(q_index.dtype(), op, [&] { scores_simple_kernel<scalar_t><<<grid, kPoolTile, 0, stream>>>(a); });
    }
    METRALE_CHECK_LAUNCH("dsa scores");
  }
  topk_kernel<<<static_cast<unsigned>(tokens), kTopThreads, 0, stream>>>(a);
  METRALE_CHECK_LAUNCH("dsa topk");
}

void mla_absorb(const Tensor& x, const Tensor& weight, const Tensor& out) {
  const char* op = "mla_absorb";
  check_cuda(op, {&x, &weight, &out});
  METRALE_EXPECT(x.ndim() == 3 && weight.ndim() == 3 && out.ndim() == 3 && x.stride(2) == 1 && weight.stride(2) == 1 &&
                     out.stride(2) == 1 && weight.stride(1) == weight.size(2),
                 std::string(op) + ": x " + x.describe() + " weight " + weight.describe() + " out " + out.describe());
  const int64_t tokens = x.size(0), heads = x.size(1), K = x.size(2), N = weight.size(1);
  METRALE_EXPECT(weight.size(0) == heads && weight.size(2) == K && out.size(0) == tokens && out.size(1) == heads &&
                     out.size(2) == N,
                 std::string(op) + ": x " + x.describe() + " weight " + weight.describe() + " out " + out.describe());
  if (tokens == 0) return;
  const bool bf16_io = x.dtype() == DType::kBF16 && weight.dtype() == DType::kBF16 && out.dtype() == DType::kBF16 &&
                       reinterpret_cast<uintptr_t>(weight.data()) % 16 == 0 && weight.stride(0) % 8 == 0;
  const cudaStream_t stream = stream_of(out);
  if (bf16_io && tokens <= kAbsorbMaxT && K % 256 == 0 && K <= kAbsorbMaxK && tokens * K <= kAbsorbMaxStaged) {
    const dim3 grid(static_cast<unsigned>(ceil_div(N, kAbsorbWarps * kAbsorbRows)), static_cast<unsigned>(heads));
    const size_t smem = static_cast<size_t>(tokens * K) * sizeof(float);
    absorb_gemv_kernel<<<grid, kAbsorbWarps * 32, smem, stream>>>(
        x.data_as<const bf16>(), x.stride(0), x.stride(1), weight.data_as<const bf16>(), weight.stride(0),
        out.data_as<bf16>(), out.stride(0), out.stride(1), static_cast<int>(tokens), static_cast<int>(K),
        static_cast<int>(N));
    METRALE_CHECK_LAUNCH(op);
    return;
  }
  const bool mma_ok = bf16_io && K % kGemmK == 0 && N % 2 == 0 && x.stride(0) % 8 == 0 && x.stride(1) % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(x.data()) % 16 == 0 && out.stride(0) % 2 == 0 &&
                      out.stride(1) % 2 == 0 && reinterpret_cast<uintptr_t>(out.data()) % 4 == 0;
  if (mma_ok && tokens <= 1024) {
    const dim3 grid(static_cast<unsigned>(ceil_div(N, kGemmTile)), static_cast<unsigned>(ceil_div(tokens, kGemmTile)),
                    static_cast<unsigned>(heads));
    absorb_mma_kernel<<<grid, 128, 0, stream>>>(x.data_as<const bf16>(), x.stride(0), x.stride(1),
                                                weight.data_as<const bf16>(), weight.stride(0), out.data_as<bf16>(),
                                                out.stride(0), out.stride(1), static_cast<int>(tokens),
                                                static_cast<int>(K), static_cast<int>(N));
    METRALE_CHECK_LAUNCH(op);
    return;
  }
  // Long prefills (and other dtypes): one cuBLASLt GEMM per head on strided views.
  for (int64_t h = 0; h < heads; ++h) {
    const Tensor xh(static_cast<char*>(x.data()) + h * x.stride(1) * static_cast<int64_t>(x.element_size()), x.dtype(),
                    {tokens, K}, {x.stride(0), 1}, x.device());
    const Tensor wh(static_cast<char*>(weight.data()) + h * weight.stride(0) * static_cast<int64_t>(weight.element_size()),
                    weight.dtype(), {N, K}, {K, 1}, weight.device());
    const Tensor oh(static_cast<char*>(out.data()) + h * out.stride(1) * static_cast<int64_t>(out.element_size()),
                    out.dtype(), {tokens, N}, {out.stride(0), 1}, out.device());
    ::metrale::kernels::linear(xh, wh, oh, false);
  }
}

}  // namespace cuda

size_t dsa_select_workspace_bytes(Device device, int64_t num_tokens, int64_t max_kv_len, int64_t kpool) {
  if (!device.is_cuda() || kpool <= 0) return 0;
  return static_cast<size_t>(num_tokens) * static_cast<size_t>(std::max<int64_t>(max_kv_len / kpool, 1)) *
         sizeof(float);
}

}  // namespace metrale::kernels
