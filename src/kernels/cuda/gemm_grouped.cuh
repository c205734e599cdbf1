// Grouped GEMM over expert segments for the MoE prefill path: tensor cores through
// mma.sync.m16n8k16 (bf16 in, fp32 accumulate), cp.async multi-stage pipeline, ldmatrix from
// XOR-swizzled shared memory.
//
// Rows are (token, slot) pairs sorted by expert: expert e owns rows [offsets[e], offsets[e+1]).
// The grid is sized from host-known bounds only (graph-safe): block b takes output tile
// (m_tile = b / n_tiles, n_tile = b % n_tiles), where m-tiles are numbered over the concatenated
// expert segments (each segment padded to a multiple of kBlockM rows); blocks past the last tile
// exit at once. There are at most floor(P / kBlockM) + min(E, P) m-tiles for P rows.
//
// Block tile 128 x 128 x 64, 8 warps as 2 (M) x 4 (N), warp tile 64 x 32, 3 stages (96 KiB of
// dynamic shared memory), 2 blocks per SM.
//
// B may be FP8 (kFp8B): e4m3 codes with fp32 128x128 block scales. Those tiles are loaded through
// registers instead of cp.async: each thread reads its 8 codes, dequantises them with their block's
// scale and stores the 8 bf16 values where cp.async would have put them, so the tensor-core loop is
// unchanged (the prefill path of FP8 experts; an FP8 wgmma GEMM would read half the bytes per MMA).
//
// Two epilogues:
//   kSwiGlu: A rows are x[sorted_slots[p] / top_k]; B is an expert's fused gate_up [2I, K]. The
//     block's 128 B rows interleave 8 gate rows and the matching 8 up rows, so each thread holds
//     gate and up for the same output column and writes h = silu(gate) * up (bf16) for 64 columns
//     (gate and up clamped first for the clamped SwiGLU).
//   kScatterF32: A rows are h[p] (sorted order); B is an expert's down [H, K]; row p goes to
//     out[sorted_slots[p]] (f32, slot order).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace metrale::kernels::cuda::grouped {

constexpr int kBlockM = 128;
constexpr int kBlockN = 128;  // B rows per block (kSwiGlu: 64 gate + 64 up rows = 64 output columns)
constexpr int kBlockK = 64;
constexpr int kStages = 3;
constexpr int kThreads = 256;
constexpr int kChunksPerRow = kBlockK / 8;             // 16-byte chunks per tile row
constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // tile rows one pass of the block copies
constexpr int kLoadPasses = kBlockM / kRowsPerPass;     // passes per operand tile
constexpr int kTileElements = kBlockM * kBlockK;        // one operand tile of one stage (kBlockM == kBlockN)
constexpr int kSmemBytes = kStages * 2 * kTileElements * 2;
static_assert(kBlockM == kBlockN, "A and B tiles share the swizzled [128][kBlockK] layout");
static_assert(kBlockK == 32 || kBlockK == 64, "tile_offset swizzles 64- or 128-byte rows");
static_assert(kBlockM % kRowsPerPass == 0, "loader passes cover the tile");

enum class Epilogue { kSwiGlu, kScatterF32 };

