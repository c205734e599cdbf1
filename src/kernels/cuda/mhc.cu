// mHC on the GPU (glm_deepseek.md §2.4). mhc_pre is one kernel per site:
//   tensor-core path (bf16 X and fn): CTA of 4 warps per (tile of 16 tokens, K-slice of the n*D
//     stream values). The (2+n)n = 24 projections are an M = 16 x N = 24 x K = n*D product on
//     mma.sync (the products of bf16 values are exact, the sums fp32: the reference's fp32 GEMM up to
//     summation order); the sum of squares of the unweighted RMSNorm runs beside it on the same
//     staged values. With one K-slice the CTA finishes its tokens; with several (small T, so that
//     the 768 KiB of fn stream through many SMs: a decode step) every CTA writes its partial sums
//     and the last to arrive (an arrival counter per tile, reset by that CTA) adds them in slice
//     order and finishes. Finishing a token: m = inv_rms * dots, the pre/post maps, 20 Sinkhorn
//     steps on the n x n matrix (one thread per token), and h = D(sum_j pre_j X_j) over D columns.
//   generic path (any float dtypes, e.g. f32 activations in tests): one CTA per token, CUDA cores.
// mhc_post and mhc_mean are elementwise over (token, column); each thread owns all n streams of its
// columns, so mhc_post may run in place.
// Bytes per token and site at n = 4, D = 4096, bf16: mhc_pre reads X (32 KiB) once for the products
// and again (L2) for the collapse, writes h (8 KiB); fn (768 KiB) is read once per tile from L2.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/mhc.h"

namespace metrale::kernels {
namespace cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kMaxStreams = 4;
constexpr int kMaxMix = (2 + kMaxStreams) * kMaxStreams;  // 24
constexpr int kTileTokens = 16;
constexpr int kPreThreads = 128;
constexpr int kKStep = 256;  // stream values per staged step of one CTA (64 per warp)

struct HcArgs {
  const void* X;  // [T, n, D], rows strided
  int64_t x_row;
  const void* fn;  // [mix, n*D]
  WeightType fn_type;
  const void* base;  // [mix]
  WeightType base_type;
  const void* scale;  // [3]
  WeightType scale_type;
  float* post;  // [T, n]
  float* comb;  // [T, n, n]
  void* h;      // [T, D], rows strided
  int64_t h_row;
  float* partials;     // [tiles, splits, 16, mix + 1] (split path)
  uint32_t* counters;  // [tiles]
  int tokens, n, D, mix, splits, iters;
  float hc_eps, norm_eps;
};

// The maps of one token from its raw sums: dots[i] = sum_k f_k fn[i][k], sq = sum_k f_k^2.
// Writes post and comb, returns pre in `pre`. n is a template argument so that the n x n matrix
// stays in registers through the Sinkhorn loop (a run-time n puts it on the stack).
template <int n>
__device__ void finish_maps_n(const HcArgs& a, int t, const float* dots, float sq, float* pre) {
  const float inv = rsqrtf(sq / static_cast<float>(n * a.D) + a.norm_eps);
  const float s0 = load_weight(a.scale, a.scale_type, 0), s1 = load_weight(a.scale, a.scale_type, 1),
              s2 = load_weight(a.scale, a.scale_type, 2);
#pragma unroll
  for (int j = 0; j < n; ++j) {
    pre[j] = 1.0f / (1.0f + expf(-(dots[j] * inv * s0 + load_weight(a.base, a.base_type, j)))) + a.hc_eps;
    a.post[static_cast<int64_t>(t) * n + j] =
        2.0f / (1.0f + expf(-(dots[n + j] * inv * s1 + load_weight(a.base, a.base_type, n + j))));
  }
  float M[n][n];
  for (int r = 0; r < n; ++r) {
    float mx = -INFINITY;
    for (int c = 0; c < n; ++c) {
      M[r][c] = dots[2 * n + r * n + c] * inv * s2 + load_weight(a.base, a.base_type, 2 * n + r * n + c);
      mx = fmaxf(mx, M[r][c]);
    }
    float sum = 0.0f;
    for (int c = 0; c < n; ++c) sum += (M[r][c] = expf(M[r][c] - mx));
    for (int c = 0; c < n; ++c) M[r][c] = M[r][c] / sum + a.hc_eps;
  }
  // Sinkhorn: one correctly rounded reciprocal per row or column and n products instead of n
  // divisions (at most one ulp from the division, far below the maps' use).
  for (int it = 0; it < a.iters; ++it) {
    if (it > 0) {
      for (int r = 0; r < n; ++r) {
        float sum = 0.0f;
        for (int c = 0; c < n; ++c) sum += M[r][c];
        const float rcp = __frcp_rn(sum + a.hc_eps);
#pragma unroll
        for (int c = 0; c < n; ++c) M[r][c] *= rcp;
      }
    }
    for (int c = 0; c < n; ++c) {
      float sum = 0.0f;
      for (int r = 0; r < n; ++r) sum += M[r][c];
      const float rcp = __frcp_rn(sum + a.hc_eps);
#pragma unroll
      for (int r = 0; r < n; ++r) M[r][c] *= rcp;
    }
  }
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < n; ++c) a.comb[(static_cast<int64_t>(t) * n + r) * n + c] = M[r][c];
}

