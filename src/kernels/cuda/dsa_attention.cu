// The sparse MLA attention of DSA on the GPU, in the absorbed form (glm_deepseek.md §2.6.1): for
// each query row, all heads against the row's attended latents (its selected pools and its tail),
// K = V = c [r].
//
// Tensor-core path (bf16, r in {64, 128, 256, 512}): CTA of 8 warps per (query row, group of 64
// heads, split). The attended tokens come in units of kp (a selected pool; the tail is a partial
// unit) and tiles of 64 tokens; a split takes a contiguous share of the units. Per tile:
//   S = Q~ C^T [64 heads x 64 tokens]: warp (m, half) 16 heads x 32 tokens, K = r;
//   online softmax in fp32 (row maxima and sums exchanged between the two warps of a head block);
//   O += P C [64 x r]: warp (m, half) 16 heads x r/2 columns (fp32 accumulators in registers).
// Each latent row is read once per tile for all heads; the next tile's rows arrive by cp.async
// while the current one is computed. With one split the CTA writes o~ = O / l; with several, each
// writes (O, m, l) to the workspace and a second launch merges them (flash-decoding), so that a
// decode step spreads its latents over the GPU.
// Generic path (other dtypes, e.g. f32 activations in tests): CTA per (query row, head), CUDA cores.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>

#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/dsa.h"

namespace metrale::kernels {
namespace cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kHeadTile = 64;
constexpr int kTokenTile = 64;
constexpr int kThreads = 256;
constexpr int kMaxSplits = 32;
constexpr int kMaxTop = 1024;  // selected pools per row the kernels stage
constexpr float kLog2e = 1.4426950408889634f;

struct AttnArgs {
  const void* q;  // [T, H, r]
  int64_t q_row, q_head;
  const void* cache;  // [blocks, block_size, r]
  const int32_t* selected;  // [T, top]
  const int32_t* cu_q;
  const int32_t* kv_lens;
  const int32_t* tables;
  void* out;  // [T, H, r]
  int64_t out_row, out_head;
  float* partial_o;  // [T, head_groups, splits, 64, r]
  float* partial_ml;  // [T, head_groups, splits, 64, 2]
  int max_blocks, num_seqs, heads, head_groups, r, kp, block_size, top, splits;
  float scale;
};

struct RowPlan {
  int seq, pos, candidates, n_sel, tail, units;
};


// The row's units: its n_sel selected pools (packed first in `selected`, -1 after), then the tail
// (tokens candidates * kp .. pos) when it is not empty.
__device__ RowPlan plan_row(const AttnArgs& a, int t, const int32_t* picks) {
  RowPlan p;
  p.seq = sequence_of(a.cu_q, a.num_seqs, t);
  p.pos = a.kv_lens[p.seq] - (a.cu_q[p.seq + 1] - a.cu_q[p.seq]) + (t - a.cu_q[p.seq]);
  p.candidates = (p.pos + 1) / a.kp;
  p.tail = p.pos + 1 - p.candidates * a.kp;
  int n = 0;
  while (n < a.top && picks[n] >= 0) ++n;
  p.n_sel = n;
  p.units = n + (p.tail > 0 ? 1 : 0);
  return p;
}

// Position of token j of unit u (or -1 past the unit's end).
__device__ __forceinline__ int unit_position(const RowPlan& p, const int32_t* picks, int u, int j, int kp) {
  if (u < p.n_sel) return picks[u] * kp + j;
  return j < p.tail ? p.candidates * kp + j : -1;
}

__device__ __forceinline__ int64_t cache_row(const AttnArgs& a, int seq, int pos) {
  const int block = a.tables[static_cast<int64_t>(seq) * a.max_blocks + pos / a.block_size];
  return static_cast<int64_t>(block) * a.block_size + pos % a.block_size;
}

template <int kR>
struct Smem {
  static constexpr int kRow = kR + 8;
  static constexpr int kQ = 0;
  static constexpr int kC = kQ + kHeadTile * kRow * 2;
  static constexpr int kP = kC + 2 * kTokenTile * kRow * 2;
  static constexpr int kPRow = kTokenTile + 8;
  static constexpr int kStats = kP + kHeadTile * kPRow * 2;  // float [2][64] max, [2][64] sum
  static constexpr int kPicks = kStats + 4 * kHeadTile * 4;  // int [kMaxTop]
  static constexpr int kBytes = kPicks + kMaxTop * 4;
};

template <int kR>
__global__ void __launch_bounds__(kThreads, 1) attention_mma_kernel(AttnArgs a) {
  using L = Smem<kR>;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem + L::kQ);
  bf16* c_s = reinterpret_cast<bf16*>(smem + L::kC);
  bf16* p_s = reinterpret_cast<bf16*>(smem + L::kP);
  float* max_s = reinterpret_cast<float*>(smem + L::kStats);  // [2][64]
  float* sum_s = max_s + 2 * kHeadTile;                       // [2][64]
  int32_t* picks = reinterpret_cast<int32_t*>(smem + L::kPicks);
  __shared__ int64_t rows_s[2][kTokenTile];