struct Params {
  const __nv_bfloat16* a;          // kSwiGlu: x [T, K]; kScatterF32: h [P, K] (sorted order)
  int64_t a_stride;                // elements between A rows
  const int32_t* sorted_slots;     // [P] slot id at each sorted position
  const int32_t* expert_offsets;   // [E + 1]
  int num_experts;
  int top_k;                       // kSwiGlu: the token of slot s is s / top_k
  const __nv_bfloat16* b;          // [E, rows_b, K] contiguous: gate_up [E, 2I, K] or down [E, H, K]
  int64_t b_expert_stride;         // rows_b * K
  // kFp8B: b_codes replaces b (same layout, e4m3); b_scales [E, scale_rows, ceil(K/128)] f32. A B row
  // r reads scale row r / 128, except kSwiGlu's up rows (fused rows n + i), which read
  // b_up_scale_row0 + i / 128 (the up rows' scale blocks follow the gate rows').
  const uint8_t* b_codes;
  const float* b_scales;
  int64_t b_scale_expert_stride;  // scale_rows * ceil(K/128)
  int b_up_scale_row0;
  int n;                           // output columns: I (kSwiGlu) or H (kScatterF32)
  int k;
  void* out;                       // kSwiGlu: h [P, I] bf16 (sorted order); kScatterF32: [P, H] f32 (slot order)
  int64_t out_stride;              // elements
  int n_tiles;
  float swiglu_limit;              // kSwiGlu: > 0 clamps gate above and up both ways first (0: no clamp)
};

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16-byte asynchronous copy global -> shared; `valid` false zero-fills (no bytes are read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element offset of 16-byte chunk `chunk` of row `row` in a [128][kBlockK] bf16 tile, XOR-swizzled
// so that the eight rows an ldmatrix phase reads (same logical chunk, consecutive rows) land on
// eight different 16-byte bank groups. 128-byte rows (kBlockK 64): chunk ^ (row % 8). 64-byte rows
// (kBlockK 32; two rows share a bank line): chunk ^ ((row / 2) % 4).
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  if constexpr (kChunksPerRow == 8) {
    return row * kBlockK + ((chunk ^ (row & 7)) << 3);
  } else {
    return row * kBlockK + ((chunk ^ ((row >> 1) & 3)) << 3);
  }
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// 8 e4m3 codes times their block scale, as 8 bf16 values (one 16-byte shared-memory chunk).
__device__ __forceinline__ uint4 dequantise_chunk(uint2 packed, float scale) {
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(&packed);
  uint4 out;
  uint32_t* words = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    __nv_fp8_e4m3 lo, hi;
    lo.__x = codes[2 * j];
    hi.__x = codes[2 * j + 1];
    const __nv_bfloat162 pair = __floats2bfloat162_rn(static_cast<float>(lo) * scale, static_cast<float>(hi) * scale);
    words[j] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return out;
}

__device__ __forceinline__ void store_shared_16(uint32_t dst, uint4 value) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(value.x), "r"(value.y), "r"(value.z),
               "r"(value.w)
               : "memory");
}

template <Epilogue kEpilogue, bool kFp8B = false>
__global__ void __launch_bounds__(kThreads, 2) grouped_gemm_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  __shared__ int tile_expert, tile_row_begin, tile_rows;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int m_tile = blockIdx.x / p.n_tiles, n_tile = blockIdx.x % p.n_tiles;

  // Which expert's segment holds m-tile `m_tile`: expert e owns ceil(count_e / kBlockM) consecutive
  // m-tiles. Warp 0 scans the experts 32 at a time.
  if (warp == 0) {
    int found_expert = -1, found_begin = 0, found_rows = 0;
    int tiles_before = 0;
    for (int base = 0; base < p.num_experts; base += 32) {
      const int e = base + lane;
      int begin = 0, count = 0;
      if (e < p.num_experts) {
        begin = p.expert_offsets[e];
        count = p.expert_offsets[e + 1] - begin;
      }
      const int tiles = (count + kBlockM - 1) / kBlockM;
      int inclusive = tiles;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += v;
      }
      const int first = tiles_before + inclusive - tiles;
      if (m_tile >= first && m_tile < first + tiles) {
        found_expert = e;
        found_begin = begin + (m_tile - first) * kBlockM;
        found_rows = min(kBlockM, count - (m_tile - first) * kBlockM);
      }
      tiles_before += __shfl_sync(0xffffffffu, inclusive, 31);
      if (tiles_before > m_tile) break;  // warp-uniform
    }
    if (lane == 0) tile_expert = -1;
    __syncwarp();
    if (found_expert >= 0) {
      tile_expert = found_expert;
      tile_row_begin = found_begin;
      tile_rows = found_rows;
    }
  }
  __syncthreads();
  const int expert = tile_expert;
  if (expert < 0) return;  // past the last tile (uniform over the block)
  const int row_begin = tile_row_begin, rows = tile_rows;

  // Loader roles: thread t copies 16-byte chunk t % kChunksPerRow of tile rows
  // t / kChunksPerRow + i * kRowsPerPass, of both A and B.
  const int load_chunk = tid % kChunksPerRow;
  const __nv_bfloat16* a_src[kLoadPasses];
  const __nv_bfloat16* b_src[kLoadPasses];
  const uint8_t* b_code_src[kLoadPasses];  // kFp8B
  const float* b_scale_src[kLoadPasses];   // kFp8B: the row's block scales
  bool a_valid[kLoadPasses], b_valid[kLoadPasses];