__device__ void finish_maps(const HcArgs& a, int t, const float* dots, float sq, float* pre) {
  switch (a.n) {
    case 1: return finish_maps_n<1>(a, t, dots, sq, pre);
    case 2: return finish_maps_n<2>(a, t, dots, sq, pre);
    case 3: return finish_maps_n<3>(a, t, dots, sq, pre);
    default: return finish_maps_n<4>(a, t, dots, sq, pre);
  }
}

// h[t] = D(sum_j pre_j X[t][j]) by the CTA's threads.
template <typename T>
__device__ void collapse(const HcArgs& a, int t, const float* pre) {
  const T* x = static_cast<const T*>(a.X) + static_cast<int64_t>(t) * a.x_row;
  T* out = static_cast<T*>(a.h) + static_cast<int64_t>(t) * a.h_row;
  for (int d = threadIdx.x; d < a.D; d += blockDim.x) {
    float sum = 0.0f;
    for (int j = 0; j < a.n; ++j) sum += pre[j] * to_f32(x[static_cast<int64_t>(j) * a.D + d]);
    out[d] = from_f32<T>(sum);
  }
}

// ---- generic path: one CTA of 256 threads per token ----

template <typename T, typename W>
__global__ void __launch_bounds__(256) hc_pre_generic_kernel(HcArgs a) {
  __shared__ float red[kMaxMix + 1][8];
  __shared__ float pre_s[kMaxStreams];
  const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* x = static_cast<const T*>(a.X) + static_cast<int64_t>(t) * a.x_row;
  const W* fn = static_cast<const W*>(a.fn);
  const int flat = a.n * a.D;
  float acc[kMaxMix + 1] = {};
  for (int k = threadIdx.x; k < flat; k += 256) {
    const float f = to_f32(x[k]);
    acc[kMaxMix] += f * f;
#pragma unroll
    for (int i = 0; i < kMaxMix; ++i) {
      if (i < a.mix) acc[i] += f * to_f32(fn[static_cast<int64_t>(i) * flat + k]);
    }
  }
#pragma unroll
  for (int i = 0; i <= kMaxMix; ++i) {
    const float v = warp_sum(acc[i]);
    if (lane == 0) red[i][warp] = v;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float dots[kMaxMix];
    for (int i = 0; i < a.mix; ++i) {
      float sum = 0.0f;
      for (int w = 0; w < 8; ++w) sum += red[i][w];
      dots[i] = sum;
    }
    float sq = 0.0f;
    for (int w = 0; w < 8; ++w) sq += red[kMaxMix][w];
    finish_maps(a, t, dots, sq, pre_s);
  }
  __syncthreads();
  collapse<T>(a, t, pre_s);
}

// ---- tensor-core path ----

constexpr int kStages = 3;
constexpr int kStepRow = kKStep + 8;  // padded rows: conflict-free ldmatrix
constexpr int kStageX = kTileTokens * kStepRow;
constexpr int kStageFn = kMaxMix * kStepRow;
constexpr int kMmaSmemBytes = kStages * (kStageX + kStageFn) * 2;

