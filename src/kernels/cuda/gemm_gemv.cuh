// Warp-level GEMV building blocks shared by the dense linear (small M) and the MoE decode kernels.
//
// A warp owns R weight rows and M input rows. Lane l reads 8-element (16-byte) chunks l, l + 32,
// l + 64, ... of every row, U chunks per row in flight before the first is used, and keeps fp32
// partial sums acc[r][m]; a warp reduction finishes each dot product. Weight rows are read exactly
// once and bypass L1 (ld.global.nc.L1::no_allocate); input rows are small and reused by every warp
// of the SM, so they go through L1.
//
// Requirements (checked by the hosts): K % 8 == 0; weight rows, input rows and their base pointers
// 16-byte aligned.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace metrale::kernels::cuda::gemv {

constexpr int kChunk = 8;  // elements per 16-byte weight load

// A streamed 16-byte load: read once, so it must not evict the reused inputs from L1.
__device__ __forceinline__ uint4 load_streaming_16(const void* pointer) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(pointer));
  return v;
}

// Eight bf16 (little-endian pairs in four words) to fp32: a bf16 is the high half of an fp32.
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&f)[8]) {
  f[0] = __uint_as_float(v.x << 16);
  f[1] = __uint_as_float(v.x & 0xffff0000u);
  f[2] = __uint_as_float(v.y << 16);
  f[3] = __uint_as_float(v.y & 0xffff0000u);
  f[4] = __uint_as_float(v.z << 16);
  f[5] = __uint_as_float(v.z & 0xffff0000u);
  f[6] = __uint_as_float(v.w << 16);
  f[7] = __uint_as_float(v.w & 0xffff0000u);
}

// One 8-element chunk of an input row, as loaded (converted to fp32 at use). Inputs are read with
// coherent loads, never through the non-coherent path (ld.global.nc): a kernel launched through
// pdl::launch reads inputs its producer wrote while it was already running, which .nc does not allow.
// The kernels keep input pointers free of __restrict__ for the same reason (const + restrict lets
// the compiler pick .nc on its own).
template <typename XT>
struct InputChunk;

template <>
struct InputChunk<__nv_bfloat16> {
  uint4 raw;
  __device__ __forceinline__ void load(const __nv_bfloat16* p) { raw = *reinterpret_cast<const uint4*>(p); }
  __device__ __forceinline__ void zero() { raw = make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ void to_f32(float (&f)[8]) const { unpack_bf16x8(raw, f); }
};

template <>
struct InputChunk<float> {
  float4 lo, hi;
  __device__ __forceinline__ void load(const float* p) {
    lo = reinterpret_cast<const float4*>(p)[0];
    hi = reinterpret_cast<const float4*>(p)[1];
  }
  __device__ __forceinline__ void zero() { lo = hi = make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
  __device__ __forceinline__ void to_f32(float (&f)[8]) const {
    f[0] = lo.x, f[1] = lo.y, f[2] = lo.z, f[3] = lo.w;
    f[4] = hi.x, f[5] = hi.y, f[6] = hi.z, f[7] = hi.w;
  }
};

// What runs between the first weight loads and the first input loads: nothing, or the wait for the
// kernel that produced the inputs (pdl.cuh), so the first loads overlap that kernel's tail.
struct NoInputWait {
  __device__ __forceinline__ void operator()() const {}
};

// acc[r][m] += this lane's share of dot(w[r][0:8*chunks], x[m][0:8*chunks]). Rows m >= m_valid are
// loaded (their pointers must still be valid) but not accumulated. Lanes may finish at different
// iterations; nothing here synchronises the warp. before_inputs() runs once per lane, after the
// first step's weight loads are issued and before any input is read (also in a lane with no chunk).
template <int R, int M, int U, typename XT, typename BeforeInputs = NoInputWait>
__device__ __forceinline__ void warp_dot_partial(const __nv_bfloat16* const (&w)[R], const XT* const (&x)[M],
                                                 int m_valid, int chunks, int lane, float (&acc)[R][M],
                                                 BeforeInputs before_inputs = {}) {
  bool inputs_ready = false;
  for (int base = lane; base < chunks; base += 32 * U) {
    // Loads and their uses sit under the same predicate and nothing selects on loaded data, so all
    // R * U weight loads of a step issue before the first use.
    uint4 wv[U][R];
    InputChunk<XT> xv[U][M];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + u * 32;
      if (c < chunks) {
#pragma unroll
        for (int r = 0; r < R; ++r) wv[u][r] = load_streaming_16(w[r] + static_cast<int64_t>(c) * kChunk);
      }
    }
    if (!inputs_ready) {
      before_inputs();
      inputs_ready = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = base + u * 32;
      if (c < chunks) {
#pragma unroll
        for (int m = 0; m < M; ++m) xv[u][m].load(x[m] + static_cast<int64_t>(c) * kChunk);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * 32 < chunks) {
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) unpack_bf16x8(wv[u][r], wf[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          if (M == 1 || m < m_valid) {
            float xf[8];
            xv[u][m].to_f32(xf);
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[r][m] = fmaf(wf[r][i], xf[i], acc[r][m]);
            }
          }
        }
      }
    }
  }
  if (!inputs_ready) before_inputs();
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

}  // namespace metrale::kernels::cuda::gemv
