// CUDA paged attention over a ragged batch (decode, prefill, chunked prefill, mixed steps) and the
// KV-cache write. The CPU twin in kernels/cpu/attention.cpp is the reference for the semantics.
//
// Both attention kernels work on "packed rows": the query rows of one sequence and one KV head are
// the q_len * G (token, head-of-the-group) pairs, packed as p = token * G + head_in_group, where
// G = n_heads / n_kv_heads. A CTA takes a tile of consecutive packed rows of one (sequence, KV head),
// so every K/V element it gathers from the paged cache serves all G query heads of the group.
//
//  * split-KV kernel ("flash-decoding"): tiles of 16 packed rows (one m16 tensor-core fragment),
//    4 warps that each take 16 keys of every 64-key K/V tile, a 3-stage cp.async pipeline, and
//    optionally a split of the key range over several CTAs whose fp32 partial results (normalised
//    output + log2-sum-exp) go to the workspace and are combined by the last CTA of the chunk to
//    finish (a per-chunk arrival counter), or by a small merge kernel when no counters exist. Used for
//    decode (q_len 1) and for short query blocks (speculative verify) where the tiles alone would
//    not fill the GPU.
//  * prefill kernel (flash-attention 2): tiles of 64 or 128 packed rows, 4 warps of 16 or 32 rows,
//    K/V tiles of 64 (32 for head_dim 256) keys double-buffered with cp.async, online softmax in
//    fp32, causal/window masking only on the tiles that need it.
// Scores are computed by mma.sync m16n8k16 (bf16 in, fp32 accumulate); P is rounded to bf16 for the
// P.V product, as in flash-attention; the softmax statistics stay fp32.
//  * generic kernel (CUDA cores, fp32 throughout): head sizes the tensor-core kernels are not built
//    for, and f32 q/out/caches (f32 runs), whatever the head size.
//
// FP8 (e4m3) caches (kFp8): the same kernels. K/V tiles arrive by cp.async as e4m3 codes in staging
// buffers (half the bytes of bf16), and are widened to bf16 in registers into the swizzled tiles the
// MMAs read (exactly: every e4m3 value is a bf16 value). The key scale of the CTA's KV head folds
// into the score scale and the value scale into the output normalisation, both fp32.
#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/attention.h"
#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_kv.cuh"
#include "kernels/cuda/pdl.cuh"

namespace metrale::kernels {
namespace cuda {
namespace {

using bf16 = __nv_bfloat16;
using attn::cp_async_16;
using attn::cp_async_commit;
using attn::cp_async_wait;
using attn::fast_exp2;
using attn::launch_kernel;
using attn::ldmatrix_x4;
using attn::ldmatrix_x4_trans;
using attn::mma_bf16_16816;
using attn::pack_bf16x2;
using attn::smem_address;
using attn::swizzled_offset;

constexpr int kThreads = 128;  // every attention kernel: 4 warps
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;

// ---- split-KV ("decode") kernel geometry ----
constexpr int kSplitRows = 16;         // packed rows per CTA: one m16 fragment
constexpr int kSplitKeysPerTile = 64;  // keys per pipeline stage; each warp takes 16 of them
constexpr int kSplitStages = 3;
constexpr int kMinKeysPerSplit = 256;  // a split below this spends more on its prologue than it saves
// The last split CTA merges (rather than a merge kernel) from this many splits up. Measured on the
// H200 (Qwen3-8B decode, batch 1): 5 splits at a 1K context, in-kernel 1.3% slower; 17 splits at 4K,
// 2.2% faster.
constexpr int kMinSplitsForInKernelMerge = 8;
constexpr int kCtasPerSmTarget = 2;    // split until S * n_kv * chunks * splits reaches this many waves

// ---- the paged cache and the batch as the kernels see them ----
struct PagedKv {
  const void* k_cache;          // [num_blocks, block_size, n_kv_heads, head_dim] bf16, or e4m3 codes (kFp8)
  const void* v_cache;          // same
  const float* k_scale;         // e4m3 caches: [n_kv_heads] f32, or null (1)
  const float* v_scale;
  const int32_t* block_tables;  // [S, table_stride] i32
  int64_t table_stride;         // elements between two sequences' tables
  int block_size;
  int block_shift;  // log2(block_size) when it is a power of two, else -1
  int num_blocks;
  int num_kv_heads;
};

struct AttentionArgs {
  const bf16* q;  // [T, n_heads, head_dim] bf16, head_dim contiguous
  int64_t q_token_stride, q_head_stride;
  bf16* out;  // [T, n_heads, head_dim] bf16, head_dim contiguous
  int64_t out_token_stride, out_head_stride;
  const int32_t* cu_q;     // [S + 1]
  const int32_t* kv_lens;  // [S]
  PagedKv kv;
  int group;            // query heads per KV head
  int window;           // 0: full causal
  int kv_capacity;      // table width * block_size: kv_lens are clamped to it (never read past a table)
  float score_scale;    // scale * log2(e): scores live in the log2 domain
  bool q_vectorized;    // q rows can be read with 16-byte loads
  bool out_vectorized;  // out rows can be written with 16-byte stores
  // Split-KV kernel only.
  int row_chunks;      // 16-row chunks per (sequence, KV head): ceil(max_q_len * G / 16)
  int num_splits;      // CTAs sharing the key range of one chunk
  float* partial_out;  // [ctas, 16, head_dim] f32, normalised partial outputs (num_splits > 1)
  float* partial_lse;  // [ctas, 16] f32, log2-sum-exp of each partial (-inf: no key)
  // [S * n_kv * row_chunks] zero-initialised arrival counters (num_splits > 1): the last split CTA of
  // a chunk merges and resets its counter to 0. Null: merge_splits_kernel merges.
  int* split_counters;
};

// The dequantisation scales of one KV head's keys and values (1 for bf16 caches).
__device__ __forceinline__ float key_scale(const PagedKv& kv, int kv_head) {
  return kv.k_scale != nullptr ? __ldg(kv.k_scale + kv_head) : 1.0f;
}
__device__ __forceinline__ float value_scale(const PagedKv& kv, int kv_head) {
  return kv.v_scale != nullptr ? __ldg(kv.v_scale + kv_head) : 1.0f;
}

// The packed rows one CTA handles and the keys they attend.
struct TileGeometry {
  int q_begin;  // first query row of the sequence in q/out
  int rows;     // valid packed rows in this tile (<= tile size); <= 0: nothing to do
  int context;  // kv_len - q_len: position of the sequence's first query token
  int pos_min;  // position of the first valid row's token
  int pos_max;  // position of the last valid row's token
  int key_lo;   // first key any valid row attends
  int key_end;  // one past the last key any valid row attends
};

__device__ __forceinline__ TileGeometry tile_geometry(const AttentionArgs& a, int seq, int row0, int tile_rows) {
  TileGeometry g;
  g.q_begin = a.cu_q[seq];
  const int q_len = a.cu_q[seq + 1] - g.q_begin;
  const int kv_len = min(a.kv_lens[seq], a.kv_capacity);
  const int rows_total = q_len * a.group;
  g.rows = min(tile_rows, rows_total - row0);
  g.context = kv_len - q_len;
  g.pos_min = g.context + row0 / a.group;
  g.pos_max = g.context + (row0 + max(g.rows, 1) - 1) / a.group;
  g.key_end = g.pos_max + 1;
  g.key_lo = a.window > 0 ? max(0, g.pos_min - a.window + 1) : 0;
  return g;
}

// The cache slot (block * block_size + offset) of key `key`, or -1 when the key's block id is out of
// range (a corrupt table must not make the kernel read outside the cache).
__device__ __forceinline__ int paged_slot(const PagedKv& kv, const int32_t* table, int key) {
  int block_index, in_block;
  if (kv.block_shift >= 0) {
    block_index = key >> kv.block_shift;
    in_block = key & (kv.block_size - 1);
  } else {
    block_index = static_cast<int>(static_cast<unsigned>(key) / static_cast<unsigned>(kv.block_size));
    in_block = key - block_index * kv.block_size;
  }
  const int block = __ldg(table + block_index);
  if (static_cast<unsigned>(block) >= static_cast<unsigned>(kv.num_blocks)) return -1;
  return block * kv.block_size + in_block;  // < num_blocks * block_size < 2^31 (checked on the host)
}

// Gathers keys [tile_start, tile_start + kRows) of one KV head from the paged K and V caches into
// swizzled shared tiles [kRows, kHeadDim] with 16-byte cp.async copies (one slot lookup serves both).
// Keys outside [valid_begin, valid_end) (and keys whose block id is out of range) are zero-filled,
// so that a masked key's value row is finite: P = 0 times a NaN of an unwritten slot is still NaN.
// kUnroll: all of a thread's block-table loads are issued before its first copy (the memory-bound
// split-KV kernel wants them in flight together); otherwise one row at a time, which costs no
// registers (the prefill kernel needs them for its accumulators, and hides the loads behind a
// whole tile of MMAs).
template <int kHeadDim, int kRows, bool kUnroll>
__device__ __forceinline__ void load_kv_tile(const PagedKv& kv, const int32_t* table, int kv_head, int tile_start,
                                             int valid_begin, int valid_end, bf16* k_tile, bf16* v_tile) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per key row
  static_assert(kThreads % kChunks == 0, "a pass covers whole rows");
  constexpr int kRowsPerPass = kThreads / kChunks;
  static_assert(kRows % kRowsPerPass == 0, "the tile is a whole number of passes");
  constexpr int kPasses = kRows / kRowsPerPass;
  const int chunk = threadIdx.x % kChunks;
  const int first_row = static_cast<int>(threadIdx.x) / kChunks;
  const auto slot_of_pass = [&](int pass) {
    const int key = tile_start + first_row + pass * kRowsPerPass;
    return key >= valid_begin && key < valid_end ? paged_slot(kv, table, key) : -1;
  };
  const auto copy_pass = [&](int pass, int slot) {  // slot < 0: zero-fill
    const int dst = swizzled_offset<kHeadDim>(first_row + pass * kRowsPerPass, chunk);
    // A mapped source address even when nothing is read.
    const int64_t src = (static_cast<int64_t>(slot < 0 ? 0 : slot) * kv.num_kv_heads + kv_head) * kHeadDim + chunk * 8;
    cp_async_16(smem_address(k_tile + dst), static_cast<const bf16*>(kv.k_cache) + src, slot >= 0);
    cp_async_16(smem_address(v_tile + dst), static_cast<const bf16*>(kv.v_cache) + src, slot >= 0);
  };
  if constexpr (kUnroll) {
    int slots[kPasses];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) slots[pass] = slot_of_pass(pass);
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) copy_pass(pass, slots[pass]);
  } else {
#pragma unroll 1
    for (int pass = 0; pass < kPasses; ++pass) copy_pass(pass, slot_of_pass(pass));
  }
}