// grid (splits, tiles): CTA (slice, tile) covers stream values [slice * K / splits, ...) of tokens
// 16 tile .. 16 tile + 15, in steps of 256 values (64 per warp), three stages deep.
__global__ void __launch_bounds__(kPreThreads) hc_pre_mma_kernel(HcArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float red_s[4][kTileTokens][kMaxMix + 1];
  __shared__ float pre_s[kTileTokens][kMaxStreams];
  __shared__ bool last_s;
  bf16* x_s = reinterpret_cast<bf16*>(smem);                 // [stages][16][kStepRow]
  bf16* fn_s = x_s + kStages * kStageX;                      // [stages][24][kStepRow]
  const int slice = blockIdx.x, tile = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = lane >> 2, quad = lane & 3;
  const int flat = a.n * a.D, per_slice = flat / a.splits;
  const int k_begin = slice * per_slice, steps = per_slice / kKStep;
  const int t0 = tile * kTileTokens, rows = min(kTileTokens, a.tokens - t0);
  const bf16* x = static_cast<const bf16*>(a.X);
  const bf16* fn = static_cast<const bf16*>(a.fn);

  auto load = [&](int step) {
    const int buffer = step % kStages;
    const int k0 = k_begin + step * kKStep;
    bf16* xb = x_s + buffer * kStageX;
    bf16* fb = fn_s + buffer * kStageFn;
    for (int idx = tid; idx < kTileTokens * (kKStep / 8); idx += kPreThreads) {
      const int r = idx / (kKStep / 8), c = (idx % (kKStep / 8)) * 8;
      const bool ok = r < rows;
      attn::cp_async_16(attn::smem_address(xb + r * kStepRow + c),
                        x + static_cast<int64_t>(t0 + (ok ? r : 0)) * a.x_row + k0 + c, ok);
    }
    for (int idx = tid; idx < kMaxMix * (kKStep / 8); idx += kPreThreads) {
      const int r = idx / (kKStep / 8), c = (idx % (kKStep / 8)) * 8;
      const bool ok = r < a.mix;
      attn::cp_async_16(attn::smem_address(fb + r * kStepRow + c), fn + static_cast<int64_t>(ok ? r : 0) * flat + k0 + c,
                        ok);
    }
  };

  float acc[3][4] = {};
  float sq[2] = {0.0f, 0.0f};  // rows group and group + 8, over this lane's values
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < steps) load(st);
    attn::cp_async_commit();
  }
  for (int step = 0; step < steps; ++step) {
    attn::cp_async_wait<kStages - 2>();
    __syncthreads();  // stage `step` visible; every warp is done with the stage the next load refills
    if (step + kStages - 1 < steps) load(step + kStages - 1);
    attn::cp_async_commit();
    const bf16* xb = x_s + (step % kStages) * kStageX;
    const bf16* fb = fn_s + (step % kStages) * kStageFn;
#pragma unroll
    for (int sub = 0; sub < kKStep / 64; ++sub) {
      const int k16 = warp * (kKStep / 4) + sub * 16;  // warp w takes a quarter of the step
      uint32_t af[4];
      attn::ldmatrix_x4(af, attn::smem_address(xb + (lane & 15) * kStepRow + k16 + (lane >> 4) * 8));
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float lo = __uint_as_float(af[r] << 16), hi = __uint_as_float(af[r] & 0xffff0000u);
        sq[r & 1] += lo * lo + hi * hi;
      }
#pragma unroll
      for (int nt = 0; nt < 3; ++nt) {
        uint32_t bf[2];
        // B[k][n] = fn[n][k]: rows of fn_s as stored are the col-major fragment (x2: k 0-7, 8-15).
        const int m = (lane >> 3) & 1, i8 = lane & 7;
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                     : "=r"(bf[0]), "=r"(bf[1])
                     : "r"(attn::smem_address(fb + (nt * 8 + i8) * kStepRow + k16 + m * 8)));
        attn::mma_bf16_16816(acc[nt], af, bf[0], bf[1]);
      }
    }
  }
  attn::cp_async_wait<0>();
  // Per-warp sums to shared: rows group (+8), columns 8 nt + 2 quad (+1); squares per row.