  const int t = blockIdx.x, hg = blockIdx.y, split = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = lane >> 2, quad = lane & 3;
  const int mh = warp & 3, nh = warp >> 2;
  const int h0 = hg * kHeadTile;
  for (int i = tid; i < a.top; i += kThreads) picks[i] = a.selected[static_cast<int64_t>(t) * a.top + i];
  // Q~ rows of the head group (zero past H).
  const bf16* q = static_cast<const bf16*>(a.q) + static_cast<int64_t>(t) * a.q_row;
  for (int idx = tid; idx < kHeadTile * (kR / 8); idx += kThreads) {
    const int h = idx / (kR / 8), c = (idx % (kR / 8)) * 8;
    const bool ok = h0 + h < a.heads;
    attn::cp_async_16(attn::smem_address(q_s + h * L::kRow + c), q + static_cast<int64_t>(ok ? h0 + h : 0) * a.q_head + c,
                      ok);
  }
  attn::cp_async_commit();
  __syncthreads();  // picks
  const RowPlan plan = plan_row(a, t, picks);
  const int units_per_tile = kTokenTile / a.kp;
  const int u_begin = static_cast<int>(static_cast<int64_t>(plan.units) * split / a.splits);
  const int u_end = static_cast<int>(static_cast<int64_t>(plan.units) * (split + 1) / a.splits);
  const int tiles = (u_end - u_begin + units_per_tile - 1) / units_per_tile;
  const bf16* cache = static_cast<const bf16*>(a.cache);

  // The cache rows of a tile's 64 tokens (-1: past the split's units), looked up once per token by
  // the first 64 threads; the copies below wait for them at a barrier instead of each issuing its
  // own dependent block-table load.
  auto plan_tile = [&](int tile, int buffer) {
    if (tid < kTokenTile) {
      const int u = u_begin + tile * units_per_tile + tid / a.kp;
      const int pos = u < u_end ? unit_position(plan, picks, u, tid % a.kp, a.kp) : -1;
      rows_s[buffer][tid] = pos >= 0 ? cache_row(a, plan.seq, pos) : -1;
    }
  };
  auto load_tile = [&](int buffer) {
    bf16* dst = c_s + buffer * kTokenTile * L::kRow;
    for (int idx = tid; idx < kTokenTile * (kR / 8); idx += kThreads) {
      const int j = idx / (kR / 8), c = (idx % (kR / 8)) * 8;
      const int64_t row = rows_s[buffer][j];
      attn::cp_async_16(attn::smem_address(dst + j * L::kRow + c), cache + (row >= 0 ? row : 0) * kR + c, row >= 0);
    }
    attn::cp_async_commit();
  };