// load_kv_tile for e4m3 caches: keys [tile_start, tile_start + kRows) into plain row-major staging
// tiles [kRows, kHeadDim] of codes, 16 codes per cp.async; the same zero-fill (code 0 is +0).
template <int kHeadDim, int kRows, bool kUnroll>
__device__ __forceinline__ void load_kv_tile_fp8(const PagedKv& kv, const int32_t* table, int kv_head, int tile_start,
                                                 int valid_begin, int valid_end, uint8_t* k_stage, uint8_t* v_stage) {
  constexpr int kChunks = kHeadDim / 16;  // 16-byte chunks per key row
  static_assert(kThreads % kChunks == 0, "a pass covers whole rows");
  constexpr int kRowsPerPass = kThreads / kChunks;
  static_assert(kRows % kRowsPerPass == 0, "the tile is a whole number of passes");
  constexpr int kPasses = kRows / kRowsPerPass;
  const int chunk = threadIdx.x % kChunks;
  const int first_row = static_cast<int>(threadIdx.x) / kChunks;
  const auto slot_of_pass = [&](int pass) {
    const int key = tile_start + first_row + pass * kRowsPerPass;
    return key >= valid_begin && key < valid_end ? paged_slot(kv, table, key) : -1;
  };
  const auto copy_pass = [&](int pass, int slot) {
    const int dst = (first_row + pass * kRowsPerPass) * kHeadDim + chunk * 16;
    const int64_t src = (static_cast<int64_t>(slot < 0 ? 0 : slot) * kv.num_kv_heads + kv_head) * kHeadDim + chunk * 16;
    cp_async_16(smem_address(k_stage + dst), static_cast<const uint8_t*>(kv.k_cache) + src, slot >= 0);
    cp_async_16(smem_address(v_stage + dst), static_cast<const uint8_t*>(kv.v_cache) + src, slot >= 0);
  };
  if constexpr (kUnroll) {
    int slots[kPasses];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) slots[pass] = slot_of_pass(pass);
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) copy_pass(pass, slots[pass]);
  } else {
#pragma unroll 1
    for (int pass = 0; pass < kPasses; ++pass) copy_pass(pass, slot_of_pass(pass));
  }
}

// Widens `rows` rows of an e4m3 staging tile [rows, kHeadDim] into the swizzled bf16 tile the MMAs
// read, `threads` threads from `thread` (a warp its own rows, or the whole CTA).
template <int kHeadDim>
__device__ __forceinline__ void widen_fp8_rows(const uint8_t* stage, bf16* tile, int rows, int thread, int threads) {
  constexpr int kChunks = kHeadDim / 16;
  for (int index = thread; index < rows * kChunks; index += threads) {
    const int row = index / kChunks, chunk = index % kChunks;
    const uint4 codes = *reinterpret_cast<const uint4*>(stage + row * kHeadDim + chunk * 16);
    uint4 low, high;
    e4m3x16_to_bf16(codes, low, high);
    *reinterpret_cast<uint4*>(tile + swizzled_offset<kHeadDim>(row, 2 * chunk)) = low;
    *reinterpret_cast<uint4*>(tile + swizzled_offset<kHeadDim>(row, 2 * chunk + 1)) = high;
  }
}

// Loads the packed query rows [row0, row0 + rows) of one KV group into a swizzled shared tile
// [kRows, kHeadDim]; rows past `rows` are zero (they compute finite garbage that is never stored).
template <int kHeadDim, int kRows>
__device__ __forceinline__ void load_q_tile(const AttentionArgs& a, int q_begin, int kv_head, int row0, int rows,
                                            bf16* tile) {
  constexpr int kChunks = kHeadDim / 8;
  for (int index = threadIdx.x; index < kRows * kChunks; index += kThreads) {
    const int row = index / kChunks, chunk = index % kChunks;
    uint4 value = make_uint4(0u, 0u, 0u, 0u);
    if (row < rows) {
      const int packed = row0 + row;
      const int64_t token = q_begin + packed / a.group;
      const int head = kv_head * a.group + packed % a.group;
      const bf16* src = a.q + token * a.q_token_stride + head * a.q_head_stride + chunk * 8;
      if (a.q_vectorized) {
        value = __ldg(reinterpret_cast<const uint4*>(src));
      } else {
        const auto* half_words = reinterpret_cast<const uint16_t*>(src);
        uint32_t words[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          words[i] = static_cast<uint32_t>(half_words[2 * i]) | (static_cast<uint32_t>(half_words[2 * i + 1]) << 16);
        }
        value = make_uint4(words[0], words[1], words[2], words[3]);
      }
    }
    *reinterpret_cast<uint4*>(tile + swizzled_offset<kHeadDim>(row, chunk)) = value;
  }
}

// Writes 8 bf16 (one 16-byte chunk) to an output row, vectorised when the layout allows.
__device__ __forceinline__ void store_chunk8(bf16* dst, uint4 value, bool vectorized) {
  if (vectorized) {
    *reinterpret_cast<uint4*>(dst) = value;
  } else {
    auto* half_words = reinterpret_cast<uint16_t*>(dst);
    const uint32_t words[4] = {value.x, value.y, value.z, value.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      half_words[2 * i] = static_cast<uint16_t>(words[i] & 0xffffu);
      half_words[2 * i + 1] = static_cast<uint16_t>(words[i] >> 16);
    }
  }
}

// Writes 4 fp32 values as bf16 (an 8-byte piece of an output row).
__device__ __forceinline__ void store_bf16x4(bf16* dst, float4 value, bool vectorized) {
  const uint32_t lo = pack_bf16x2(value.x, value.y), hi = pack_bf16x2(value.z, value.w);
  if (vectorized) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
  } else {
    auto* half_words = reinterpret_cast<uint16_t*>(dst);
    half_words[0] = static_cast<uint16_t>(lo & 0xffffu);
    half_words[1] = static_cast<uint16_t>(lo >> 16);
    half_words[2] = static_cast<uint16_t>(hi & 0xffffu);
    half_words[3] = static_cast<uint16_t>(hi >> 16);
  }
}

// One online-softmax step for the two rows (group, group + 8) of an m16 fragment that this thread
// holds: `scores` [kKeyTiles][4] are log2-domain scores (masked ones -inf) and become the
// probabilities P; `acc` [kDimTiles][4] (the output accumulator) and `row_sum` are rescaled.
template <int kKeyTiles, int kDimTiles>
__device__ __forceinline__ void online_softmax(float (&scores)[kKeyTiles][4], float (&acc)[kDimTiles][4],
                                               float (&row_max)[2], float (&row_sum)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt)
      tile_max = fmaxf(tile_max, fmaxf(scores[nt][2 * half], scores[nt][2 * half + 1]));
    tile_max = attn::quad_max(tile_max);
    const float new_max = fmaxf(row_max[half], tile_max);
    // A row with no unmasked key yet keeps max -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
    const float base = new_max == -INFINITY ? 0.0f : new_max;
    const float rescale = fast_exp2(row_max[half] - base);
    row_max[half] = new_max;
    row_sum[half] *= rescale;
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) {
      acc[dt][2 * half] *= rescale;
      acc[dt][2 * half + 1] *= rescale;
    }
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
      for (int e = 2 * half; e < 2 * half + 2; ++e) {
        const float p = fast_exp2(scores[nt][e] - base);
        scores[nt][e] = p;
        row_sum[half] += p;
      }
    }
  }
}

// ================================================================================================
// Prefill kernel. Grid (tiles, n_kv_heads, S); the tile index is reversed so that the last
// (heaviest, causal) tiles of long sequences start first. CTA = 4 warps; warp w owns packed rows
// [w * 16 * kRowTiles, (w + 1) * 16 * kRowTiles) of the tile. K/V tiles of kKeys keys are double
// buffered (tile n + 1 is in flight while tile n is computed); each tile is consumed in steps of
// kStepKeys keys (S, softmax, P.V per step) to bound the score registers.
// Shared memory: Q [kTileRows, D] + 2 x K [kKeys, D] + 2 x V [kKeys, D], bf16, swizzled. e4m3 caches:
// Q + one bf16 K and V tile [kKeys, D] (widened) + 2 x e4m3 K and V staging [kKeys, D]: the same bytes.
// ================================================================================================
template <int kHeadDim, int kRowTiles, int kKeys, int kStepKeys>
struct PrefillConfig {
  static constexpr int kRowsPerWarp = 16 * kRowTiles;
  static constexpr int kTileRows = kWarps * kRowsPerWarp;
  static constexpr int kStepKeyTiles = kStepKeys / 8;  // n8 fragments of S per row tile and step
  static constexpr int kDimTiles = kHeadDim / 8;       // n8 fragments of O per row tile
  static constexpr size_t kSmemBytes =
      sizeof(bf16) * (static_cast<size_t>(kTileRows) * kHeadDim + 4u * kKeys * kHeadDim);
  static_assert(kKeys % kStepKeys == 0 && kStepKeys % 16 == 0, "steps of whole k16 fragments");
};