#pragma unroll
  for (int nt = 0; nt < 3; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) red_s[warp][group + (e >> 1) * 8][nt * 8 + 2 * quad + (e & 1)] = acc[nt][e];
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float v = sq[hr];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    if (quad == 0) red_s[warp][group + hr * 8][kMaxMix] = v;
  }
  __syncthreads();
  // This slice's totals for (token row, value): warps summed in order.
  constexpr int kValues = kTileTokens * (kMaxMix + 1);
  const int values = rows * (kMaxMix + 1);  // only the tile's real tokens travel through the workspace
  float* part = a.partials == nullptr ? nullptr
                                      : a.partials + (static_cast<int64_t>(tile) * a.splits + slice) * kValues;
  for (int idx = tid; idx < values; idx += kPreThreads) {
    const int r = idx / (kMaxMix + 1), c = idx % (kMaxMix + 1);
    const float v = ((red_s[0][r][c] + red_s[1][r][c]) + red_s[2][r][c]) + red_s[3][r][c];
    if (part != nullptr) {
      part[idx] = v;
    } else {
      red_s[0][r][c] = v;  // the same thread read it
    }
  }
  if (part != nullptr) {
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      const uint32_t arrived = atomicAdd(a.counters + tile, 1u);
      last_s = arrived == static_cast<uint32_t>(a.splits - 1);
      if (last_s) a.counters[tile] = 0;  // ready for the next call (and graph replay)
    }
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    // The slices' sums: warp w adds slices [w S/4, (w+1) S/4) of each value in order (sixteen
    // loads in flight), then the four warp sums are added in warp order (a fixed association).
    const float* tile_parts = a.partials + static_cast<int64_t>(tile) * a.splits * kValues;
    const int per_warp = (a.splits + 3) / 4, sl_begin = warp * per_warp, sl_end = min(a.splits, sl_begin + per_warp);
    float* group_sums = &red_s[0][0][0];  // [4][kValues]: red_s's space, free again
    for (int idx = lane; idx < values; idx += 32) {
      float v = 0.0f;
      for (int sl0 = sl_begin; sl0 < sl_end; sl0 += 16) {
        float p[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) p[j] = sl0 + j < sl_end ? __ldcg(tile_parts + (sl0 + j) * kValues + idx) : 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) v += p[j];
      }
      group_sums[warp * kValues + idx] = v;
    }
    __syncthreads();
    for (int idx = tid; idx < values; idx += kPreThreads) {
      const float v = ((group_sums[idx] + group_sums[kValues + idx]) + group_sums[2 * kValues + idx]) +
                      group_sums[3 * kValues + idx];
      red_s[0][idx / (kMaxMix + 1)][idx % (kMaxMix + 1)] = v;  // = group_sums[idx]: read by this thread above
    }
  }
  __syncthreads();
  if (tid < rows) finish_maps(a, t0 + tid, red_s[0][tid], red_s[0][tid][kMaxMix], pre_s[tid]);
  __syncthreads();
  // h = D(sum_j pre_j X_j): the tile's tokens x 8-column pieces over the threads, 16-byte accesses.
  const int pieces = a.D / 8;
  bf16* h = static_cast<bf16*>(a.h);
#pragma unroll 2
  for (int idx = tid; idx < rows * pieces; idx += kPreThreads) {
    const int r = idx / pieces, c = (idx % pieces) * 8;
    const bf16* xr = x + static_cast<int64_t>(t0 + r) * a.x_row + c;
    float sum[8] = {};
    for (int j = 0; j < a.n; ++j) {
      const uint4 raw = *reinterpret_cast<const uint4*>(xr + static_cast<int64_t>(j) * a.D);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
      const float w = pre_s[r][j];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sum[2 * e] += w * __uint_as_float(words[e] << 16);
        sum[2 * e + 1] += w * __uint_as_float(words[e] & 0xffff0000u);
      }
    }
    uint4 packed;
    packed.x = attn::pack_bf16x2(sum[0], sum[1]);
    packed.y = attn::pack_bf16x2(sum[2], sum[3]);
    packed.z = attn::pack_bf16x2(sum[4], sum[5]);
    packed.w = attn::pack_bf16x2(sum[6], sum[7]);
    *reinterpret_cast<uint4*>(h + static_cast<int64_t>(t0 + r) * a.h_row + c) = packed;
  }
}

// ---- mhc_post / mhc_mean ----