  constexpr int kOutTiles = kR / 2 / 8;  // n-tiles of this warp's half of the columns
  float o[kOutTiles][4];
#pragma unroll
  for (int n = 0; n < kOutTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // rows group, group + 8
  const float scale = a.scale * kLog2e;
  const int ldm_m = lane >> 3, ldm_i = lane & 7;

  if (tiles > 0) {
    plan_tile(0, 0);
    __syncthreads();
    load_tile(0);
  }
  for (int tile = 0; tile < tiles; ++tile) {
    const int buffer = tile & 1;
    if (tile + 1 < tiles) {
      plan_tile(tile + 1, buffer ^ 1);
      __syncthreads();
      load_tile(buffer ^ 1);
      attn::cp_async_wait<1>();
    } else {
      attn::cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* c_tile = c_s + buffer * kTokenTile * L::kRow;
    // Valid tokens of the tile: units u_begin + tile * upt .. , each kp long, the tail shorter.
    const int tile_u0 = u_begin + tile * units_per_tile;
    // S for rows 16 mh.., tokens 32 nh..: 4 n-tiles.
    float s[4][4] = {};
#pragma unroll 4
    for (int kk = 0; kk < kR / 16; ++kk) {
      uint32_t af[4];
      attn::ldmatrix_x4(af, attn::smem_address(q_s + (mh * 16 + (lane & 15)) * L::kRow + kk * 16 + (lane >> 4) * 8));
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t bf[4];
        attn::ldmatrix_x4(bf, attn::smem_address(c_tile + (nh * 32 + np * 16 + (ldm_m >> 1) * 8 + ldm_i) * L::kRow +
                                                 kk * 16 + (ldm_m & 1) * 8));
        attn::mma_bf16_16816(s[np * 2], af, bf[0], bf[1]);
        attn::mma_bf16_16816(s[np * 2 + 1], af, bf[2], bf[3]);
      }
    }
    float local_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = nh * 32 + n * 8 + 2 * quad + (e & 1);
        const int u = tile_u0 + j / a.kp;
        const bool valid = u < u_end && (u < plan.n_sel || j % a.kp < plan.tail);
        s[n][e] = valid ? s[n][e] * scale : -INFINITY;
        local_max[e >> 1] = fmaxf(local_max[e >> 1], s[n][e]);
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float v = attn::quad_max(local_max[hr]);
      if (quad == 0) max_s[nh * kHeadTile + mh * 16 + group + hr * 8] = v;
    }
    __syncthreads();
    float m_new[2], alpha[2], local_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = mh * 16 + group + hr * 8;
      const float tile_max = fmaxf(max_s[row], max_s[kHeadTile + row]);
      m_new[hr] = fmaxf(m_run[hr], tile_max);
      // Every tile holds at least one valid token, so m_new is finite.
      alpha[hr] = attn::fast_exp2(m_run[hr] - m_new[hr]);
      m_run[hr] = m_new[hr];
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const float p0 = attn::fast_exp2(s[n][0] - m_new[0]), p1 = attn::fast_exp2(s[n][1] - m_new[0]);
      const float p2 = attn::fast_exp2(s[n][2] - m_new[1]), p3 = attn::fast_exp2(s[n][3] - m_new[1]);
      local_sum[0] += p0 + p1;
      local_sum[1] += p2 + p3;
      const int col = nh * 32 + n * 8 + 2 * quad;
      *reinterpret_cast<uint32_t*>(p_s + (mh * 16 + group) * L::kPRow + col) = attn::pack_bf16x2(p0, p1);
      *reinterpret_cast<uint32_t*>(p_s + (mh * 16 + group + 8) * L::kPRow + col) = attn::pack_bf16x2(p2, p3);
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float v = attn::quad_sum(local_sum[hr]);
      if (quad == 0) sum_s[nh * kHeadTile + mh * 16 + group + hr * 8] = v;
    }
#pragma unroll
    for (int n = 0; n < kOutTiles; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
    __syncthreads();  // P and the sums complete
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = mh * 16 + group + hr * 8;
      l_run[hr] = l_run[hr] * alpha[hr] + (sum_s[row] + sum_s[kHeadTile + row]);
    }
    // O += P C for columns nh * r/2 ..: k = the tile's 64 tokens.
#pragma unroll
    for (int kk = 0; kk < kTokenTile / 16; ++kk) {
      uint32_t af[4];
      attn::ldmatrix_x4(af, attn::smem_address(p_s + (mh * 16 + (lane & 15)) * L::kPRow + kk * 16 + (lane >> 4) * 8));
#pragma unroll
      for (int np = 0; np < kOutTiles / 2; ++np) {
        uint32_t bf[4];
        attn::ldmatrix_x4_trans(bf, attn::smem_address(c_tile + (kk * 16 + ldm_i + (ldm_m & 1) * 8) * L::kRow +
                                                       nh * (kR / 2) + np * 16 + (ldm_m >> 1) * 8));
        attn::mma_bf16_16816(o[np * 2], af, bf[0], bf[1]);
        attn::mma_bf16_16816(o[np * 2 + 1], af, bf[2], bf[3]);
      }
    }
    __syncthreads();  // the buffer is refilled by the next iteration's load
  }
  attn::cp_async_wait<0>();

  // Results for rows h0 + 16 mh + group (+8), columns nh * r/2 + 8 n + 2 quad (+1).
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = mh * 16 + group + hr * 8, h = h0 + row;
    if (h >= a.heads) continue;
    if (a.splits == 1) {
      const float inv = l_run[hr] > 0.0f ? 1.0f / l_run[hr] : 0.0f;
      bf16* dst = static_cast<bf16*>(a.out) + static_cast<int64_t>(t) * a.out_row + static_cast<int64_t>(h) * a.out_head +
                  nh * (kR / 2) + 2 * quad;
#pragma unroll
      for (int n = 0; n < kOutTiles; ++n) {
        *reinterpret_cast<uint32_t*>(dst + n * 8) = attn::pack_bf16x2(o[n][2 * hr] * inv, o[n][2 * hr + 1] * inv);
      }
    } else {
      const int64_t base = ((static_cast<int64_t>(t) * a.head_groups + hg) * a.splits + split) * kHeadTile + row;
      float* dst = a.partial_o + base * kR + nh * (kR / 2) + 2 * quad;
#pragma unroll
      for (int n = 0; n < kOutTiles; ++n) {
        *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[n][2 * hr], o[n][2 * hr + 1]);
      }
      if (nh == 0 && quad == 0) {
        a.partial_ml[base * 2] = m_run[hr];
        a.partial_ml[base * 2 + 1] = l_run[hr];
      }
    }
  }
}