#pragma unroll
  for (int i = 0; i < kLoadPasses; ++i) {
    const int r = tid / kChunksPerRow + i * kRowsPerPass;
    a_valid[i] = r < rows;
    int64_t a_row = 0;
    if (a_valid[i]) {
      if constexpr (kEpilogue == Epilogue::kSwiGlu) {
        a_row = p.sorted_slots[row_begin + r] / p.top_k;
      } else {
        a_row = row_begin + r;
      }
    }
    a_src[i] = p.a + a_row * p.a_stride + load_chunk * 8;
    int col, b_row, scale_row;
    if constexpr (kEpilogue == Epilogue::kSwiGlu) {
      // Tile rows 16q .. 16q+7: gate rows of output columns 8q .. 8q+7; 16q+8 .. 16q+15: their up rows.
      const int within = r & 15;
      col = n_tile * (kBlockN / 2) + (r >> 4) * 8 + (within & 7);
      b_row = within < 8 ? col : p.n + col;
      scale_row = within < 8 ? col / 128 : p.b_up_scale_row0 + col / 128;
    } else {
      col = n_tile * kBlockN + r;
      b_row = col;
      scale_row = col / 128;
    }
    b_valid[i] = col < p.n;
    const int64_t b_offset = static_cast<int64_t>(expert) * p.b_expert_stride +
                             static_cast<int64_t>(b_valid[i] ? b_row : 0) * p.k + load_chunk * 8;
    if constexpr (kFp8B) {
      b_src[i] = nullptr;
      b_code_src[i] = p.b_codes + b_offset;
      b_scale_src[i] = p.b_scales + static_cast<int64_t>(expert) * p.b_scale_expert_stride +
                       static_cast<int64_t>(b_valid[i] ? scale_row : 0) * ((p.k + 127) / 128);
    } else {
      b_src[i] = p.b + b_offset;
      b_code_src[i] = nullptr;
      b_scale_src[i] = nullptr;
      (void)scale_row;
    }
  }

  const uint32_t smem = shared_address(smem_bytes);
  const auto load_stage = [&](int stage, int k_tile) {
    const int k_offset = k_tile * kBlockK;
    const bool k_valid = k_offset + load_chunk * 8 < p.k;  // K % 8 == 0: a chunk is all in or all out
#pragma unroll
    for (int i = 0; i < kLoadPasses; ++i) {
      const int r = tid / kChunksPerRow + i * kRowsPerPass;
      const uint32_t offset = static_cast<uint32_t>(tile_offset(r, load_chunk)) * 2u;
      const uint32_t a_dst = smem + static_cast<uint32_t>(stage * 2 * kTileElements) * 2u + offset;
      const uint32_t b_dst = a_dst + static_cast<uint32_t>(kTileElements) * 2u;
      const bool a_ok = a_valid[i] && k_valid, b_ok = b_valid[i] && k_valid;
      cp_async_16(a_dst, a_ok ? a_src[i] + k_offset : p.a, a_ok);
      if constexpr (kFp8B) {
        // A chunk of 8 never crosses a 128-column scale block (chunks start at multiples of 8).
        uint4 value = make_uint4(0u, 0u, 0u, 0u);
        if (b_ok) {
          const uint2 packed = *reinterpret_cast<const uint2*>(b_code_src[i] + k_offset);
          value = dequantise_chunk(packed, b_scale_src[i][(k_offset + load_chunk * 8) / 128]);
        }
        store_shared_16(b_dst, value);
      } else {
        cp_async_16(b_dst, b_ok ? b_src[i] + k_offset : p.b, b_ok);
      }
    }
  };

  const int k_tiles = (p.k + kBlockK - 1) / kBlockK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }

  float acc[4][4][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.0f;
    }
  }
  const int warp_m = warp >> 2, warp_n = warp & 3;

  for (int kt = 0; kt < k_tiles; ++kt) {
    // Stage kt has landed for this thread; the barrier makes it visible to all and guarantees that
    // every warp finished reading stage (kt - 1) % kStages, which the load below overwrites.
    cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int next = kt + kStages - 1;
      if (next < k_tiles) load_stage(next % kStages, next);
      cp_async_commit();  // always, so that wait_group counts stay aligned with stages
    }
    const uint32_t a_tile = smem + static_cast<uint32_t>((kt % kStages) * 2 * kTileElements) * 2u;
    const uint32_t b_tile = a_tile + static_cast<uint32_t>(kTileElements) * 2u;