template <int kHeadDim, int kRowTiles, int kKeys, int kStepKeys, int kMinBlocks, bool kFp8>
__global__ void __launch_bounds__(kThreads, kMinBlocks) paged_prefill_kernel(const AttentionArgs a) {
  using Config = PrefillConfig<kHeadDim, kRowTiles, kKeys, kStepKeys>;
  constexpr int kTileRows = Config::kTileRows, kRowsPerWarp = Config::kRowsPerWarp;
  constexpr int kStepKeyTiles = Config::kStepKeyTiles, kDimTiles = Config::kDimTiles;
  constexpr int kChunks = kHeadDim / 8;

  extern __shared__ __align__(128) uint8_t shared_raw[];
  bf16* q_tile = reinterpret_cast<bf16*>(shared_raw);  // [kTileRows, D]; reused for the output
  bf16* k_tiles = q_tile + kTileRows * kHeadDim;       // [2, kKeys, D] (kFp8: [1, kKeys, D], widened)
  bf16* v_tiles = k_tiles + (kFp8 ? 1 : 2) * kKeys * kHeadDim;
  // kFp8: [2, kKeys, D] e4m3 staging for K, then for V.
  uint8_t* k_stages = reinterpret_cast<uint8_t*>(v_tiles + (kFp8 ? 1 : 2) * kKeys * kHeadDim);
  uint8_t* v_stages = k_stages + 2 * kKeys * kHeadDim;

  const int seq = blockIdx.z, kv_head = blockIdx.y;
  const int row0 = (gridDim.x - 1 - blockIdx.x) * kTileRows;
  const TileGeometry g = tile_geometry(a, seq, row0, kTileRows);
  if (g.rows <= 0) return;  // this sequence has fewer tiles than the batch bound

  // Key tiles are aligned to multiples of kKeys so that only the diagonal (and window edge) tiles mask.
  const int first_key = (g.key_lo / kKeys) * kKeys;
  const int num_key_tiles = g.key_end > g.key_lo ? (g.key_end - first_key + kKeys - 1) / kKeys : 0;
  const int32_t* table = a.kv.block_tables + seq * a.kv.table_stride;
  const auto load_tile = [&](int tile_index) {
    const int buffer = (tile_index & 1) * kKeys * kHeadDim;
    if constexpr (kFp8) {
      load_kv_tile_fp8<kHeadDim, kKeys, false>(a.kv, table, kv_head, first_key + tile_index * kKeys, g.key_lo,
                                               g.key_end, k_stages + buffer, v_stages + buffer);
    } else {
      load_kv_tile<kHeadDim, kKeys, false>(a.kv, table, kv_head, first_key + tile_index * kKeys, g.key_lo, g.key_end,
                                           k_tiles + buffer, v_tiles + buffer);
    }
  };
  const float score_scale = a.score_scale * key_scale(a.kv, kv_head);

  if (num_key_tiles > 0) load_tile(0);
  cp_async_commit();
  load_q_tile<kHeadDim, kTileRows>(a, g.q_begin, kv_head, row0, g.rows, q_tile);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_id = lane >> 2, quad = lane & 3;
  const int warp_row0 = warp * kRowsPerWarp;
  const bool warp_active = warp_row0 < g.rows;  // warps without a valid row only help loading

  // Position of row (mt, half) of this thread (invalid rows: -1, no key visible). A row at position p
  // sees keys (p - window, p] (window > 0) or [0, p]. Computed where a step needs masking only, so
  // that the main loop keeps its registers for the accumulators.
  const auto row_position = [&](int mt, int half) {
    const int r = warp_row0 + mt * 16 + group_id + 8 * half;
    return r < g.rows ? g.context + (row0 + r) / a.group : -1;
  };
  const int window_span = a.window > 0 ? a.window : INT_MAX / 2;

  float acc[kRowTiles][kDimTiles][4];
  float row_max[kRowTiles][2], row_sum[kRowTiles][2];
#pragma unroll
  for (int mt = 0; mt < kRowTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) acc[mt][dt][0] = acc[mt][dt][1] = acc[mt][dt][2] = acc[mt][dt][3] = 0.0f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }

  // ldmatrix lane roles (see attention_mma.cuh): matrix index and row within it.
  const int matrix = lane >> 3, matrix_row = lane & 7;

  for (int n = 0; n < num_key_tiles; ++n) {
    // Prefetch tile n + 1 into the other buffers (freed by the barrier that ended iteration n - 1).
    if (n + 1 < num_key_tiles) load_tile(n + 1);
    cp_async_commit();
    cp_async_wait<1>();  // tile n (and Q's plain stores, after the barrier) ready
    __syncthreads();
    if constexpr (kFp8) {
      // Staging buffers (n & 1) -> the bf16 tiles (free since the barrier that ended iteration n - 1).
      widen_fp8_rows<kHeadDim>(k_stages + (n & 1) * kKeys * kHeadDim, k_tiles, kKeys, threadIdx.x, kThreads);
      widen_fp8_rows<kHeadDim>(v_stages + (n & 1) * kKeys * kHeadDim, v_tiles, kKeys, threadIdx.x, kThreads);
      __syncthreads();
    }

    if (warp_active) {
      const bf16* k_tile = k_tiles + (kFp8 ? 0 : (n & 1) * kKeys * kHeadDim);
      const bf16* v_tile = v_tiles + (kFp8 ? 0 : (n & 1) * kKeys * kHeadDim);
      for (int step = 0; step < kKeys / kStepKeys; ++step) {
        const int key0 = first_key + n * kKeys + step * kStepKeys;
        const int step_row0 = step * kStepKeys;  // first key row of the step in the shared tile
        float scores[kRowTiles][kStepKeyTiles][4];
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
          for (int nt = 0; nt < kStepKeyTiles; ++nt)
            scores[mt][nt][0] = scores[mt][nt][1] = scores[mt][nt][2] = scores[mt][nt][3] = 0.0f;
            // S = Q K^T over head_dim in steps of 16.
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks) {
          uint32_t q_frag[kRowTiles][4];
#pragma unroll
          for (int mt = 0; mt < kRowTiles; ++mt) {
            ldmatrix_x4(q_frag[mt], smem_address(q_tile + swizzled_offset<kHeadDim>(warp_row0 + mt * 16 + (lane & 15),
                                                                                    ks * 2 + (lane >> 4))));
          }
#pragma unroll
          for (int np = 0; np < kStepKeys / 16; ++np) {
            uint32_t k_frag[4];  // b0, b1 of key fragments 2np and 2np + 1
            ldmatrix_x4(k_frag, smem_address(k_tile + swizzled_offset<kHeadDim>(
                                                          step_row0 + np * 16 + (matrix >> 1) * 8 + matrix_row,
                                                          ks * 2 + (matrix & 1))));
#pragma unroll
            for (int mt = 0; mt < kRowTiles; ++mt) {
              mma_bf16_16816(scores[mt][2 * np], q_frag[mt], k_frag[0], k_frag[1]);
              mma_bf16_16816(scores[mt][2 * np + 1], q_frag[mt], k_frag[2], k_frag[3]);
            }
          }
        }
        // Every key of the step is visible to every valid row unless the step crosses the diagonal of
        // the first row or the window edge of the last row (zero-filled keys do one or the other).
        const bool needs_mask = key0 + kStepKeys - 1 > g.pos_min || (a.window > 0 && key0 <= g.pos_max - a.window);
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt) {
#pragma unroll
          for (int nt = 0; nt < kStepKeyTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) scores[mt][nt][e] *= score_scale;
          }
          if (needs_mask) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int pos = row_position(mt, half);
#pragma unroll
              for (int nt = 0; nt < kStepKeyTiles; ++nt) {
#pragma unroll
                for (int e = 2 * half; e < 2 * half + 2; ++e) {
                  const int key = key0 + nt * 8 + quad * 2 + (e & 1);
                  if (key > pos || key <= pos - window_span) scores[mt][nt][e] = -INFINITY;
                }
              }
            }
          }
          online_softmax<kStepKeyTiles, kDimTiles>(scores[mt], acc[mt], row_max[mt], row_sum[mt]);
        }
        // O += P V over the step's keys, 16 at a time; P comes straight from the score registers.
#pragma unroll
        for (int kk = 0; kk < kStepKeys / 16; ++kk) {
          uint32_t p_frag[kRowTiles][4];
#pragma unroll
          for (int mt = 0; mt < kRowTiles; ++mt) {
            p_frag[mt][0] = pack_bf16x2(scores[mt][2 * kk][0], scores[mt][2 * kk][1]);
            p_frag[mt][1] = pack_bf16x2(scores[mt][2 * kk][2], scores[mt][2 * kk][3]);
            p_frag[mt][2] = pack_bf16x2(scores[mt][2 * kk + 1][0], scores[mt][2 * kk + 1][1]);
            p_frag[mt][3] = pack_bf16x2(scores[mt][2 * kk + 1][2], scores[mt][2 * kk + 1][3]);
          }
#pragma unroll
          for (int dp = 0; dp < kHeadDim / 16; ++dp) {
            uint32_t v_frag[4];  // b0, b1 of dim fragments 2dp and 2dp + 1
            ldmatrix_x4_trans(v_frag, smem_address(v_tile + swizzled_offset<kHeadDim>(
                                                                step_row0 + kk * 16 + (matrix & 1) * 8 + matrix_row,
                                                                dp * 2 + (matrix >> 1))));
#pragma unroll
            for (int mt = 0; mt < kRowTiles; ++mt) {
              mma_bf16_16816(acc[mt][2 * dp], p_frag[mt], v_frag[0], v_frag[1]);
              mma_bf16_16816(acc[mt][2 * dp + 1], p_frag[mt], v_frag[2], v_frag[3]);
            }
          }
        }
      }
    }
    __syncthreads();  // buffers (n & 1) are free for tile n + 2
  }

  // Normalise and stage the bf16 output in the warp's own Q rows, then store whole 16-byte chunks.
  // (The barrier matters only when the loop ran no iteration: the Q rows were stored by any thread.)
  __syncthreads();
  const float out_scale = value_scale(a.kv, kv_head);
#pragma unroll
  for (int mt = 0; mt < kRowTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float sum = attn::quad_sum(row_sum[mt][half]);
      const float inv = sum > 0.0f ? out_scale / sum : 0.0f;
      const int r = warp_row0 + mt * 16 + group_id + 8 * half;
#pragma unroll
      for (int dt = 0; dt < kDimTiles; ++dt) {
        *reinterpret_cast<uint32_t*>(q_tile + swizzled_offset<kHeadDim>(r, dt) + quad * 2) =
            pack_bf16x2(acc[mt][dt][2 * half] * inv, acc[mt][dt][2 * half + 1] * inv);
      }
    }
  }
  __syncthreads();
  for (int index = threadIdx.x; index < kTileRows * kChunks; index += kThreads) {
    const int row = index / kChunks, chunk = index % kChunks;
    if (row >= g.rows) continue;
    const int packed = row0 + row;
    const int64_t token = g.q_begin + packed / a.group;
    const int head = kv_head * a.group + packed % a.group;
    const uint4 value = *reinterpret_cast<const uint4*>(q_tile + swizzled_offset<kHeadDim>(row, chunk));
    store_chunk8(a.out + token * a.out_token_stride + head * a.out_head_stride + chunk * 8, value, a.out_vectorized);
  }
}