// Merges the splits: grid (T, head_groups, 64 head rows), CTA of 128 threads per head row; the
// split weights exp(m_s - m) / l once in shared memory, then every column over the splits with
// independent loads.
template <typename T>
__global__ void __launch_bounds__(128) combine_kernel(AttnArgs a) {
  __shared__ float factor_s[kMaxSplits];
  const int t = blockIdx.x, hg = blockIdx.y, row = blockIdx.z, h = hg * kHeadTile + row;
  if (h >= a.heads) return;
  const int64_t first = (static_cast<int64_t>(t) * a.head_groups + hg) * a.splits * kHeadTile + row;
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int sp = 0; sp < a.splits; ++sp) m = fmaxf(m, a.partial_ml[(first + sp * kHeadTile) * 2]);
    float l = 0.0f;
    for (int sp = 0; sp < a.splits; ++sp) {
      const float ms = a.partial_ml[(first + sp * kHeadTile) * 2];
      const float w = ms == -INFINITY ? 0.0f : attn::fast_exp2(ms - m);  // a split without tokens weighs 0
      factor_s[sp] = w;
      l += a.partial_ml[(first + sp * kHeadTile) * 2 + 1] * w;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int sp = 0; sp < a.splits; ++sp) factor_s[sp] *= inv;
  }
  __syncthreads();
  T* out = static_cast<T*>(a.out) + static_cast<int64_t>(t) * a.out_row + static_cast<int64_t>(h) * a.out_head;
  for (int c = threadIdx.x; c < a.r; c += 128) {
    float acc = 0.0f;
#pragma unroll 8
    for (int sp = 0; sp < a.splits; ++sp) acc += factor_s[sp] * a.partial_o[(first + sp * kHeadTile) * a.r + c];
    out[c] = from_f32<T>(acc);
  }
}

// Generic path: CTA of 128 threads per (row, head); logits staged in shared memory.
template <typename T>
__global__ void __launch_bounds__(128) attention_simple_kernel(AttnArgs a) {
  extern __shared__ float logits[];  // [top * kp + kp]
  __shared__ int32_t picks[kMaxTop];
  __shared__ float red[4];
  const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  for (int i = tid; i < a.top; i += 128) picks[i] = a.selected[static_cast<int64_t>(t) * a.top + i];
  __syncthreads();
  const RowPlan plan = plan_row(a, t, picks);
  const int n = plan.n_sel * a.kp + plan.tail;
  const T* q = static_cast<const T*>(a.q) + static_cast<int64_t>(t) * a.q_row + static_cast<int64_t>(h) * a.q_head;
  const T* cache = static_cast<const T*>(a.cache);
  auto row_of = [&](int i) { return cache + cache_row(a, plan.seq, unit_position(plan, picks, i / a.kp, i % a.kp, a.kp)) * a.r; };
  float local_max = -INFINITY;
  for (int i = tid; i < n; i += 128) {
    const T* c = row_of(i);
    float dot = 0.0f;
    for (int d = 0; d < a.r; ++d) dot += to_f32(q[d]) * to_f32(c[d]);
    logits[i] = dot * a.scale;
    local_max = fmaxf(local_max, logits[i]);
  }
  local_max = warp_max(local_max);
  if ((tid & 31) == 0) red[tid >> 5] = local_max;
  __syncthreads();
  const float mx = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
  __syncthreads();
  float local_sum = 0.0f;
  for (int i = tid; i < n; i += 128) local_sum += (logits[i] = expf(logits[i] - mx));
  local_sum = warp_sum(local_sum);
  if ((tid & 31) == 0) red[tid >> 5] = local_sum;
  __syncthreads();
  const float total = (red[0] + red[1]) + (red[2] + red[3]);
  T* out = static_cast<T*>(a.out) + static_cast<int64_t>(t) * a.out_row + static_cast<int64_t>(h) * a.out_head;
  for (int d = tid; d < a.r; d += 128) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += logits[i] * to_f32(row_of(i)[d]);
    out[d] = from_f32<T>(acc / total);
  }
}