#pragma unroll
    for (int ks = 0; ks < kBlockK / 16; ++ks) {
      uint32_t a_frag[4][4];
      uint32_t b_frag[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        // Matrices: rows 0-7 / 8-15 of k 0-7, then of k 8-15 (the mma's a0..a3 order).
        const int row = warp_m * 64 + mi * 16 + (lane & 15);
        const int chunk = ks * 2 + (lane >> 4);
        ldmatrix_x4(a_frag[mi], a_tile + static_cast<uint32_t>(tile_offset(row, chunk)) * 2u);
      }
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        // Matrices: n 0-7 at k 0-7 and k 8-15 (b0, b1 of n-tile 2nj), then n 8-15 (of n-tile 2nj+1).
        const int row = warp_n * 32 + nj * 16 + ((lane >> 4) << 3) + (lane & 7);
        const int chunk = ks * 2 + ((lane >> 3) & 1);
        uint32_t r[4];
        ldmatrix_x4(r, b_tile + static_cast<uint32_t>(tile_offset(row, chunk)) * 2u);
        b_frag[2 * nj][0] = r[0];
        b_frag[2 * nj][1] = r[1];
        b_frag[2 * nj + 1][0] = r[2];
        b_frag[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_bf16_16816(acc[mi][ni], a_frag[mi], b_frag[ni][0], b_frag[ni][1]);
      }
    }
  }
  cp_async_wait<0>();  // nothing real is pending (the tail groups are empty), but leave no copy in flight

  // Accumulator (mi, ni, q): row warp_m*64 + mi*16 + lane/4 + 8*(q/2), column warp_n*32 + ni*8 + 2*(lane%4) + q%2.
  const int lane_row = lane >> 2, lane_col = (lane & 3) * 2;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_m * 64 + mi * 16 + half * 8 + lane_row;
      if (r >= rows) continue;
      if constexpr (kEpilogue == Epilogue::kSwiGlu) {
        auto* out_row = static_cast<__nv_bfloat16*>(p.out) + static_cast<int64_t>(row_begin + r) * p.out_stride;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          // n-tiles 2q (gate) and 2q+1 (up) of this warp cover output columns of pair warp_n*2 + q.
          const int col = n_tile * (kBlockN / 2) + (warp_n * 2 + q) * 8 + lane_col;
          if (col < p.n) {
            float g0 = acc[mi][2 * q][half * 2], g1 = acc[mi][2 * q][half * 2 + 1];
            float u0 = acc[mi][2 * q + 1][half * 2], u1 = acc[mi][2 * q + 1][half * 2 + 1];
            if (p.swiglu_limit > 0.0f) {
              const float l = p.swiglu_limit;
              g0 = fminf(g0, l);
              g1 = fminf(g1, l);
              u0 = fminf(fmaxf(u0, -l), l);
              u1 = fminf(fmaxf(u1, -l), l);
            }
            const float h0 = silu(g0) * u0;
            const float h1 = silu(g1) * u1;
            *reinterpret_cast<__nv_bfloat162*>(out_row + col) = __floats2bfloat162_rn(h0, h1);
          }
        }
      } else {
        const int slot = p.sorted_slots[row_begin + r];
        auto* out_row = static_cast<float*>(p.out) + static_cast<int64_t>(slot) * p.out_stride;
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int col = n_tile * kBlockN + warp_n * 32 + ni * 8 + lane_col;
          if (col < p.n) {
            *reinterpret_cast<float2*>(out_row + col) = make_float2(acc[mi][ni][half * 2], acc[mi][ni][half * 2 + 1]);
          }
        }
      }
    }
  }
}

}  // namespace metrale::kernels::cuda::grouped