// ================================================================================================
// Split-KV kernel. Grid (row_chunks * num_splits, n_kv_heads, S): x = split * row_chunks + chunk.
// CTA = 4 warps, all on the same 16 packed rows; warp w takes keys [16w, 16w + 16) of each 64-key
// stage. At the end the 4 warps' (max, sum, acc) are combined through shared memory and written as
// the final bf16 output (one split) or as a normalised fp32 partial + log2-sum-exp (several).
// Shared memory: Q [16, D] + kSplitStages x (K [64, D] + V [64, D]) bf16, swizzled, + 2 x [4, 16] f32;
// the K/V stages are reused for the cross-warp combine ([4, 16, D + 8] f32). e4m3 caches: the stages
// hold codes (half the bytes), after one bf16 K and V tile [64, D] that each warp widens its 16 keys into.
// ================================================================================================
template <int kHeadDim, bool kFp8>
struct SplitConfig {
  static constexpr int kStageElems = kSplitKeysPerTile * kHeadDim;
  static constexpr int kCombineStride = kHeadDim + 8;  // floats; the pad spreads a half-warp's rows over the banks
  static constexpr size_t kQBytes = sizeof(bf16) * static_cast<size_t>(kSplitRows) * kHeadDim;
  static constexpr size_t kWideBytes = kFp8 ? sizeof(bf16) * 2u * kStageElems : 0u;
  static constexpr size_t kStageBytes = (kFp8 ? 1u : sizeof(bf16)) * 2u * kSplitStages * kStageElems;
  static constexpr size_t kTileBytes = kQBytes + kWideBytes + kStageBytes;
  static constexpr size_t kSmemBytes = kTileBytes + 2u * sizeof(float) * kWarps * kSplitRows;
  static_assert(sizeof(float) * kWarps * kSplitRows * kCombineStride <= kWideBytes + kStageBytes,
                "the combine buffer fits in the K/V tiles and stages");
};

// The combine of the split kernel's 4 warps for packed row `row` (8 threads per row, this one `part`):
// the final bf16 output (one split) or the split's normalised fp32 partial and its log2-sum-exp.
template <int kHeadDim>
__device__ __forceinline__ void combine_warps(const AttentionArgs& a, const TileGeometry& g, int seq, int kv_head,
                                              int chunk, int split, int row, int part, const float* combine_acc,
                                              const float* combine_max, const float* combine_sum,
                                              int combine_stride) {
  const attn::WarpWeights<kWarps> c = attn::combine_warp_weights<kWarps, kSplitRows>(combine_max, combine_sum, row);
  const float inv = c.total > 0.0f ? value_scale(a.kv, kv_head) / c.total : 0.0f;
  const int packed = chunk * kSplitRows + row;
  const int64_t token = g.q_begin + packed / a.group;
  const int head = kv_head * a.group + packed % a.group;
  const int64_t cta =
      ((static_cast<int64_t>(seq) * a.kv.num_kv_heads + kv_head) * a.row_chunks + chunk) * a.num_splits + split;
#pragma unroll
  for (int j = 0; j < kHeadDim / 32; ++j) {
    const int d = j * 32 + part * 4;
    const float4 value = attn::combine_warp_acc<kWarps, kSplitRows>(combine_acc, combine_stride, row, d, c, inv);
    if (a.num_splits == 1) {
      store_bf16x4(a.out + token * a.out_token_stride + head * a.out_head_stride + d, value, a.out_vectorized);
    } else {
      *reinterpret_cast<float4*>(a.partial_out + (cta * kSplitRows + row) * kHeadDim + d) = value;
    }
  }
  if (a.num_splits > 1 && part == 0)
    a.partial_lse[cta * kSplitRows + row] = c.total > 0.0f ? c.max + attn::fast_log2(c.total) : -INFINITY;
}

// Combines the num_splits partials of packed row `row` of (seq, kv_head, chunk) into the output (8
// threads per row, this one `part`). The partials are read from L2 (__ldcg): in the split kernel's
// own merge, other CTAs of the same grid wrote them.
template <int kHeadDim>
__device__ __forceinline__ void merge_row(const AttentionArgs& a, const TileGeometry& g, int seq, int kv_head,
                                          int chunk, int row, int part) {
  const int row0 = chunk * kSplitRows;
  const int64_t first_cta =
      ((static_cast<int64_t>(seq) * a.kv.num_kv_heads + kv_head) * a.row_chunks + chunk) * a.num_splits;
  float overall_max = -INFINITY;
  for (int s = 0; s < a.num_splits; ++s)
    overall_max = fmaxf(overall_max, __ldcg(a.partial_lse + (first_cta + s) * kSplitRows + row));
  float4 sum[kHeadDim / 32];
#pragma unroll
  for (int j = 0; j < kHeadDim / 32; ++j) sum[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float total = 0.0f;
  for (int s = 0; s < a.num_splits; ++s) {
    const float lse = __ldcg(a.partial_lse + (first_cta + s) * kSplitRows + row);
    if (lse == -INFINITY) continue;  // no key of this row in that split (its partial is zero)
    const float weight = fast_exp2(lse - overall_max);
    total += weight;
    const float* partial = a.partial_out + ((first_cta + s) * kSplitRows + row) * kHeadDim + part * 4;
#pragma unroll
    for (int j = 0; j < kHeadDim / 32; ++j) {
      const float4 piece = __ldcg(reinterpret_cast<const float4*>(partial + j * 32));
      sum[j].x += weight * piece.x;
      sum[j].y += weight * piece.y;
      sum[j].z += weight * piece.z;
      sum[j].w += weight * piece.w;
    }
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  const int packed = row0 + row;
  const int64_t token = g.q_begin + packed / a.group;
  const int head = kv_head * a.group + packed % a.group;
  bf16* out = a.out + token * a.out_token_stride + head * a.out_head_stride + part * 4;
#pragma unroll
  for (int j = 0; j < kHeadDim / 32; ++j) {
    store_bf16x4(out + j * 32, make_float4(sum[j].x * inv, sum[j].y * inv, sum[j].z * inv, sum[j].w * inv),
                 a.out_vectorized);
  }
}

template <int kHeadDim, int kMinBlocks, bool kFp8>
__global__ void __launch_bounds__(kThreads, kMinBlocks) paged_split_kernel(const AttentionArgs a) {
  pdl::allow_dependents();  // without a merge, the output-projection GEMV comes next
  using Config = SplitConfig<kHeadDim, kFp8>;
  constexpr int kDimTiles = kHeadDim / 8;
  constexpr int kKeysPerWarp = kSplitKeysPerTile / kWarps;
  static_assert(kKeysPerWarp == 16, "each warp's keys form one k16 step of P.V");

  extern __shared__ __align__(128) uint8_t shared_raw[];
  bf16* q_tile = reinterpret_cast<bf16*>(shared_raw);  // [16, D]
  // bf16: [stages, 64, D] each. kFp8: the widened [64, D] each, then the e4m3 stages [stages, 64, D].
  bf16* k_tiles = q_tile + kSplitRows * kHeadDim;
  bf16* v_tiles = k_tiles + (kFp8 ? 1 : kSplitStages) * Config::kStageElems;
  uint8_t* k_stages = reinterpret_cast<uint8_t*>(v_tiles + (kFp8 ? 1 : kSplitStages) * Config::kStageElems);
  uint8_t* v_stages = k_stages + kSplitStages * Config::kStageElems;
  float* combine_acc = reinterpret_cast<float*>(k_tiles);                          // [4, 16, D + 8] after the main loop
  float* combine_max = reinterpret_cast<float*>(shared_raw + Config::kTileBytes);  // [4, 16]
  float* combine_sum = combine_max + kWarps * kSplitRows;                          // [4, 16]

  const int chunk = blockIdx.x % a.row_chunks, split = blockIdx.x / a.row_chunks;
  const int seq = blockIdx.z, kv_head = blockIdx.y;
  const int row0 = chunk * kSplitRows;
  const TileGeometry g = tile_geometry(a, seq, row0, kSplitRows);
  if (g.rows <= 0) return;  // the merge kernel skips this chunk too

  // This split's keys: the chunk's actual key range (from the device-side kv_len) cut into
  // num_splits pieces of whole 64-key tiles, so that a loose host bound (a CUDA graph plans for
  // max_model_len) still spreads a short context over every split. Trailing splits may be empty:
  // they write a neutral partial (lse -inf).
  const int range_len = max(g.key_end - g.key_lo, 0);
  const int per_split =
      ((range_len + a.num_splits - 1) / a.num_splits + kSplitKeysPerTile - 1) / kSplitKeysPerTile * kSplitKeysPerTile;
  const int range_begin = g.key_lo + split * per_split;
  const int range_end = min(g.key_end, range_begin + per_split);
  const int num_key_tiles =
      range_end > range_begin ? (range_end - range_begin + kSplitKeysPerTile - 1) / kSplitKeysPerTile : 0;
  const int32_t* table = a.kv.block_tables + seq * a.kv.table_stride;

  const auto load_stage = [&](int tile_index) {
    const int stage = tile_index % kSplitStages;
    const int start = range_begin + tile_index * kSplitKeysPerTile;
    if constexpr (kFp8) {
      load_kv_tile_fp8<kHeadDim, kSplitKeysPerTile, true>(a.kv, table, kv_head, start, range_begin, range_end,
                                                          k_stages + stage * Config::kStageElems,
                                                          v_stages + stage * Config::kStageElems);
    } else {
      load_kv_tile<kHeadDim, kSplitKeysPerTile, true>(a.kv, table, kv_head, start, range_begin, range_end,
                                                      k_tiles + stage * Config::kStageElems,
                                                      v_tiles + stage * Config::kStageElems);
    }
  };
  const float score_scale = a.score_scale * key_scale(a.kv, kv_head);
#pragma unroll
  for (int t = 0; t < kSplitStages - 1; ++t) {
    if (t < num_key_tiles) load_stage(t);
    cp_async_commit();
  }
  load_q_tile<kHeadDim, kSplitRows>(a, g.q_begin, kv_head, row0, g.rows, q_tile);
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group_id = lane >> 2, quad = lane & 3;
  const int matrix = lane >> 3, matrix_row = lane & 7;

  // The Q fragments stay in registers for the whole key range.
  uint32_t q_frag[kHeadDim / 16][4];
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    ldmatrix_x4(q_frag[ks], smem_address(q_tile + swizzled_offset<kHeadDim>(lane & 15, ks * 2 + (lane >> 4))));
  }
  int row_pos[2], row_first[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = group_id + 8 * half;
    const int pos = g.context + (row0 + r) / a.group;
    row_pos[half] = r < g.rows ? pos : -1;
    row_first[half] = a.window > 0 ? pos - a.window + 1 : 0;
  }

  float acc[kDimTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDimTiles; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  for (int n = 0; n < num_key_tiles; ++n) {
    cp_async_wait<kSplitStages - 2>();  // tile n has landed (this thread's copies)
    __syncthreads();                    // everyone's copies, and everyone is done with tile n - 1
    if (n + kSplitStages - 1 < num_key_tiles) load_stage(n + kSplitStages - 1);
    cp_async_commit();

    const int stage = n % kSplitStages;
    const int warp_rows = warp * kKeysPerWarp * kHeadDim;  // this warp's 16 keys within a tile
    if constexpr (kFp8) {
      // The warp widens its own 16 keys; only it reads them (its ldmatrix of the last tile is done).
      __syncwarp();
      widen_fp8_rows<kHeadDim>(k_stages + stage * Config::kStageElems + warp_rows, k_tiles + warp_rows, kKeysPerWarp,
                               lane, 32);
      widen_fp8_rows<kHeadDim>(v_stages + stage * Config::kStageElems + warp_rows, v_tiles + warp_rows, kKeysPerWarp,
                               lane, 32);
      __syncwarp();
    }
    const bf16* k_tile = k_tiles + (kFp8 ? 0 : stage * Config::kStageElems) + warp_rows;
    const bf16* v_tile = v_tiles + (kFp8 ? 0 : stage * Config::kStageElems) + warp_rows;
    const int key0 = range_begin + n * kSplitKeysPerTile + warp * kKeysPerWarp;

    float scores[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      uint32_t k_frag[4];
      ldmatrix_x4(k_frag, smem_address(k_tile + swizzled_offset<kHeadDim>((matrix >> 1) * 8 + matrix_row,
                                                                          ks * 2 + (matrix & 1))));
      mma_bf16_16816(scores[0], q_frag[ks], k_frag[0], k_frag[1]);
      mma_bf16_16816(scores[1], q_frag[ks], k_frag[2], k_frag[3]);
    }
    const bool needs_mask = key0 + kKeysPerWarp > range_end || key0 + kKeysPerWarp - 1 > g.pos_min ||
                            (a.window > 0 && key0 < g.pos_max - a.window + 1);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float s = scores[nt][e] * score_scale;
        if (needs_mask) {
          const int key = key0 + nt * 8 + quad * 2 + (e & 1);
          if (key >= range_end || key > row_pos[e >> 1] || key < row_first[e >> 1]) s = -INFINITY;
        }
        scores[nt][e] = s;
      }
    }
    online_softmax<2, kDimTiles>(scores, acc, row_max, row_sum);

    uint32_t p_frag[4];
    p_frag[0] = pack_bf16x2(scores[0][0], scores[0][1]);
    p_frag[1] = pack_bf16x2(scores[0][2], scores[0][3]);
    p_frag[2] = pack_bf16x2(scores[1][0], scores[1][1]);
    p_frag[3] = pack_bf16x2(scores[1][2], scores[1][3]);
#pragma unroll
    for (int dp = 0; dp < kHeadDim / 16; ++dp) {
      uint32_t v_frag[4];
      ldmatrix_x4_trans(v_frag, smem_address(v_tile + swizzled_offset<kHeadDim>((matrix & 1) * 8 + matrix_row,
                                                                                dp * 2 + (matrix >> 1))));
      mma_bf16_16816(acc[2 * dp], p_frag, v_frag[0], v_frag[1]);
      mma_bf16_16816(acc[2 * dp + 1], p_frag, v_frag[2], v_frag[3]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the stages are free: reuse them for the combine

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = group_id + 8 * half;
    const float sum = attn::quad_sum(row_sum[half]);
    if (quad == 0) {
      combine_max[warp * kSplitRows + r] = row_max[half];
      combine_sum[warp * kSplitRows + r] = sum;
    }
    float* dst = combine_acc + (warp * kSplitRows + r) * Config::kCombineStride + quad * 2;
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) {
      *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(acc[dt][2 * half], acc[dt][2 * half + 1]);
    }
  }
  __syncthreads();

  // 8 threads per row, each 4 consecutive dims of every 32.
  const int row = threadIdx.x >> 3, part = threadIdx.x & 7;
  if (row < g.rows) combine_warps<kHeadDim>(a, g, seq, kv_head, chunk, split, row, part, combine_acc, combine_max,
                                            combine_sum, Config::kCombineStride);
  if (a.num_splits == 1 || a.split_counters == nullptr) return;

  // The last CTA of the chunk to arrive merges every split's partial (the other CTAs fenced their
  // partials before counting themselves), then leaves the counter at 0 for the next launch.
  __shared__ bool merges;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* counter =
        a.split_counters + (static_cast<int64_t>(seq) * a.kv.num_kv_heads + kv_head) * a.row_chunks + chunk;
    merges = atomicAdd(counter, 1) == a.num_splits - 1;
    if (merges) *counter = 0;
  }
  __syncthreads();
  if (!merges) return;
  __threadfence();
  if (row < g.rows) merge_row<kHeadDim>(a, g, seq, kv_head, chunk, row, part);
}