// Thread per (token, kVec columns): all n streams of those columns in, all n out.
template <typename T, int kVec>
__global__ void __launch_bounds__(256) hc_post_kernel(const T* X, int64_t x_row, const T* y, int64_t y_row,
                                                      const float* post, const float* comb, T* out, int64_t out_row,
                                                      int n, int D) {
  using V = Vec<T, kVec>;
  const int t = blockIdx.y;
  const int d = (blockIdx.x * 256 + threadIdx.x) * kVec;
  if (d >= D) return;
  float xs[kMaxStreams][kVec];
#pragma unroll
  for (int j = 0; j < kMaxStreams; ++j) {
    if (j < n) {
      const V raw = *reinterpret_cast<const V*>(X + static_cast<int64_t>(t) * x_row + static_cast<int64_t>(j) * D + d);
#pragma unroll
      for (int e = 0; e < kVec; ++e) xs[j][e] = to_f32(raw.v[e]);
    }
  }
  const V yraw = *reinterpret_cast<const V*>(y + static_cast<int64_t>(t) * y_row + d);
  const float* M = comb + static_cast<int64_t>(t) * n * n;
  for (int c = 0; c < n; ++c) {
    float m[kMaxStreams];
#pragma unroll
    for (int j = 0; j < kMaxStreams; ++j) m[j] = j < n ? to_f32(from_f32<T>(M[j * n + c])) : 0.0f;
    const float p = to_f32(from_f32<T>(post[static_cast<int64_t>(t) * n + c]));
    V o;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      float mixed = 0.0f;
#pragma unroll
      for (int j = 0; j < kMaxStreams; ++j) {
        if (j < n) mixed += m[j] * xs[j][e];
      }
      const float placed = to_f32(from_f32<T>(p * to_f32(yraw.v[e])));
      o.v[e] = from_f32<T>(placed + to_f32(from_f32<T>(mixed)));
    }
    *reinterpret_cast<V*>(out + static_cast<int64_t>(t) * out_row + static_cast<int64_t>(c) * D + d) = o;
  }
}

template <typename T>
__global__ void __launch_bounds__(256) hc_mean_kernel(const T* X, int64_t x_row, T* out, int64_t out_row, int n, int D) {
  const int t = blockIdx.y;
  const int d = blockIdx.x * 256 + threadIdx.x;
  if (d >= D) return;
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) sum += to_f32(X[static_cast<int64_t>(t) * x_row + static_cast<int64_t>(j) * D + d]);
  out[static_cast<int64_t>(t) * out_row + d] = from_f32<T>(sum / static_cast<float>(n));
}

// ---- planning ----

int64_t tiles_of(int64_t tokens) { return (tokens + kTileTokens - 1) / kTileTokens; }

// K-slices per tile: enough CTAs to spread fn over the GPU at small T; a power of two dividing
// n*D / 256 (each slice a whole number of staged steps).
int splits_for(int64_t tokens, int64_t flat) {
  const int64_t tiles = tiles_of(tokens);
  int splits = 1;
  while (splits < 64 && tiles * splits * 2 <= 264 && flat % (static_cast<int64_t>(splits) * 2 * kKStep) == 0) {
    splits *= 2;
  }
  return splits;
}

// Raises hc_pre_mma_kernel's dynamic shared-memory limit once per device.
void allow_mma_smem() {
  static std::mutex mutex;
  static uint64_t done = 0;
  int device = 0;
  METRALE_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lock(mutex);
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit != 0 && (done & bit) != 0) return;
  METRALE_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(hc_pre_mma_kernel),
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, kMmaSmemBytes));
  done |= bit;
}

size_t counters_bytes(int64_t tiles) { return (static_cast<size_t>(tiles) * 4 + 255) / 256 * 256; }

void check_streams(const char* op, const Tensor& X) {
  METRALE_EXPECT(X.device().is_cuda() && X.ndim() == 3 && X.stride(2) == 1 && X.stride(1) == X.size(2),
                 std::string(op) + ": X " + X.describe() + " must be [T, n, D] with contiguous streams on the GPU");
  METRALE_EXPECT(X.size(1) >= 1 && X.size(1) <= kMaxStreams, std::string(op) + ": at most 4 streams on CUDA");
}

}  // namespace