void allow_smem(const void* kernel, int bytes, uint64_t& done_devices, std::mutex& mutex) {
  int device = 0;
  METRALE_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lock(mutex);
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit != 0 && (done_devices & bit) != 0) return;
  METRALE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done_devices |= bit;
}

template <int kR>
void launch_mma(const AttnArgs& a, int64_t tokens, cudaStream_t stream) {
  static std::mutex mutex;
  static uint64_t done = 0;
  allow_smem(reinterpret_cast<const void*>(attention_mma_kernel<kR>), Smem<kR>::kBytes, done, mutex);
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(a.head_groups), static_cast<unsigned>(a.splits));
  attention_mma_kernel<kR><<<grid, kThreads, Smem<kR>::kBytes, stream>>>(a);
}

int sm_count() {
  int device = 0, count = 0;
  METRALE_CUDA_CHECK(cudaGetDevice(&device));
  METRALE_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

}  // namespace

void dsa_attention(const Tensor& q, const Tensor& latent_cache, const Tensor& selected, const Tensor& cu_q,
                   const Tensor& kv_lens, const Tensor& block_tables, const Tensor& out,
                   const DsaAttentionParams& params) {
  const char* op = "dsa_attention";
  for (const Tensor* t : {&q, &latent_cache, &selected, &cu_q, &kv_lens, &block_tables, &out}) {
    METRALE_EXPECT(t->device().is_cuda(), std::string(op) + ": tensors must be on the GPU (" + t->describe() + ")");
  }
  METRALE_EXPECT(q.ndim() == 3 && q.stride(2) == 1 && out.ndim() == 3 && out.stride(2) == 1 && out.size(0) == q.size(0) &&
                     out.size(1) == q.size(1) && out.size(2) == q.size(2) && q.dtype() == out.dtype() &&
                     latent_cache.dtype() == q.dtype(),
                 std::string(op) + ": q " + q.describe() + " out " + out.describe());
  METRALE_EXPECT(latent_cache.ndim() == 3 && latent_cache.is_contiguous() && latent_cache.size(2) == q.size(2),
                 std::string(op) + ": latent cache " + latent_cache.describe());
  const int64_t tokens = q.size(0), heads = q.size(1), r = q.size(2), kp = params.kpool;
  const int64_t block_size = latent_cache.size(1);
  METRALE_EXPECT(kp >= 1 && block_size % kp == 0 && selected.ndim() == 2 && selected.size(0) == tokens &&
                     selected.dtype() == DType::kI32 && selected.is_contiguous() && selected.size(1) <= kMaxTop,
                 std::string(op) + ": selected " + selected.describe() + " kp " + std::to_string(kp));
  const int64_t num_seqs = kv_lens.numel();
  METRALE_EXPECT(cu_q.numel() == num_seqs + 1 && block_tables.ndim() == 2 && block_tables.size(0) == num_seqs &&
                     block_tables.is_contiguous(),
                 std::string(op) + ": cu_q " + cu_q.describe() + " block_tables " + block_tables.describe());
  if (tokens == 0) return;
  AttnArgs a{};
  a.q = q.data();
  a.q_row = q.stride(0);
  a.q_head = q.stride(1);
  a.cache = latent_cache.data();
  a.selected = selected.data_as<const int32_t>();
  a.cu_q = cu_q.data_as<const int32_t>();
  a.kv_lens = kv_lens.data_as<const int32_t>();
  a.tables = block_tables.data_as<const int32_t>();
  a.out = out.data();
  a.out_row = out.stride(0);
  a.out_head = out.stride(1);
  a.max_blocks = static_cast<int>(block_tables.size(1));
  a.num_seqs = static_cast<int>(num_seqs);
  a.heads = static_cast<int>(heads);
  a.head_groups = static_cast<int>((heads + kHeadTile - 1) / kHeadTile);
  a.r = static_cast<int>(r);
  a.kp = static_cast<int>(kp);
  a.block_size = static_cast<int>(block_size);
  a.top = static_cast<int>(selected.size(1));
  a.scale = params.scale;
  METRALE_EXPECT(tokens <= INT32_MAX && heads <= 65535, std::string(op) + ": batch too large");
  const cudaStream_t stream = stream_of(out);
  const bool mma = q.dtype() == DType::kBF16 && (r == 64 || r == 128 || r == 256 || r == 512) && kTokenTile % kp == 0 &&
                   q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0 && out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 &&
                   reinterpret_cast<uintptr_t>(q.data()) % 16 == 0 && reinterpret_cast<uintptr_t>(latent_cache.data()) % 16 == 0;
  if (!mma) {
    const size_t smem = static_cast<size_t>(a.top * kp + kp) * sizeof(float);
    METRALE_EXPECT(smem <= 48 * 1024, std::string(op) + ": too many selected tokens for the generic path");
    METRALE_DISPATCH_FLOAT(q.dtype(), op, [&] {
      attention_simple_kernel<scalar_t><<<dim3(static_cast<unsigned>(tokens), static_cast<unsigned>(heads)), 128, smem,
                                          stream>>>(a);
    });
    METRALE_CHECK_LAUNCH(op);
    return;
  }
  a.splits = params.num_splits > 0 ? params.num_splits
                                   : dsa_attention_splits(out.device(), tokens, heads, a.top);
  a.splits = std::min(a.splits, kMaxSplits);
  if (a.splits > 1) {
    const size_t needed = dsa_attention_workspace_bytes(out.device(), tokens, heads, r, a.splits);
    const Tensor& ws = params.workspace;
    METRALE_EXPECT(!ws.empty() && ws.device().is_cuda() && ws.nbytes() >= needed &&
                       reinterpret_cast<uintptr_t>(ws.data()) % 16 == 0,
                   std::string(op) + ": workspace " + ws.describe() + " below the " + std::to_string(needed) +
                       " bytes of dsa_attention_workspace_bytes");
    a.partial_o = ws.data_as<float>();
    a.partial_ml = a.partial_o + tokens * a.head_groups * a.splits * kHeadTile * r;
  }
  switch (r) {
    case 64: launch_mma<64>(a, tokens, stream); break;
    case 128: launch_mma<128>(a, tokens, stream); break;
    case 256: launch_mma<256>(a, tokens, stream); break;
    default: launch_mma<512>(a, tokens, stream); break;
  }
  METRALE_CHECK_LAUNCH(op);
  if (a.splits > 1) {
    combine_kernel<bf16><<<dim3(static_cast<unsigned>(tokens), static_cast<unsigned>(a.head_groups), kHeadTile), 128, 0,
                           stream>>>(a);
    METRALE_CHECK_LAUNCH("dsa attention combine");
  }
}

}  // namespace cuda

int dsa_attention_splits(Device device, int64_t num_tokens, int64_t num_heads, int64_t top_pools) {
  if (!device.is_cuda() || num_tokens <= 0) return 1;
  const int64_t ctas = num_tokens * ((num_heads + cuda::kHeadTile - 1) / cuda::kHeadTile);
  const int64_t target = 2 * cuda::sm_count();
  // At least about one tile of 64 tokens per split.
  const int64_t by_work = std::max<int64_t>(1, (top_pools + 1) / 4);
  return static_cast<int>(std::clamp<int64_t>(target / ctas, 1, std::min<int64_t>(cuda::kMaxSplits, by_work)));
}

size_t dsa_attention_workspace_bytes(Device device, int64_t num_tokens, int64_t num_heads, int64_t latent_dim,
                                     int num_splits) {
  if (!device.is_cuda() || num_splits <= 1) return 0;
  const int64_t rows = num_tokens * ((num_heads + cuda::kHeadTile - 1) / cuda::kHeadTile) * num_splits * cuda::kHeadTile;
  return static_cast<size_t>(rows) * static_cast<size_t>(latent_dim + 2) * sizeof(float);
}

}  // namespace metrale::kernels