// Combines the num_splits partials of every valid packed row when the split kernel has no counters.
// Grid (row_chunks, n_kv_heads, S), 128 threads: 8 per row, 16 rows.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads) merge_splits_kernel(const AttentionArgs a) {
  pdl::allow_dependents();  // the output-projection GEMV may stage its weights meanwhile
  const int chunk = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
  const TileGeometry g = tile_geometry(a, seq, chunk * kSplitRows, kSplitRows);
  const int row = threadIdx.x >> 3, part = threadIdx.x & 7;
  if (row < g.rows) merge_row<kHeadDim>(a, g, seq, kv_head, chunk, row, part);
}

// ================================================================================================
// KV-cache write: one thread per 16-byte chunk (bf16 inputs into bf16 caches with aligned rows), or
// per element.
// ================================================================================================
struct CacheWriteArgs {
  int64_t k_token_stride, k_head_stride, v_token_stride, v_head_stride;  // elements
  const int32_t* slot_mapping;                                           // [T]
  void* k_cache;  // [num_slots, n_kv_heads, head_dim] viewed flat: bf16, f32, or e4m3 codes
  void* v_cache;
  const float* k_scale;  // e4m3 caches: [n_kv_heads] f32, or null (1)
  const float* v_scale;
  int64_t num_slots;
  int num_kv_heads, head_dim;
  int64_t total;  // work items
};

__global__ void kv_cache_write_vec_kernel(const bf16* __restrict__ k, const bf16* __restrict__ v,
                                          const CacheWriteArgs a) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= a.total) return;
  const int chunks = a.head_dim / 8;
  const int chunk = static_cast<int>(index % chunks);
  const int64_t rest = index / chunks;
  const int head = static_cast<int>(rest % a.num_kv_heads);
  const int64_t token = rest / a.num_kv_heads;
  const int64_t slot = __ldg(a.slot_mapping + token);
  if (slot < 0 || slot >= a.num_slots) return;  // -1: padding rows; out of range: never write outside the cache
  const uint4 key =
      __ldg(reinterpret_cast<const uint4*>(k + token * a.k_token_stride + head * a.k_head_stride) + chunk);
  const uint4 value =
      __ldg(reinterpret_cast<const uint4*>(v + token * a.v_token_stride + head * a.v_head_stride) + chunk);
  const int64_t dst = (slot * a.num_kv_heads + head) * a.head_dim;
  reinterpret_cast<uint4*>(static_cast<bf16*>(a.k_cache) + dst)[chunk] = key;
  reinterpret_cast<uint4*>(static_cast<bf16*>(a.v_cache) + dst)[chunk] = value;
}

// One element per thread. T: the dtype of k and v; C: the caches' (bf16, float, or uint8_t for e4m3
// codes, quantised with the head's scale).
template <typename T, typename C>
__global__ void kv_cache_write_scalar_kernel(const T* __restrict__ k, const T* __restrict__ v, const CacheWriteArgs a) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= a.total) return;
  const int dim = static_cast<int>(index % a.head_dim);
  const int64_t rest = index / a.head_dim;
  const int head = static_cast<int>(rest % a.num_kv_heads);
  const int64_t token = rest / a.num_kv_heads;
  const int64_t slot = __ldg(a.slot_mapping + token);
  if (slot < 0 || slot >= a.num_slots) return;
  const int64_t dst = (slot * a.num_kv_heads + head) * a.head_dim + dim;
  const float key = to_f32<T>(k[token * a.k_token_stride + head * a.k_head_stride + dim]);
  const float value = to_f32<T>(v[token * a.v_token_stride + head * a.v_head_stride + dim]);
  if constexpr (std::is_same_v<C, uint8_t>) {
    static_cast<uint8_t*>(a.k_cache)[dst] = e4m3_quantize(key, a.k_scale != nullptr ? a.k_scale[head] : 1.0f);
    static_cast<uint8_t*>(a.v_cache)[dst] = e4m3_quantize(value, a.v_scale != nullptr ? a.v_scale[head] : 1.0f);
  } else {
    static_cast<C*>(a.k_cache)[dst] = from_f32<C>(key);
    static_cast<C*>(a.v_cache)[dst] = from_f32<C>(value);
  }
}

// ================================================================================================
// Host side: device properties, planning, validation, launches.
// ================================================================================================
struct DeviceProps {
  int num_sms = 0;
  int max_smem_optin = 0;
};

// Queried once per device and cached (no device calls on the hot path). Fixed storage: references
// handed out stay valid.
const DeviceProps& device_props(int device) {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static std::array<DeviceProps, kMaxDevices> cache;
  METRALE_EXPECT(device >= 0 && device < kMaxDevices, "paged_attention: device index out of range");
  std::lock_guard lock(mutex);
  DeviceProps& props = cache[static_cast<size_t>(device)];
  if (props.num_sms == 0) {
    METRALE_CUDA_CHECK(cudaDeviceGetAttribute(&props.num_sms, cudaDevAttrMultiProcessorCount, device));
    METRALE_CUDA_CHECK(cudaDeviceGetAttribute(&props.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  }
  return props;
}

// The SM count the workspace is sized for: the current device's, or a generous guess when there is
// no usable device (a CUDA build planning a CPU run, where the workspace is never used).
int planning_sm_count() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 256;
  }
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0) {
    cudaGetLastError();
    return 256;
  }
  return count;
}