void mhc_pre(const Tensor& X, const Tensor& fn, const Tensor& base, const Tensor& scale, const Tensor& post,
            const Tensor& comb, const Tensor& h, const MhcParams& params) {
  const char* op = "mhc_pre";
  check_streams(op, X);
  const int64_t tokens = X.size(0), n = X.size(1), D = X.size(2), flat = n * D, mix = (2 + n) * n;
  for (const Tensor* t : {&fn, &base, &scale, &post, &comb, &h}) {
    METRALE_EXPECT(t->device().is_cuda(), std::string(op) + ": tensors must be on the GPU (" + t->describe() + ")");
  }
  METRALE_EXPECT(fn.ndim() == 2 && fn.size(0) == mix && fn.size(1) == flat && fn.is_contiguous(),
                 std::string(op) + ": fn " + fn.describe());
  METRALE_EXPECT(base.numel() == mix && scale.numel() == 3 && base.is_contiguous() && scale.is_contiguous(),
                 std::string(op) + ": base " + base.describe() + " scale " + scale.describe());
  METRALE_EXPECT(post.dtype() == DType::kF32 && post.is_contiguous() && post.numel() == tokens * n &&
                     comb.dtype() == DType::kF32 && comb.is_contiguous() && comb.numel() == tokens * n * n,
                 std::string(op) + ": post " + post.describe() + " comb " + comb.describe());
  METRALE_EXPECT(h.ndim() == 2 && h.size(0) == tokens && h.size(1) == D && h.stride(1) == 1 && h.dtype() == X.dtype(),
                 std::string(op) + ": h " + h.describe());
  METRALE_EXPECT(params.sinkhorn_iters >= 1 && tokens <= INT32_MAX && flat <= INT32_MAX,
                 std::string(op) + ": bad iteration count or size");
  HcArgs a{};
  a.X = X.data();
  a.x_row = X.stride(0);
  a.fn = fn.data();
  a.fn_type = weight_type_of(fn, op);
  a.base = base.data();
  a.base_type = weight_type_of(base, op);
  a.scale = scale.data();
  a.scale_type = weight_type_of(scale, op);
  a.post = post.data_as<float>();
  a.comb = comb.data_as<float>();
  a.h = h.data();
  a.h_row = h.stride(0);
  a.tokens = static_cast<int>(tokens);
  a.n = static_cast<int>(n);
  a.D = static_cast<int>(D);
  a.mix = static_cast<int>(mix);
  a.iters = params.sinkhorn_iters;
  a.hc_eps = params.hc_eps;
  a.norm_eps = params.norm_eps;
  if (tokens == 0) return;
  const cudaStream_t stream = stream_of(h);
  const bool aligned = reinterpret_cast<uintptr_t>(X.data()) % 16 == 0 && X.stride(0) % 8 == 0 &&
                       reinterpret_cast<uintptr_t>(fn.data()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(h.data()) % 16 == 0 && h.stride(0) % 8 == 0 && D % 8 == 0;
  if (X.dtype() == DType::kBF16 && fn.dtype() == DType::kBF16 && flat % kKStep == 0 && aligned) {
    const int64_t tiles = tiles_of(tokens);
    a.splits = splits_for(tokens, flat);
    if (a.splits > 1) {
      const Tensor& ws = params.workspace;
      const size_t needed = mhc_pre_workspace_bytes(h.device(), tokens, n, D);
      METRALE_EXPECT(!ws.empty() && ws.device().is_cuda() && ws.nbytes() >= needed &&
                         reinterpret_cast<uintptr_t>(ws.data()) % 256 == 0,
                     std::string(op) + ": workspace " + ws.describe() + " below the " + std::to_string(needed) +
                         " bytes of mhc_pre_workspace_bytes (or not 256-byte aligned)");
      a.counters = ws.data_as<uint32_t>();
      a.partials = reinterpret_cast<float*>(static_cast<char*>(ws.data()) + counters_bytes(tiles));
    }
    METRALE_EXPECT(tiles <= 65535, std::string(op) + ": too many tokens for one call");
    allow_mma_smem();
    hc_pre_mma_kernel<<<dim3(static_cast<unsigned>(a.splits), static_cast<unsigned>(tiles)), kPreThreads,
                        kMmaSmemBytes, stream>>>(a);
  } else {
    METRALE_DISPATCH_FLOAT(X.dtype(), op, [&] {
      using T = scalar_t;
      if (fn.dtype() == DType::kBF16) {
        hc_pre_generic_kernel<T, bf16><<<static_cast<unsigned>(tokens), 256, 0, stream>>>(a);
      } else if (fn.dtype() == DType::kF32) {
        hc_pre_generic_kernel<T, float><<<static_cast<unsigned>(tokens), 256, 0, stream>>>(a);
      } else {
        raise_message(ErrorCode::kUnsupported, "mhc_pre: fn must be bf16 or f32 on CUDA");
      }
    });
  }
  METRALE_CHECK_LAUNCH(op);
}

void mhc_post(const Tensor& X, const Tensor& y, const Tensor& post, const Tensor& comb, const Tensor& out) {
  const char* op = "mhc_post";
  check_streams(op, X);
  const int64_t tokens = X.size(0), n = X.size(1), D = X.size(2);
  METRALE_EXPECT(out.device().is_cuda() && out.ndim() == 3 && out.size(0) == tokens && out.size(1) == n &&
                     out.size(2) == D && out.stride(2) == 1 && out.stride(1) == D && out.dtype() == X.dtype(),
                 std::string(op) + ": out " + out.describe());
  METRALE_EXPECT(y.device().is_cuda() && y.ndim() == 2 && y.size(0) == tokens && y.size(1) == D && y.stride(1) == 1 &&
                     y.dtype() == X.dtype(),
                 std::string(op) + ": y " + y.describe());
  METRALE_EXPECT(post.dtype() == DType::kF32 && post.is_contiguous() && post.numel() == tokens * n &&
                     comb.dtype() == DType::kF32 && comb.is_contiguous() && comb.numel() == tokens * n * n,
                 std::string(op) + ": post " + post.describe() + " comb " + comb.describe());
  if (tokens == 0) return;
  METRALE_EXPECT(tokens <= 65535, std::string(op) + ": too many tokens for one call");
  const auto element = static_cast<int64_t>(X.element_size());
  const bool vectorised = D % (16 / element) == 0 && reinterpret_cast<uintptr_t>(X.data()) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(y.data()) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(out.data()) % 16 == 0 && (X.stride(0) * element) % 16 == 0 &&
                          (y.stride(0) * element) % 16 == 0 && (out.stride(0) * element) % 16 == 0;
  METRALE_DISPATCH_FLOAT(X.dtype(), op, [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const auto launch = [&](auto vec) {
      constexpr int kV = decltype(vec)::value;
      const dim3 grid(static_cast<unsigned>(ceil_div(D, 256 * kV)), static_cast<unsigned>(tokens));
      hc_post_kernel<scalar_t, kV><<<grid, 256, 0, stream_of(out)>>>(
          X.data_as<const scalar_t>(), X.stride(0), y.data_as<const scalar_t>(), y.stride(0),
          post.data_as<const float>(), comb.data_as<const float>(), out.data_as<scalar_t>(), out.stride(0),
          static_cast<int>(n), static_cast<int>(D));
    };
    if (vectorised) {
      launch(std::integral_constant<int, kVec>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
  });
  METRALE_CHECK_LAUNCH(op);
}

void mhc_mean(const Tensor& X, const Tensor& out) {
  const char* op = "mhc_mean";
  check_streams(op, X);
  const int64_t tokens = X.size(0), n = X.size(1), D = X.size(2);
  METRALE_EXPECT(out.device().is_cuda() && out.ndim() == 2 && out.size(0) == tokens && out.size(1) == D &&
                     out.stride(1) == 1 && out.dtype() == X.dtype(),
                 std::string(op) + ": out " + out.describe());
  if (tokens == 0) return;
  METRALE_EXPECT(tokens <= 65535, std::string(op) + ": too many tokens for one call");
  const dim3 grid(static_cast<unsigned>(ceil_div(D, 256)), static_cast<unsigned>(tokens));
  METRALE_DISPATCH_FLOAT(X.dtype(), op, [&] {
    hc_mean_kernel<scalar_t><<<grid, 256, 0, stream_of(out)>>>(X.data_as<const scalar_t>(), X.stride(0),
                                                               out.data_as<scalar_t>(), out.stride(0),
                                                               static_cast<int>(n), static_cast<int>(D));
  });
  METRALE_CHECK_LAUNCH(op);
}

}  // namespace cuda

size_t mhc_pre_workspace_bytes(Device device, int64_t num_tokens, int64_t num_streams, int64_t hidden_size) {
  if (!device.is_cuda() || num_tokens <= 0) return 0;
  const int64_t tiles = cuda::tiles_of(num_tokens);
  const int splits = cuda::splits_for(num_tokens, num_streams * hidden_size);
  if (splits <= 1) return 0;
  return cuda::counters_bytes(tiles) + static_cast<size_t>(tiles) * static_cast<size_t>(splits) * cuda::kTileTokens *
                                           (cuda::kMaxMix + 1) * sizeof(float);
}

}  // namespace metrale::kernels
