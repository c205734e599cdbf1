// Shared pieces of the CUDA paged attention: the batch and the paged cache as the kernels see them,
// tile loads and stores (device code), and the split-KV planning and launch that
// the entry point calls. attention.cu holds the prefill kernel, the KV-cache write, the generic kernel
// and kernels::paged_attention; attention_split.cu the split-KV decode kernel and its merge.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_kv.cuh"

namespace metrale::kernels::cuda::paged_attn {

using bf16 = __nv_bfloat16;
using attn::cp_async_16;
using attn::cp_async_commit;
using attn::cp_async_wait;
using attn::fast_exp2;
using attn::launch_kernel;
using attn::ldmatrix_x4;
using attn::ldmatrix_x4_trans;
using attn::mma_bf16_16816;
using attn::online_softmax;
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
// shared tiles [kRows, kHeadDim] with 16-byte cp.async copies (one slot lookup serves both). E is the
// cache element: bf16 tiles are swizzled (swizzled_offset), e4m3 code tiles (uint8_t) are plain
// row-major staging that the kernels widen. Keys outside [valid_begin, valid_end) (and keys whose
// block id is out of range) are zero-filled (code 0 is +0 too), so that a masked key's value row is
// finite: P = 0 times a NaN of an unwritten slot is still NaN.
// kUnroll: all of a thread's block-table loads are issued before its first copy (the memory-bound
// split-KV kernel wants them in flight together); otherwise one row at a time, which costs no
// registers (the prefill kernel needs them for its accumulators, and hides the loads behind a
// whole tile of MMAs).
template <int kHeadDim, int kRows, bool kUnroll, typename E>
__device__ __forceinline__ void load_kv_tile(const PagedKv& kv, const int32_t* table, int kv_head, int tile_start,
                                             int valid_begin, int valid_end, E* k_tile, E* v_tile) {
  static_assert(std::is_same_v<E, bf16> || std::is_same_v<E, uint8_t>, "bf16 or e4m3-code tiles");
  constexpr int kPerChunk = 16 / static_cast<int>(sizeof(E));  // elements per 16-byte copy
  constexpr int kChunks = kHeadDim / kPerChunk;                  // copies per key row
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
    const int row = first_row + pass * kRowsPerPass;
    int dst;
    if constexpr (std::is_same_v<E, bf16>) {
      dst = swizzled_offset<kHeadDim>(row, chunk);
    } else {
      dst = row * kHeadDim + chunk * kPerChunk;
    }
    // A mapped source address even when nothing is read.
    const int64_t src =
        (static_cast<int64_t>(slot < 0 ? 0 : slot) * kv.num_kv_heads + kv_head) * kHeadDim + chunk * kPerChunk;
    cp_async_16(smem_address(k_tile + dst), static_cast<const E*>(kv.k_cache) + src, slot >= 0);
    cp_async_16(smem_address(v_tile + dst), static_cast<const E*>(kv.v_cache) + src, slot >= 0);
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

// ---- split-KV planning and launch (attention_split.cu) ----

// How the split-KV kernel divides one batch.
struct SplitPlan {
  int row_chunks = 1;
  int num_splits = 1;
};

// Splits each (sequence, KV head, row chunk)'s key range until the grid reaches about
// kCtasPerSmTarget CTAs per SM, never below kMinKeysPerSplit keys per split.
SplitPlan plan_splits(int64_t num_seqs, int64_t kv_heads, int64_t group, int64_t max_q, int64_t max_range,
                      int num_sms);
// Workspace bytes of `ctas` split CTAs' partials.
size_t split_workspace_bytes(int64_t ctas, int64_t head_dim);
// Zeroed arrival counters for `groups` (sequence, KV head, chunk) groups, or null (merge kernel).
int* split_counters(int device, int64_t groups, int num_sms, cudaStream_t stream);
// kernels::cuda::split_merge_in_kernel().
bool split_merge_in_kernel_enabled();
// The split-KV kernel (and, without counters, the merge kernel) for the head size and cache dtype.
void launch_split_for_cache(const AttentionArgs& args, bool fp8, const SplitPlan& plan, int64_t head_dim,
                            int64_t num_seqs, int64_t kv_heads, int device, cudaStream_t stream);

// Raises a kernel's dynamic shared-memory limit once per (kernel, device) (attention.cu).
void allow_dynamic_smem(const void* kernel, size_t bytes, int device);

}  // namespace metrale::kernels::cuda::paged_attn