// Raises a kernel's dynamic shared-memory limit once per (kernel, device).
void allow_dynamic_smem(const void* kernel, size_t bytes, int device) {
  static std::mutex mutex;
  static std::vector<std::pair<const void*, int>> done;
  std::lock_guard lock(mutex);
  for (const auto& entry : done) {
    if (entry.first == kernel && entry.second == device) return;
  }
  const DeviceProps& props = device_props(device);
  if (bytes > static_cast<size_t>(props.max_smem_optin)) {
    raise_message(ErrorCode::kUnsupported, "paged_attention: a kernel needs " + std::to_string(bytes) +
                                               " bytes of shared memory, the device allows " +
                                               std::to_string(props.max_smem_optin));
  }
  METRALE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  done.emplace_back(kernel, device);
}

// How the split-KV kernel divides one batch.
struct SplitPlan {
  int row_chunks = 1;
  int num_splits = 1;
};

// Splits each (sequence, KV head, row chunk)'s key range until the grid reaches about
// kCtasPerSmTarget CTAs per SM, never below kMinKeysPerSplit keys per split. base = S * n_kv *
// chunks; when base < target, splits <= ceil(target / base), so base * splits < 2 * target: the
// workspace bound of paged_attention_workspace_bytes.
SplitPlan plan_splits(int64_t num_seqs, int64_t kv_heads, int64_t group, int64_t max_q, int64_t max_range,
                      int num_sms) {
  SplitPlan plan;
  plan.row_chunks = static_cast<int>((max_q * group + kSplitRows - 1) / kSplitRows);
  const int64_t base = num_seqs * kv_heads * plan.row_chunks;
  const int64_t target = static_cast<int64_t>(kCtasPerSmTarget) * num_sms;
  const int64_t range = std::max<int64_t>(max_range, 1);
  int64_t splits = 1;
  if (base < target) {
    const int64_t wanted = (target + base - 1) / base;
    const int64_t by_length = (range + kMinKeysPerSplit - 1) / kMinKeysPerSplit;
    splits = std::max<int64_t>(1, std::min(wanted, by_length));
  }
  // Whole 64-key tiles per split at the bound; recount so that no split is empty there.
  int64_t keys = (range + splits - 1) / splits;
  keys = (keys + kSplitKeysPerTile - 1) / kSplitKeysPerTile * kSplitKeysPerTile;
  plan.num_splits = static_cast<int>((range + keys - 1) / keys);
  return plan;
}

std::atomic<bool>& split_merge_in_kernel_setting() {
  static std::atomic<bool> in_kernel = [] {
    const char* text = std::getenv("METRALE_SPLIT_MERGE_KERNEL");
    return !(text != nullptr && std::string(text) == "1");
  }();
  return in_kernel;
}

// Arrival counters of the split kernel's own merge, one per (sequence, KV head, row chunk) of a
// split batch: plan_splits splits only while S * n_kv * chunks < kCtasPerSmTarget * SMs, so that many
// suffice. Allocated and zeroed on a device's first split launch outside a graph capture (the engine's
// warm-up step); a launch before that (inside a capture) gets null and uses the merge kernel. The
// kernel leaves them at 0. Attention kernels of one device run in one stream order: the counters are
// never shared by two launches in flight.
int* split_counters(int device, int64_t groups, int num_sms, cudaStream_t stream) {
  struct Counters {
    int* data = nullptr;
    int64_t capacity = 0;
  };
  static std::mutex mutex;
  static std::array<Counters, 64> per_device;
  if (device < 0 || device >= static_cast<int>(per_device.size())) return nullptr;
  std::lock_guard lock(mutex);
  Counters& counters = per_device[static_cast<size_t>(device)];
  if (counters.data == nullptr) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    METRALE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) return nullptr;
    const int64_t capacity = static_cast<int64_t>(kCtasPerSmTarget) * num_sms;
    void* data = nullptr;
    METRALE_CUDA_CHECK(cudaMalloc(&data, static_cast<size_t>(capacity) * sizeof(int)));
    METRALE_CUDA_CHECK(cudaMemsetAsync(data, 0, static_cast<size_t>(capacity) * sizeof(int), stream));
    counters.data = static_cast<int*>(data);  // process lifetime: never freed
    counters.capacity = capacity;
  }
  return groups <= counters.capacity ? counters.data : nullptr;
}

size_t split_workspace_bytes(int64_t ctas, int64_t head_dim) {
  return static_cast<size_t>(ctas) * kSplitRows * static_cast<size_t>(head_dim + 1) * sizeof(float);
}

bool aligned16(const void* pointer) {
  return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0;
}

template <int kHeadDim, bool kFp8>
void launch_split(const AttentionArgs& args, const SplitPlan& plan, int64_t num_seqs, int64_t kv_heads, int device,
                  cudaStream_t stream) {
  constexpr size_t smem = SplitConfig<kHeadDim, kFp8>::kSmemBytes;
  constexpr int kMinBlocks = kHeadDim <= 128 ? 2 : 1;
  void (*kernel)(AttentionArgs) = paged_split_kernel<kHeadDim, kMinBlocks, kFp8>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, device);
  const dim3 grid(static_cast<unsigned>(plan.row_chunks * plan.num_splits), static_cast<unsigned>(kv_heads),
                  static_cast<unsigned>(num_seqs));
  launch_kernel(kernel, grid, dim3(kThreads), smem, stream, args);
  METRALE_CHECK_LAUNCH("paged_split_kernel");
  if (plan.num_splits > 1 && args.split_counters == nullptr) {
    const dim3 merge_grid(static_cast<unsigned>(plan.row_chunks), static_cast<unsigned>(kv_heads),
                          static_cast<unsigned>(num_seqs));
    launch_kernel(merge_splits_kernel<kHeadDim>, merge_grid, dim3(kThreads), 0, stream, args);
    METRALE_CHECK_LAUNCH("merge_splits_kernel");
  }
}

template <int kHeadDim, int kRowTiles, int kKeys, int kStepKeys, bool kFp8>
void launch_prefill(const AttentionArgs& args, int64_t max_q, int64_t num_seqs, int64_t kv_heads, int device,
                    cudaStream_t stream) {
  using Config = PrefillConfig<kHeadDim, kRowTiles, kKeys, kStepKeys>;
  constexpr size_t smem = Config::kSmemBytes;
  // Two CTAs per SM where registers (<= 255 per thread) and shared memory allow.
  constexpr int kMinBlocks = smem <= 110u * 1024u ? 2 : 1;
  void (*kernel)(AttentionArgs) = paged_prefill_kernel<kHeadDim, kRowTiles, kKeys, kStepKeys, kMinBlocks, kFp8>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, device);
  const int64_t tiles = (max_q * args.group + Config::kTileRows - 1) / Config::kTileRows;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(kv_heads), static_cast<unsigned>(num_seqs));
  launch_kernel(kernel, grid, dim3(kThreads), smem, stream, args);
  METRALE_CHECK_LAUNCH("paged_prefill_kernel");
}

// Tile shapes per head_dim: 128 rows x 64 keys (32 rows per warp) for 64 and 128, 64 rows when the
// batch has too few tiles to fill the SMs; head_dim 256 keeps 16 rows per warp and 32-key tiles
// (its 16 x 256 fp32 accumulator alone takes 128 registers per thread).
template <int kHeadDim, bool kFp8>
void launch_prefill_for_dim(const AttentionArgs& args, bool small_tiles, int64_t max_q, int64_t num_seqs,
                            int64_t kv_heads, int device, cudaStream_t stream) {
  if constexpr (kHeadDim == 256) {
    (void)small_tiles;
    launch_prefill<256, 1, 32, 32, kFp8>(args, max_q, num_seqs, kv_heads, device, stream);
  } else if (small_tiles) {
    launch_prefill<kHeadDim, 1, 64, 64, kFp8>(args, max_q, num_seqs, kv_heads, device, stream);
  } else {
    launch_prefill<kHeadDim, 2, 64, (kHeadDim >= 128 ? 32 : 64), kFp8>(args, max_q, num_seqs, kv_heads, device,
                                                                       stream);
  }
}

// The instantiation for the head size (64, 128 or 256) and the cache dtype (bf16, or e4m3 when fp8).
void launch_split_for_cache(const AttentionArgs& args, bool fp8, const SplitPlan& plan, int64_t head_dim,
                            int64_t num_seqs, int64_t kv_heads, int device, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      fp8 ? launch_split<64, true>(args, plan, num_seqs, kv_heads, device, stream)
          : launch_split<64, false>(args, plan, num_seqs, kv_heads, device, stream);
      break;
    case 128:
      fp8 ? launch_split<128, true>(args, plan, num_seqs, kv_heads, device, stream)
          : launch_split<128, false>(args, plan, num_seqs, kv_heads, device, stream);
      break;
    default:
      fp8 ? launch_split<256, true>(args, plan, num_seqs, kv_heads, device, stream)
          : launch_split<256, false>(args, plan, num_seqs, kv_heads, device, stream);
      break;
  }
}

void launch_prefill_for_cache(const AttentionArgs& args, bool fp8, bool small_tiles, int64_t max_q, int64_t head_dim,
                              int64_t num_seqs, int64_t kv_heads, int device, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      fp8 ? launch_prefill_for_dim<64, true>(args, small_tiles, max_q, num_seqs, kv_heads, device, stream)
          : launch_prefill_for_dim<64, false>(args, small_tiles, max_q, num_seqs, kv_heads, device, stream);
      break;
    case 128:
      fp8 ? launch_prefill_for_dim<128, true>(args, small_tiles, max_q, num_seqs, kv_heads, device, stream)
          : launch_prefill_for_dim<128, false>(args, small_tiles, max_q, num_seqs, kv_heads, device, stream);
      break;
    default:
      fp8 ? launch_prefill_for_dim<256, true>(args, small_tiles, max_q, num_seqs, kv_heads, device, stream)
          : launch_prefill_for_dim<256, false>(args, small_tiles, max_q, num_seqs, kv_heads, device, stream);
      break;
  }
}

// The device pointer of FP8 KV scales ([n_kv_heads] f32 on `device`), or null for none (scale 1).
const float* device_scales(const Tensor& scales, int64_t kv_heads, Device device, const char* op) {
  if (scales.empty()) return nullptr;
  if (scales.dtype() != DType::kF32 || scales.numel() != kv_heads || !scales.is_contiguous() ||
      !(scales.device() == device)) {
    raise_message(ErrorCode::kInvalidArgument, std::string(op) + " (cuda): FP8 KV scales " + scales.describe() +
                                                   " must be [" + std::to_string(kv_heads) + "] f32 on " +
                                                   device.to_string());
  }
  return scales.data_as<const float>();
}

[[noreturn]] void unsupported(const std::string& message) {
  raise_message(ErrorCode::kUnsupported, "paged_attention (cuda): " + message);
}
[[noreturn]] void invalid(const std::string& message) {
  raise_message(ErrorCode::kInvalidArgument, "paged_attention (cuda): " + message);
}

}  // namespace

void kv_cache_write(const Tensor& k, const Tensor& v, const Tensor& slot_mapping, const Tensor& k_cache,
                    const Tensor& v_cache, const KvScales& scales) {
  METRALE_EXPECT(k.ndim() == 3 && v.ndim() == 3 && k_cache.ndim() == 4 && v_cache.ndim() == 4,
                 "kv_cache_write: k, v must be [T, n_kv_heads, head_dim] and the caches 4-D, got k " + k.describe() +
                     ", cache " + k_cache.describe());
  const int64_t tokens = k.size(0), kv_heads = k.size(1), head_dim = k.size(2);
  METRALE_EXPECT(v.shape() == k.shape() && k_cache.shape() == v_cache.shape() && k_cache.size(2) == kv_heads &&
                     k_cache.size(3) == head_dim && slot_mapping.numel() == tokens,
                 "kv_cache_write shapes: k " + k.describe() + ", v " + v.describe() + ", cache " + k_cache.describe() +
                     ", slots " + slot_mapping.describe());
  METRALE_EXPECT(k_cache.is_contiguous() && v_cache.is_contiguous() && k.stride(2) == 1 && v.stride(2) == 1 &&
                     slot_mapping.dtype() == DType::kI32 && (tokens <= 1 || slot_mapping.stride(0) == 1),
                 "kv_cache_write layout: contiguous caches, unit head_dim stride, contiguous i32 slots");
  METRALE_EXPECT(k.device() == k_cache.device() && v.device() == k_cache.device() &&
                     v_cache.device() == k_cache.device() && slot_mapping.device() == k_cache.device(),
                 "kv_cache_write: every tensor must be on " + k_cache.device().to_string());
  const bool fp8 = k_cache.dtype() == DType::kF8E4M3;
  if ((k_cache.dtype() != DType::kBF16 && k_cache.dtype() != DType::kF32 && !fp8) ||
      v_cache.dtype() != k_cache.dtype()) {
    raise_message(ErrorCode::kUnsupported,
                  "kv_cache_write (cuda): caches must both be bf16, both f32 or both f8e4m3, got " + k_cache.describe());
  }
  if (k.dtype() != v.dtype()) {
    raise_message(ErrorCode::kUnsupported, "kv_cache_write (cuda): k and v dtypes differ");
  }
  if (tokens == 0 || kv_heads == 0 || head_dim == 0) return;

  CacheWriteArgs args{};
  args.k_token_stride = k.stride(0);
  args.k_head_stride = k.stride(1);
  args.v_token_stride = v.stride(0);
  args.v_head_stride = v.stride(1);
  args.slot_mapping = slot_mapping.data_as<const int32_t>();
  args.k_cache = k_cache.data();
  args.v_cache = v_cache.data();
  if (fp8) {
    args.k_scale = device_scales(scales.k, kv_heads, k_cache.device(), "kv_cache_write");
    args.v_scale = device_scales(scales.v, kv_heads, k_cache.device(), "kv_cache_write");
  }
  args.num_slots = k_cache.size(0) * k_cache.size(1);
  args.num_kv_heads = static_cast<int>(kv_heads);
  args.head_dim = static_cast<int>(head_dim);
  const cudaStream_t stream = stream_of(k_cache);
  const bool vectorized = k.dtype() == DType::kBF16 && k_cache.dtype() == DType::kBF16 && head_dim % 8 == 0 &&
                          args.k_token_stride % 8 == 0 && args.k_head_stride % 8 == 0 && args.v_token_stride % 8 == 0 &&
                          args.v_head_stride % 8 == 0 && aligned16(k.data()) && aligned16(v.data()) &&
                          aligned16(k_cache.data()) && aligned16(v_cache.data());
  constexpr int kBlock = 256;
  if (vectorized) {
    args.total = tokens * kv_heads * (head_dim / 8);
    launch_kernel(kv_cache_write_vec_kernel, dim3(ceil_div(args.total, kBlock)), dim3(kBlock), 0, stream,
                  k.data_as<const bf16>(), v.data_as<const bf16>(), args);
    METRALE_CHECK_LAUNCH("kv_cache_write_vec_kernel");
    return;
  }
  args.total = tokens * kv_heads * head_dim;
  METRALE_DISPATCH_FLOAT(k.dtype(), "kv_cache_write", [&] {
    using T = scalar_t;
    const auto kernel = fp8 ? kv_cache_write_scalar_kernel<T, uint8_t>
                        : k_cache.dtype() == DType::kF32 ? kv_cache_write_scalar_kernel<T, float>
                                                         : kv_cache_write_scalar_kernel<T, bf16>;
    launch_kernel(kernel, dim3(ceil_div(args.total, kBlock)), dim3(kBlock), 0, stream, k.data_as<const T>(),
                  v.data_as<const T>(), args);
  });
  METRALE_CHECK_LAUNCH("kv_cache_write_scalar_kernel");
}

// ---------------------------------------------------------------------------------------------
// Generic path for head sizes the tensor-core kernels are not instantiated for (tiny test models,
// head_dim 16 or 32, any even size up to 256) and for f32 q, out and caches at any head size. One CTA
// per (query row, head): keys are scored in chunks of kGenericKeys into shared memory, softmaxed
// online, and each thread owns output channels. Correct and simple, not fast: production head sizes
// in bf16 take the kernels above.

constexpr int kGenericThreads = 128;
constexpr int kGenericKeys = 128;

__device__ __forceinline__ int generic_slot(const PagedKv& kv, int sequence, int key) {
  const int32_t* table = kv.block_tables + static_cast<int64_t>(sequence) * kv.table_stride;
  return table[key / kv.block_size] * kv.block_size + key % kv.block_size;
}

// One cached element as fp32 (unscaled): C is bf16, float, or uint8_t (an e4m3 code).
template <typename C>
__device__ __forceinline__ float cached_value(const void* cache, int64_t index) {
  if constexpr (std::is_same_v<C, uint8_t>) {
    return e4m3_to_float(static_cast<const uint8_t*>(cache)[index]);
  } else {
    return to_f32(static_cast<const C*>(cache)[index]);
  }
}

// T: the storage dtype of q and out (bf16 or float; AttentionArgs types them as bf16 for the
// tensor-core kernels, here they are read as T); C: the caches' (see cached_value).
template <typename T, typename C>
__global__ void __launch_bounds__(kGenericThreads)
    generic_attention_kernel(AttentionArgs args, int head_dim, int num_seqs) {
  __shared__ float q_shared[256];
  __shared__ float scores[kGenericKeys];
  const int row = blockIdx.x, head = blockIdx.y;
  // Which sequence owns this row: the last s with cu_q[s] <= row.
  int sequence = 0;
  while (sequence + 1 < num_seqs && args.cu_q[sequence + 1] <= row) ++sequence;
  const int q_len = args.cu_q[sequence + 1] - args.cu_q[sequence];
  const int kv_len = args.kv_lens[sequence];
  const int position = kv_len - q_len + (row - args.cu_q[sequence]);
  const int first_key = args.window > 0 ? max(0, position - args.window + 1) : 0;
  const int kv_head = head / args.group;
  const T* q = reinterpret_cast<const T*>(args.q) + static_cast<int64_t>(row) * args.q_token_stride +
               static_cast<int64_t>(head) * args.q_head_stride;
  for (int d = threadIdx.x; d < head_dim; d += kGenericThreads) q_shared[d] = to_f32(q[d]);
  __syncthreads();
  // Each thread accumulates channels threadIdx.x and threadIdx.x + 128 (head_dim <= 256).
  float acc0 = 0.0f, acc1 = 0.0f, running_max = -INFINITY, running_sum = 0.0f;
  // Includes log2(e) (scores are in the exp2 domain) and the key scale of an e4m3 cache.
  const float scale = args.score_scale * key_scale(args.kv, kv_head);
  for (int chunk = first_key; chunk <= position; chunk += kGenericKeys) {
    const int count = min(kGenericKeys, position + 1 - chunk);
    if (threadIdx.x < count) {
      const int slot = generic_slot(args.kv, sequence, chunk + threadIdx.x);
      const int64_t k = (static_cast<int64_t>(slot) * args.kv.num_kv_heads + kv_head) * head_dim;
      float dot = 0.0f;
      for (int d = 0; d < head_dim; ++d) dot += q_shared[d] * cached_value<C>(args.kv.k_cache, k + d);
      scores[threadIdx.x] = dot * scale;
    }
    __syncthreads();
    float chunk_max = -INFINITY;
    for (int j = 0; j < count; ++j) chunk_max = fmaxf(chunk_max, scores[j]);
    const float new_max = fmaxf(running_max, chunk_max);
    const float rescale = exp2f(running_max - new_max);
    acc0 *= rescale;
    acc1 *= rescale;
    running_sum *= rescale;
    for (int j = 0; j < count; ++j) {
      const float p = exp2f(scores[j] - new_max);
      running_sum += p;
      const int slot = generic_slot(args.kv, sequence, chunk + j);
      const int64_t v = (static_cast<int64_t>(slot) * args.kv.num_kv_heads + kv_head) * head_dim;
      if (threadIdx.x < head_dim) acc0 += p * cached_value<C>(args.kv.v_cache, v + threadIdx.x);
      if (threadIdx.x + kGenericThreads < head_dim)
        acc1 += p * cached_value<C>(args.kv.v_cache, v + threadIdx.x + kGenericThreads);
    }
    running_max = new_max;
    __syncthreads();
  }
  const float inverse = running_sum > 0.0f ? value_scale(args.kv, kv_head) / running_sum : 0.0f;
  T* out = reinterpret_cast<T*>(args.out) + static_cast<int64_t>(row) * args.out_token_stride +
           static_cast<int64_t>(head) * args.out_head_stride;
  if (threadIdx.x < head_dim) out[threadIdx.x] = from_f32<T>(acc0 * inverse);
  if (threadIdx.x + kGenericThreads < head_dim) out[threadIdx.x + kGenericThreads] = from_f32<T>(acc1 * inverse);
}

// dtype: q's and out's (bf16 or f32); cache: the caches' (the same, or f8e4m3).
void launch_generic_attention(const AttentionArgs& args, DType dtype, DType cache, int64_t tokens, int64_t heads,
                              int64_t head_dim, int64_t num_seqs, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(heads));
  const bool fp8 = cache == DType::kF8E4M3;
  const auto kernel = dtype == DType::kF32 ? (fp8 ? generic_attention_kernel<float, uint8_t>
                                                  : generic_attention_kernel<float, float>)
                                           : (fp8 ? generic_attention_kernel<bf16, uint8_t>
                                                  : generic_attention_kernel<bf16, bf16>);
  kernel<<<grid, kGenericThreads, 0, stream>>>(args, static_cast<int>(head_dim), static_cast<int>(num_seqs));
  METRALE_CHECK_LAUNCH("generic_attention_kernel");
}

void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& cu_q,
                     const Tensor& kv_lens, const Tensor& block_tables, const Tensor& out,
                     const AttentionParams& params) {
  METRALE_EXPECT(q.ndim() == 3 && out.ndim() == 3 && k_cache.ndim() == 4 && v_cache.ndim() == 4,
                 "paged_attention ranks: q " + q.describe() + ", cache " + k_cache.describe());
  const int64_t tokens = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  METRALE_EXPECT(
      out.shape() == q.shape() && v_cache.shape() == k_cache.shape() && k_cache.size(3) == head_dim && kv_heads > 0 &&
          heads % kv_heads == 0 && block_size > 0,
      "paged_attention shapes: q " + q.describe() + ", out " + out.describe() + ", cache " + k_cache.describe());
  const int64_t num_seqs = kv_lens.numel();
  METRALE_EXPECT(cu_q.numel() == num_seqs + 1 && block_tables.ndim() == 2 && block_tables.size(0) == num_seqs,
                 "paged_attention metadata: cu_q " + cu_q.describe() + ", kv_lens " + kv_lens.describe() +
                     ", block_tables " + block_tables.describe());
  METRALE_EXPECT(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                     cu_q.dtype() == DType::kI32 && kv_lens.dtype() == DType::kI32 &&
                     block_tables.dtype() == DType::kI32 && (num_seqs <= 1 || kv_lens.stride(0) == 1) &&
                     cu_q.stride(0) == 1 && block_tables.stride(1) == 1,
                 "paged_attention layout: unit head_dim stride, contiguous caches and i32 metadata");
  const Device device = out.device();
  for (const Tensor* t : {&q, &k_cache, &v_cache, &cu_q, &kv_lens, &block_tables}) {
    if (!(t->device() == device)) {
      invalid("every tensor must be on " + device.to_string() + " (the kernels read the metadata on the device), got " +
              t->describe());
    }
  }
  const DType dtype = q.dtype();
  const bool fp8 = k_cache.dtype() == DType::kF8E4M3;
  if ((dtype != DType::kBF16 && dtype != DType::kF32) || out.dtype() != dtype ||
      (k_cache.dtype() != dtype && !fp8) || v_cache.dtype() != k_cache.dtype()) {
    unsupported("q and out must be both bf16 or both f32, the caches both of their dtype or both f8e4m3, got q " +
                q.describe() + ", cache " +
                k_cache.describe() + ", out " + out.describe());
  }
  // f32 runs take the generic kernel at every head size (the tensor-core kernels read bf16).
  const bool generic_head_dim = dtype == DType::kF32 || (head_dim != 64 && head_dim != 128 && head_dim != 256);
  if (generic_head_dim && (head_dim > 256 || head_dim % 2 != 0)) {
    unsupported("head_dim " + std::to_string(head_dim) + " (supported: even sizes up to 256)");
  }
  if (!aligned16(k_cache.data()) || !aligned16(v_cache.data())) unsupported("the caches must be 16-byte aligned");
  if (tokens == 0 || num_seqs == 0) return;
  const int64_t group = heads / kv_heads;
  const int64_t capacity = block_tables.size(1) * block_size;
  if (num_seqs > 65535 || kv_heads > 65535 || capacity > INT32_MAX / 2 || num_blocks * block_size >= INT32_MAX ||
      tokens * group > INT32_MAX / 2) {
    unsupported("batch too large: " + std::to_string(num_seqs) + " sequences, " + std::to_string(tokens) +
                " tokens, table capacity " + std::to_string(capacity) + ", " + std::to_string(num_blocks * block_size) +
                " cache slots");
  }

  // Host bounds (never device values): a bound not given is replaced by what the shapes imply.
  const int64_t max_q = std::max<int64_t>(1, params.max_q_len > 0 ? std::min(params.max_q_len, tokens) : tokens);
  const int64_t max_kv = std::max<int64_t>(1, params.max_kv_len > 0 ? std::min(params.max_kv_len, capacity) : capacity);
  const int64_t max_range = params.window > 0 ? std::min<int64_t>(max_kv, params.window + max_q - 1) : max_kv;

  AttentionArgs args{};
  args.q = q.data_as<const bf16>();
  args.q_token_stride = q.stride(0);
  args.q_head_stride = q.stride(1);
  args.out = out.data_as<bf16>();
  args.out_token_stride = out.stride(0);
  args.out_head_stride = out.stride(1);
  args.cu_q = cu_q.data_as<const int32_t>();
  args.kv_lens = kv_lens.data_as<const int32_t>();
  args.kv.k_cache = k_cache.data();
  args.kv.v_cache = v_cache.data();
  if (fp8) {
    args.kv.k_scale = device_scales(params.kv_scales.k, kv_heads, device, "paged_attention");
    args.kv.v_scale = device_scales(params.kv_scales.v, kv_heads, device, "paged_attention");
  }
  args.kv.block_tables = block_tables.data_as<const int32_t>();
  args.kv.table_stride = block_tables.stride(0);
  args.kv.block_size = static_cast<int>(block_size);
  args.kv.block_shift = -1;
  if ((block_size & (block_size - 1)) == 0) {
    args.kv.block_shift = 0;
    while ((int64_t{1} << args.kv.block_shift) < block_size) ++args.kv.block_shift;
  }
  args.kv.num_blocks = static_cast<int>(num_blocks);
  args.kv.num_kv_heads = static_cast<int>(kv_heads);
  args.group = static_cast<int>(group);
  args.window = params.window > 0 ? params.window : 0;
  args.kv_capacity = static_cast<int>(capacity);
  args.score_scale = params.scale * kLog2e;
  args.q_vectorized = aligned16(q.data()) && q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0;
  args.out_vectorized = aligned16(out.data()) && out.stride(0) % 8 == 0 && out.stride(1) % 8 == 0;

  const int device_index = device.index;
  const DeviceProps& props = device_props(device_index);
  const cudaStream_t stream = stream_of(out);
  if (generic_head_dim) {
    launch_generic_attention(args, dtype, k_cache.dtype(), tokens, heads, head_dim, num_seqs, stream);
    return;
  }

  // Kernel choice: split-KV for decode and for short query blocks whose prefill tiles would leave
  // SMs idle; the tensor-core prefill kernel otherwise.
  const int64_t packed_rows = max_q * group;
  const bool small_tiles = head_dim != 256 && ceil_div(packed_rows, 128) * num_seqs * kv_heads < props.num_sms;
  const int64_t prefill_ctas =
      ceil_div(packed_rows, head_dim == 256 ? 64 : (small_tiles ? 64 : 128)) * num_seqs * kv_heads;
  const bool use_split =
      max_q == 1 || packed_rows <= kSplitRows || (packed_rows <= 4 * kSplitRows && prefill_ctas < props.num_sms);

  if (use_split) {
    SplitPlan plan = plan_splits(num_seqs, kv_heads, group, max_q, max_range, props.num_sms);
    const int64_t ctas = num_seqs * kv_heads * plan.row_chunks * plan.num_splits;
    if (plan.num_splits > 1) {
      const size_t needed = split_workspace_bytes(ctas, head_dim);
      if (params.workspace.empty()) {
        // No scratch given: one split per chunk (correct, slower for long contexts at small batch).
        plan.num_splits = 1;
      } else {
        if (!(params.workspace.device() == device) || !aligned16(params.workspace.data()) ||
            params.workspace.nbytes() < needed) {
          invalid("workspace " + params.workspace.describe() + " must be a 16-byte aligned buffer on " +
                  device.to_string() + " of at least " + std::to_string(needed) +
                  " bytes (paged_attention_workspace_bytes)");
        }
        args.partial_out = static_cast<float*>(params.workspace.data());
        args.partial_lse = args.partial_out + ctas * kSplitRows * head_dim;
        if (split_merge_in_kernel_setting().load(std::memory_order_relaxed) &&
            plan.num_splits >= kMinSplitsForInKernelMerge) {
          args.split_counters =
              split_counters(device_index, num_seqs * kv_heads * plan.row_chunks, props.num_sms, stream);
        }
      }
    }
    args.row_chunks = plan.row_chunks;
    args.num_splits = plan.num_splits;
    launch_split_for_cache(args, fp8, plan, head_dim, num_seqs, kv_heads, device_index, stream);
    return;
  }
  launch_prefill_for_cache(args, fp8, small_tiles, max_q, head_dim, num_seqs, kv_heads, device_index, stream);
}

bool split_merge_in_kernel() { return split_merge_in_kernel_setting().load(std::memory_order_relaxed); }

void set_split_merge_in_kernel(bool in_kernel) {
  split_merge_in_kernel_setting().store(in_kernel, std::memory_order_relaxed);
}

}  // namespace cuda

// Scratch of the split-KV path: for each of at most 2 * kCtasPerSmTarget * SMs CTAs, 16 rows of
// head_dim fp32 partial outputs and one fp32 log2-sum-exp each:
//   bytes = 2 * 2 * SMs * 16 * (head_dim + 1) * 4   (4.36 MB for head_dim 128 on 132 SMs),
// and 0 when no split can happen: max_kv_len (if given) at most 256 keys, or at least
// 2 * SMs sequences. Independent of num_tokens and num_heads (the split count shrinks as the batch
// grows).
size_t paged_attention_workspace_bytes(int64_t num_seqs, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                                       int64_t max_kv_len) {
  (void)num_tokens;
  (void)num_heads;
  if (max_kv_len > 0 && max_kv_len <= cuda::kMinKeysPerSplit) return 0;
  const int64_t target = static_cast<int64_t>(cuda::kCtasPerSmTarget) * cuda::planning_sm_count();
  if (num_seqs >= target) return 0;
  return cuda::split_workspace_bytes(2 * target, head_dim);
}

}  // namespace metrale::kernels
