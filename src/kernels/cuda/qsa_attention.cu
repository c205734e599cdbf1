// QSA sparse attention on the GPU (semantics in kernels/qsa.h; the CPU twin is the reference).
//
// Every query row attends a list of keys: all of [0, p] when it has at most block_topk complete
// blocks, else the c keys of each selected block followed by the tail [nb c, p]. The list is never
// longer than block_topk * c + c - 1 (the budget plus the tail), whatever the context, so the cost of
// a row is bounded by the budget: at 32K context a decode row reads 2051 of 32768 keys.
//
// Tensor-core kernel (head_dim 64, 128, 256), the split-KV layout of attention.cu's decode kernel
// with list positions in place of key positions: a CTA takes one query token, one KV head and up
// to 16 of its G query heads (one m16 fragment; the rows of a CTA share the token's list, so every
// gathered K/V row serves all of them), and one split of the list in whole 64-key tiles. The list
// is made of groups of c consecutive keys of one page (a selected block, the tail, or a run of a
// dense row), so a split first resolves its groups to cache slots in shared memory (block ids and
// page table read once, in parallel); the K/V rows then stream with 16-byte cp.async copies into a
// 3-stage pipeline whose loads depend on shared memory only; S = QK^T and O += PV by mma.sync m16n8k16 (bf16 in, fp32 accumulate, P rounded to bf16),
// online softmax in fp32 in the exp2 domain. Several splits write normalised fp32 partials and
// log2-sum-exps to the workspace, merged by a second kernel. Grid (T, n_kv, chunks * splits): no
// per-sequence bound, the token index comes straight from the grid.
//
// Cost: decode at batch B reads B * n_kv * L keys of 2 * head_dim bf16 (L <= 2051 for budget 2048,
// c 4: 2 MB per (token, KV head) at head_dim 256), the same as dense attention over 2K keys, and
// about 1/16 of dense attention at 32K. Prefill rows are handled the same way (no reuse of K/V
// across query tokens, which select different blocks); prefill chunks entirely in the dense regime
// (max kv_len <= block_topk * c + c - 1) are cheaper through paged_attention.
//
// Generic path (other even head sizes up to 256, for tiny test models, and f32 activations at any
// of them): one CTA per (row, head),
// keys scored 128 at a time into shared memory, online softmax, each thread owning output channels.
#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/qsa.h"

namespace metrale::kernels {
namespace cuda {
namespace {

using bf16 = __nv_bfloat16;
using attn::cp_async_16;
using attn::cp_async_commit;
using attn::cp_async_wait;
using attn::fast_exp2;
using attn::ldmatrix_x4;
using attn::ldmatrix_x4_trans;
using attn::mma_bf16_16816;
using attn::pack_bf16x2;
using attn::smem_address;
using attn::swizzled_offset;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kRows = 16;         // packed rows (query heads of one token) per CTA
constexpr int kKeysPerTile = 64;  // list entries per pipeline stage; 16 per warp
constexpr int kStages = 3;
constexpr int kMinKeysPerSplit = 128;
constexpr int kCtasPerSmTarget = 2;
// Entry groups (of c keys) one split resolves to cache slots up front; plan_splits keeps a split's
// entries within kMaxGroups * c - 64.
constexpr int kMaxGroups = 1024;

struct SparseArgs {
  const bf16* q;  // [T, n_heads, D]
  int64_t q_token_stride, q_head_stride;
  bf16* out;  // [T, n_heads, D]
  int64_t out_token_stride, out_head_stride;
  const int32_t* cu_q;
  const int32_t* kv_lens;
  const bf16* k_cache;  // [num_blocks, block_size, n_kv, D]
  const bf16* v_cache;
  const int32_t* block_tables;  // [S, table_stride]
  int64_t table_stride;
  const int32_t* selected;  // [T, topk]
  int64_t selected_row;
  int block_size, num_blocks, num_kv_heads, num_seqs;
  int group;  // query heads per KV head
  int c, topk;
  int kv_capacity;    // table width * block_size
  float score_scale;  // scale * log2(e)
  bool q_vectorized, out_vectorized;
  int row_chunks;  // ceil(group / 16)
  int num_splits;
  float* partial_out;  // [ctas, 16, D]
  float* partial_lse;  // [ctas, 16]
};

// The list of keys one query row attends.
struct KeyList {
  int seq = 0;
  int length = 0;       // entries; 0 for a row past the batch
  int sparse_keys = 0;  // entries that come from selected blocks (0 when dense)
  int tail_begin = 0;   // first tail key (nb * c)
  const int32_t* blocks = nullptr;
  const int32_t* table = nullptr;

  // Key position of list entry r (< length).
  __device__ __forceinline__ int key(int r, int c) const {
    if (r >= sparse_keys) return sparse_keys == 0 ? r : tail_begin + (r - sparse_keys);
    return __ldg(blocks + r / c) * c + r % c;
  }
};

__device__ __forceinline__ KeyList key_list(const SparseArgs& a, int64_t t) {
  KeyList list;
  if (t >= a.cu_q[a.num_seqs]) return list;
  int lo = 0, hi = a.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a.cu_q[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  list.seq = lo;
  const int q_len = a.cu_q[lo + 1] - a.cu_q[lo];
  const int kv_len = min(a.kv_lens[lo], a.kv_capacity);
  const int p = kv_len - q_len + static_cast<int>(t - a.cu_q[lo]);
  if (p < 0) return list;
  const int nb = (p + 1) / a.c;
  list.table = a.block_tables + static_cast<int64_t>(lo) * a.table_stride;
  if (nb <= a.topk) {
    list.length = p + 1;
  } else {
    list.sparse_keys = a.topk * a.c;
    list.tail_begin = nb * a.c;
    list.length = list.sparse_keys + (p + 1 - list.tail_begin);
    list.blocks = a.selected + t * a.selected_row;
  }
  return list;
}

// Cache slot of key `key`, or -1 when it is outside the table or its block id is out of range.
__device__ __forceinline__ int key_slot(const SparseArgs& a, const int32_t* table, int key) {
  if (key < 0 || key >= a.kv_capacity) return -1;
  const int block = __ldg(table + key / a.block_size);
  if (static_cast<unsigned>(block) >= static_cast<unsigned>(a.num_blocks)) return -1;
  return block * a.block_size + key % a.block_size;
}

// Gathers list entries [start, start + 64) of one KV head into swizzled shared tiles [64, D];
// entries outside [start, end) (and bad slots) are zero-filled so that masked rows stay finite.
// group_slots[g - group0] is the cache slot of the first key of entry group g (entries g c ..
// g c + c - 1 are c consecutive keys of one page: a selected block, the tail, or a dense run).
template <int kHeadDim>
__device__ __forceinline__ void load_tile(const SparseArgs& a, const int* group_slots, int group0, int kv_head,
                                          int start, int end, bf16* k_tile, bf16* v_tile) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kRowsPerPass = kThreads / kChunks;
  constexpr int kPasses = kKeysPerTile / kRowsPerPass;
  const int chunk = threadIdx.x % kChunks;
  const int first_row = static_cast<int>(threadIdx.x) / kChunks;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = start + first_row + pass * kRowsPerPass;
    int slot = -1;
    if (r < end) {
      const int base = group_slots[r / a.c - group0];
      slot = base < 0 ? -1 : base + r % a.c;
    }
    const int dst = swizzled_offset<kHeadDim>(first_row + pass * kRowsPerPass, chunk);
    const int64_t src = (static_cast<int64_t>(slot < 0 ? 0 : slot) * a.num_kv_heads + kv_head) * kHeadDim + chunk * 8;
    cp_async_16(smem_address(k_tile + dst), a.k_cache + src, slot >= 0);
    cp_async_16(smem_address(v_tile + dst), a.v_cache + src, slot >= 0);
  }
}

// The query rows (heads kv_head * G + row0 .. + 16 of token t) into a swizzled tile [16, D]; rows
// past the group are zero.
template <int kHeadDim>
__device__ __forceinline__ void load_q(const SparseArgs& a, int64_t t, int kv_head, int row0, int rows, bf16* tile) {
  constexpr int kChunks = kHeadDim / 8;
  for (int index = threadIdx.x; index < kRows * kChunks; index += kThreads) {
    const int row = index / kChunks, chunk = index % kChunks;
    uint4 value = make_uint4(0u, 0u, 0u, 0u);
    if (row < rows) {
      const int head = kv_head * a.group + row0 + row;
      const bf16* src = a.q + t * a.q_token_stride + head * a.q_head_stride + chunk * 8;
      if (a.q_vectorized) {
        value = __ldg(reinterpret_cast<const uint4*>(src));
      } else {
        const auto* h = reinterpret_cast<const uint16_t*>(src);
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = static_cast<uint32_t>(h[2 * i]) | (static_cast<uint32_t>(h[2 * i + 1]) << 16);
        value = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    *reinterpret_cast<uint4*>(tile + swizzled_offset<kHeadDim>(row, chunk)) = value;
  }
}

__device__ __forceinline__ void store_bf16x4(bf16* dst, float4 value, bool vectorized) {
  const uint32_t lo = pack_bf16x2(value.x, value.y), hi = pack_bf16x2(value.z, value.w);
  if (vectorized) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
  } else {
    auto* h = reinterpret_cast<uint16_t*>(dst);
    h[0] = static_cast<uint16_t>(lo & 0xffffu);
    h[1] = static_cast<uint16_t>(lo >> 16);
    h[2] = static_cast<uint16_t>(hi & 0xffffu);
    h[3] = static_cast<uint16_t>(hi >> 16);
  }
}

template <int kHeadDim>
struct SparseConfig {
  static constexpr int kStageElems = kKeysPerTile * kHeadDim;
  static constexpr int kCombineStride = kHeadDim + 8;
  static constexpr size_t kTileBytes =
      sizeof(bf16) * (static_cast<size_t>(kRows) * kHeadDim + 2u * kStages * kStageElems);
  static constexpr size_t kSmemBytes = kTileBytes + 2u * sizeof(float) * kWarps * kRows;
  static_assert(sizeof(float) * kWarps * kRows * kCombineStride <= sizeof(bf16) * 2u * kStages * kStageElems,
                "the combine buffer fits in the K/V stages");
};

template <int kHeadDim>
__global__ void __launch_bounds__(kThreads, 1) sparse_split_kernel(const SparseArgs a) {
  using Config = SparseConfig<kHeadDim>;
  constexpr int kDimTiles = kHeadDim / 8;
  constexpr int kKeysPerWarp = kKeysPerTile / kWarps;

  extern __shared__ __align__(128) uint8_t shared_raw[];
  bf16* q_tile = reinterpret_cast<bf16*>(shared_raw);
  bf16* k_tiles = q_tile + kRows * kHeadDim;
  bf16* v_tiles = k_tiles + kStages * Config::kStageElems;
  float* combine_acc = reinterpret_cast<float*>(k_tiles);
  float* combine_max = reinterpret_cast<float*>(shared_raw + Config::kTileBytes);
  float* combine_sum = combine_max + kWarps * kRows;

  const int64_t t = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int chunk = blockIdx.z % a.row_chunks, split = blockIdx.z / a.row_chunks;
  const int row0 = chunk * kRows;
  const int rows = min(kRows, a.group - row0);
  const KeyList list = key_list(a, t);
  if (list.length == 0) return;  // a row past the batch (the merge kernel skips it too)

  const int per_split = ((list.length + a.num_splits - 1) / a.num_splits + kKeysPerTile - 1) / kKeysPerTile * kKeysPerTile;
  const int range_begin = split * per_split;
  const int range_end = min(list.length, range_begin + per_split);
  const int num_tiles = range_end > range_begin ? (range_end - range_begin + kKeysPerTile - 1) / kKeysPerTile : 0;

  // Resolve the split's entry groups to cache slots once (block ids and page table read in
  // parallel), so that the pipeline's loads depend on shared memory only.
  __shared__ int group_slots[kMaxGroups];
  const int group0 = range_begin / a.c;
  const int group_end = min((range_end + a.c - 1) / a.c, group0 + kMaxGroups);
  for (int g = group0 + static_cast<int>(threadIdx.x); g < group_end; g += kThreads) {
    group_slots[g - group0] = key_slot(a, list.table, list.key(g * a.c, a.c));
  }
  __syncthreads();
  const auto load_stage = [&](int tile) {
    const int stage = tile % kStages;
    load_tile<kHeadDim>(a, group_slots, group0, kv_head, range_begin + tile * kKeysPerTile, range_end,
                        k_tiles + stage * Config::kStageElems, v_tiles + stage * Config::kStageElems);
  };
#pragma unroll
  for (int tile = 0; tile < kStages - 1; ++tile) {
    if (tile < num_tiles) load_stage(tile);
    cp_async_commit();
  }
  load_q<kHeadDim>(a, t, kv_head, row0, rows, q_tile);
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quad = lane & 3;
  uint32_t q_frag[kHeadDim / 16][4];
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    ldmatrix_x4(q_frag[ks], smem_address(q_tile + swizzled_offset<kHeadDim>(lane & 15, ks * 2 + (lane >> 4))));
  }
  float acc[kDimTiles][4];
#pragma unroll
  for (int dt = 0; dt < kDimTiles; ++dt) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  for (int n = 0; n < num_tiles; ++n) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (n + kStages - 1 < num_tiles) load_stage(n + kStages - 1);
    cp_async_commit();

    const int stage = n % kStages;
    const bf16* k_tile = k_tiles + stage * Config::kStageElems + warp * kKeysPerWarp * kHeadDim;
    const bf16* v_tile = v_tiles + stage * Config::kStageElems + warp * kKeysPerWarp * kHeadDim;
    const int entry0 = range_begin + n * kKeysPerTile + warp * kKeysPerWarp;
    float scores[2][4];
    attn::warp_scores_16keys<kHeadDim>(q_frag, k_tile, lane, scores);
    // Every listed key is visible to the row (causality is in the list); only entries past the
    // split's end are masked.
    const bool needs_mask = entry0 + kKeysPerWarp > range_end;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float s = scores[nt][e] * a.score_scale;
        if (needs_mask && entry0 + nt * 8 + quad * 2 + (e & 1) >= range_end) s = -INFINITY;
        scores[nt][e] = s;
      }
    }
    attn::online_softmax<2, kDimTiles>(scores, acc, row_max, row_sum);
    attn::warp_pv_16keys<kHeadDim>(scores, v_tile, lane, acc);
  }
  cp_async_wait<0>();
  __syncthreads();

  attn::stage_warp_state<kRows, kDimTiles>(row_max, row_sum, acc, warp, lane, combine_max, combine_sum, combine_acc,
                                        Config::kCombineStride);
  __syncthreads();

  const int row = threadIdx.x >> 3, part = threadIdx.x & 7;
  if (row >= rows) return;
  const attn::WarpWeights<kWarps> c = attn::combine_warp_weights<kWarps, kRows>(combine_max, combine_sum, row);
  const float inv = c.total > 0.0f ? 1.0f / c.total : 0.0f;
  const int head = kv_head * a.group + row0 + row;
  const int64_t cta = ((t * a.num_kv_heads + kv_head) * a.row_chunks + chunk) * a.num_splits + split;
#pragma unroll
  for (int j = 0; j < kHeadDim / 32; ++j) {
    const int d = j * 32 + part * 4;
    const float4 value = attn::combine_warp_acc<kWarps, kRows>(combine_acc, Config::kCombineStride, row, d, c, inv);
    if (a.num_splits == 1) {
      store_bf16x4(a.out + t * a.out_token_stride + head * a.out_head_stride + d, value, a.out_vectorized);
    } else {
      *reinterpret_cast<float4*>(a.partial_out + (cta * kRows + row) * kHeadDim + d) = value;
    }
  }
  if (a.num_splits > 1 && part == 0) {
    a.partial_lse[cta * kRows + row] = c.total > 0.0f ? c.max + attn::fast_log2(c.total) : -INFINITY;
  }
}

// Combines the splits of every valid row. Grid (T, n_kv, chunks), 8 threads per row.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads) sparse_merge_kernel(const SparseArgs a) {
  const int64_t t = blockIdx.x;
  const int kv_head = blockIdx.y, chunk = blockIdx.z;
  const int row0 = chunk * kRows, rows = min(kRows, a.group - row0);
  const int row = threadIdx.x >> 3, part = threadIdx.x & 7;
  if (row >= rows || key_list(a, t).length == 0) return;
  const int64_t first = ((t * a.num_kv_heads + kv_head) * a.row_chunks + chunk) * a.num_splits;
  float overall_max = -INFINITY;
  for (int s = 0; s < a.num_splits; ++s) overall_max = fmaxf(overall_max, a.partial_lse[(first + s) * kRows + row]);
  float4 sum[kHeadDim / 32];
#pragma unroll
  for (int j = 0; j < kHeadDim / 32; ++j) sum[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float total = 0.0f;
  for (int s = 0; s < a.num_splits; ++s) {
    const float lse = a.partial_lse[(first + s) * kRows + row];
    if (lse == -INFINITY) continue;  // an empty split
    const float weight = fast_exp2(lse - overall_max);
    total += weight;
    const float* partial = a.partial_out + ((first + s) * kRows + row) * kHeadDim + part * 4;
#pragma unroll
    for (int j = 0; j < kHeadDim / 32; ++j) {
      const float4 piece = *reinterpret_cast<const float4*>(partial + j * 32);
      sum[j].x += weight * piece.x;
      sum[j].y += weight * piece.y;
      sum[j].z += weight * piece.z;
      sum[j].w += weight * piece.w;
    }
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  const int head = kv_head * a.group + row0 + row;
  bf16* out = a.out + t * a.out_token_stride + head * a.out_head_stride + part * 4;
#pragma unroll
  for (int j = 0; j < kHeadDim / 32; ++j) {
    store_bf16x4(out + j * 32, make_float4(sum[j].x * inv, sum[j].y * inv, sum[j].z * inv, sum[j].w * inv),
                 a.out_vectorized);
  }
}

// ---- generic path ----

constexpr int kGenericThreads = 128;
constexpr int kGenericKeys = 128;

// T: the storage dtype of q, out and the caches (bf16, or float in f32 runs); SparseArgs types them
// as bf16 for the tensor-core kernel, here they are read as T.
template <typename T>
__global__ void __launch_bounds__(kGenericThreads) sparse_generic_kernel(const SparseArgs a, int head_dim) {
  __shared__ float q_shared[256];
  __shared__ float scores[kGenericKeys];
  __shared__ int slots[kGenericKeys];
  const int64_t t = blockIdx.x;
  const int head = blockIdx.y;
  const KeyList list = key_list(a, t);
  if (list.length == 0) return;
  const int kv_head = head / a.group;
  const T* k_cache = reinterpret_cast<const T*>(a.k_cache);
  const T* v_cache = reinterpret_cast<const T*>(a.v_cache);
  const T* q = reinterpret_cast<const T*>(a.q) + t * a.q_token_stride + static_cast<int64_t>(head) * a.q_head_stride;
  for (int d = threadIdx.x; d < head_dim; d += kGenericThreads) q_shared[d] = to_f32(q[d]);
  __syncthreads();
  float acc0 = 0.0f, acc1 = 0.0f, running_max = -INFINITY, running_sum = 0.0f;
  for (int chunk = 0; chunk < list.length; chunk += kGenericKeys) {
    const int count = min(kGenericKeys, list.length - chunk);
    if (threadIdx.x < count) {
      const int slot = key_slot(a, list.table, list.key(chunk + threadIdx.x, a.c));
      slots[threadIdx.x] = slot;
      float dot = -INFINITY;
      if (slot >= 0) {
        const T* k = k_cache + (static_cast<int64_t>(slot) * a.num_kv_heads + kv_head) * head_dim;
        dot = 0.0f;
        for (int d = 0; d < head_dim; ++d) dot += q_shared[d] * to_f32(k[d]);
        dot *= a.score_scale;
      }
      scores[threadIdx.x] = dot;
    }
    __syncthreads();
    float chunk_max = -INFINITY;
    for (int j = 0; j < count; ++j) chunk_max = fmaxf(chunk_max, scores[j]);
    const float new_max = fmaxf(running_max, chunk_max);
    const float base = new_max == -INFINITY ? 0.0f : new_max;
    const float rescale = exp2f(running_max - base);
    acc0 *= rescale;
    acc1 *= rescale;
    running_sum *= rescale;
    for (int j = 0; j < count; ++j) {
      if (slots[j] < 0) continue;
      const float p = exp2f(scores[j] - base);
      running_sum += p;
      const T* v = v_cache + (static_cast<int64_t>(slots[j]) * a.num_kv_heads + kv_head) * head_dim;
      if (threadIdx.x < head_dim) acc0 += p * to_f32(v[threadIdx.x]);
      if (threadIdx.x + kGenericThreads < head_dim) acc1 += p * to_f32(v[threadIdx.x + kGenericThreads]);
    }
    running_max = new_max;
    __syncthreads();
  }
  const float inverse = running_sum > 0.0f ? 1.0f / running_sum : 0.0f;
  T* out = reinterpret_cast<T*>(a.out) + t * a.out_token_stride + static_cast<int64_t>(head) * a.out_head_stride;
  if (threadIdx.x < head_dim) out[threadIdx.x] = from_f32<T>(acc0 * inverse);
  if (threadIdx.x + kGenericThreads < head_dim) out[threadIdx.x + kGenericThreads] = from_f32<T>(acc1 * inverse);
}

// ---- host side ----

int sm_count(int device) {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static std::array<int, kMaxDevices> cache{};
  if (device < 0 || device >= kMaxDevices) return 132;
  std::lock_guard lock(mutex);
  if (cache[static_cast<size_t>(device)] == 0) {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0) {
      cudaGetLastError();
      count = 132;
    }
    cache[static_cast<size_t>(device)] = count;
  }
  return cache[static_cast<size_t>(device)];
}

int planning_sm_count() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 256;
  }
  return sm_count(device);
}

void allow_dynamic_smem(const void* kernel, size_t bytes) {
  static std::mutex mutex;
  static std::vector<std::pair<const void*, int>> done;
  int device = 0;
  METRALE_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lock(mutex);
  for (const auto& entry : done) {
    if (entry.first == kernel && entry.second == device) return;
  }
  METRALE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  done.emplace_back(kernel, device);
}

// Splits of a row's list (whole 64-entry tiles, >= kMinKeysPerSplit entries each) until the grid
// has about kCtasPerSmTarget CTAs per SM; base * splits < 2 * target (the workspace bound).
int plan_splits(int64_t base, int64_t max_list, int64_t list_cap, int c, int num_sms) {
  const int64_t target = static_cast<int64_t>(kCtasPerSmTarget) * num_sms;
  const int64_t length = std::max<int64_t>(max_list, 1);
  // A split's entries must fit kMaxGroups groups whatever the row's true length (<= list_cap).
  const int64_t entries_cap = static_cast<int64_t>(kMaxGroups) * c - kKeysPerTile - 2 * c;
  const int64_t min_splits = (std::max<int64_t>(list_cap, 1) + entries_cap - 1) / entries_cap;
  int64_t splits = 1;
  if (base < target) {
    const int64_t wanted = (target + base - 1) / base;
    const int64_t by_length = (length + kMinKeysPerSplit - 1) / kMinKeysPerSplit;
    splits = std::max<int64_t>(1, std::min(wanted, by_length));
  }
  int64_t per = (length + splits - 1) / splits;
  per = (per + kKeysPerTile - 1) / kKeysPerTile * kKeysPerTile;
  return static_cast<int>(std::max<int64_t>(min_splits, (length + per - 1) / per));
}

size_t split_workspace_bytes(int64_t ctas, int64_t head_dim) {
  return static_cast<size_t>(ctas) * kRows * static_cast<size_t>(head_dim + 1) * sizeof(float);
}

bool aligned16(const void* pointer) { return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0; }

template <int kHeadDim>
void launch_sparse(const SparseArgs& args, int64_t tokens, int64_t kv_heads, cudaStream_t stream) {
  constexpr size_t smem = SparseConfig<kHeadDim>::kSmemBytes;
  void (*kernel)(SparseArgs) = sparse_split_kernel<kHeadDim>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(kv_heads),
                  static_cast<unsigned>(args.row_chunks * args.num_splits));
  kernel<<<grid, kThreads, smem, stream>>>(args);
  METRALE_CHECK_LAUNCH("qsa sparse_split_kernel");
  if (args.num_splits > 1) {
    const dim3 merge_grid(static_cast<unsigned>(tokens), static_cast<unsigned>(kv_heads),
                          static_cast<unsigned>(args.row_chunks));
    sparse_merge_kernel<kHeadDim><<<merge_grid, kThreads, 0, stream>>>(args);
    METRALE_CHECK_LAUNCH("qsa sparse_merge_kernel");
  }
}

[[noreturn]] void unsupported(const std::string& message) {
  raise_message(ErrorCode::kUnsupported, "qsa_attention (cuda): " + message);
}

}  // namespace

void qsa_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& cu_q,
                   const Tensor& kv_lens, const Tensor& block_tables, const Tensor& selected, const Tensor& out,
                   const QsaAttentionParams& params) {
  METRALE_EXPECT(q.ndim() == 3 && out.ndim() == 3 && k_cache.ndim() == 4 && v_cache.ndim() == 4,
                 "qsa_attention ranks: q " + q.describe() + ", cache " + k_cache.describe());
  const int64_t tokens = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t num_seqs = kv_lens.numel();
  METRALE_EXPECT(out.shape() == q.shape() && v_cache.shape() == k_cache.shape() && k_cache.size(3) == head_dim &&
                     kv_heads > 0 && heads % kv_heads == 0 && block_size > 0 && params.compress_ratio >= 1 &&
                     params.block_topk >= 1,
                 "qsa_attention shapes: q " + q.describe() + ", out " + out.describe() + ", cache " +
                     k_cache.describe());
  METRALE_EXPECT(cu_q.numel() == num_seqs + 1 && block_tables.ndim() == 2 && block_tables.size(0) >= num_seqs &&
                     selected.ndim() == 2 && selected.size(0) == tokens && selected.size(1) == params.block_topk &&
                     selected.dtype() == DType::kI32 && selected.stride(1) == 1,
                 "qsa_attention metadata: cu_q " + cu_q.describe() + ", block_tables " + block_tables.describe() +
                     ", selected " + selected.describe());
  METRALE_EXPECT(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                     cu_q.dtype() == DType::kI32 && kv_lens.dtype() == DType::kI32 &&
                     block_tables.dtype() == DType::kI32 && block_tables.stride(1) == 1,
                 "qsa_attention layout: unit head_dim stride, contiguous caches and i32 metadata");
  for (const Tensor* t : {&q, &k_cache, &v_cache, &cu_q, &kv_lens, &block_tables, &selected, &out}) {
    METRALE_EXPECT(t->device().is_cuda(), "qsa_attention: tensors must be on the GPU (" + t->describe() + ")");
  }
  const DType dtype = q.dtype();
  if ((dtype != DType::kBF16 && dtype != DType::kF32) || out.dtype() != dtype || k_cache.dtype() != dtype ||
      v_cache.dtype() != dtype) {
    unsupported("q, out and the caches must all be bf16 or all f32, got q " + q.describe() + ", cache " +
                k_cache.describe());
  }
  // f32 runs take the generic kernel at every head size (the tensor-core kernel reads bf16).
  const bool generic = dtype == DType::kF32 || (head_dim != 64 && head_dim != 128 && head_dim != 256);
  if (generic && (head_dim > 256 || head_dim % 2 != 0)) unsupported("head_dim " + std::to_string(head_dim));
  if (!aligned16(k_cache.data()) || !aligned16(v_cache.data())) unsupported("the caches must be 16-byte aligned");
  const int64_t capacity = block_tables.size(1) * block_size;
  if (tokens > INT32_MAX || kv_heads > 65535 || capacity > INT32_MAX / 2 || num_blocks * block_size >= INT32_MAX) {
    unsupported("batch too large");
  }
  if (tokens == 0 || num_seqs == 0) return;
  const int64_t group = heads / kv_heads;

  SparseArgs a{};
  a.q = q.data_as<const bf16>();
  a.q_token_stride = q.stride(0);
  a.q_head_stride = q.stride(1);
  a.out = out.data_as<bf16>();
  a.out_token_stride = out.stride(0);
  a.out_head_stride = out.stride(1);
  a.cu_q = cu_q.data_as<const int32_t>();
  a.kv_lens = kv_lens.data_as<const int32_t>();
  a.k_cache = k_cache.data_as<const bf16>();
  a.v_cache = v_cache.data_as<const bf16>();
  a.block_tables = block_tables.data_as<const int32_t>();
  a.table_stride = block_tables.stride(0);
  a.selected = selected.data_as<const int32_t>();
  a.selected_row = selected.stride(0);
  a.block_size = static_cast<int>(block_size);
  a.num_blocks = static_cast<int>(num_blocks);
  a.num_kv_heads = static_cast<int>(kv_heads);
  a.num_seqs = static_cast<int>(num_seqs);
  a.group = static_cast<int>(group);
  a.c = params.compress_ratio;
  a.topk = params.block_topk;
  a.kv_capacity = static_cast<int>(capacity);
  a.score_scale = params.scale * kLog2e;
  a.q_vectorized = aligned16(q.data()) && q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0;
  a.out_vectorized = aligned16(out.data()) && out.stride(0) % 8 == 0 && out.stride(1) % 8 == 0;
  const cudaStream_t stream = stream_of(out);
  if (generic) {
    const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(heads));
    if (dtype == DType::kF32) {
      sparse_generic_kernel<float><<<grid, kGenericThreads, 0, stream>>>(a, static_cast<int>(head_dim));
    } else {
      sparse_generic_kernel<bf16><<<grid, kGenericThreads, 0, stream>>>(a, static_cast<int>(head_dim));
    }
    METRALE_CHECK_LAUNCH("qsa sparse_generic_kernel");
    return;
  }
  a.row_chunks = static_cast<int>((group + kRows - 1) / kRows);
  // Longest list: the budget plus a tail (sparse rows), or every key of a dense row, which has at
  // most that many too; never more than the context bound.
  const int64_t kv_bound = params.max_kv_len > 0 ? std::min(params.max_kv_len, capacity) : capacity;
  const int64_t max_list = std::min<int64_t>(kv_bound, static_cast<int64_t>(a.topk + 1) * a.c - 1);
  const int64_t base = tokens * kv_heads * a.row_chunks;
  const int64_t list_cap = static_cast<int64_t>(a.topk + 1) * a.c - 1;  // any row's list, whatever the bounds
  a.num_splits = plan_splits(base, max_list, list_cap, a.c, sm_count(out.device().index));
  if (a.num_splits > 1) {
    const size_t needed = split_workspace_bytes(base * a.num_splits, head_dim);
    if (params.workspace.empty()) {
      // No scratch: one split per row, unless its list needs more groups than a split resolves.
      if (list_cap > static_cast<int64_t>(kMaxGroups) * a.c - kKeysPerTile - 2 * a.c) {
        unsupported("block_topk " + std::to_string(a.topk) + " needs a workspace (qsa_attention_workspace_bytes)");
      }
      a.num_splits = 1;
    } else {
      if (!params.workspace.device().is_cuda() || !aligned16(params.workspace.data()) ||
          params.workspace.nbytes() < needed) {
        raise_message(ErrorCode::kInvalidArgument,
                      "qsa_attention (cuda): workspace " + params.workspace.describe() + " must be a 16-byte aligned "
                      "GPU buffer of at least " + std::to_string(needed) + " bytes (qsa_attention_workspace_bytes)");
      }
      a.partial_out = static_cast<float*>(params.workspace.data());
      a.partial_lse = a.partial_out + base * a.num_splits * kRows * head_dim;
    }
  }
  switch (head_dim) {
    case 64: launch_sparse<64>(a, tokens, kv_heads, stream); break;
    case 128: launch_sparse<128>(a, tokens, kv_heads, stream); break;
    default: launch_sparse<256>(a, tokens, kv_heads, stream); break;
  }
}

}  // namespace cuda

// For each CTA of the largest split plan, 16 rows of head_dim fp32 partials and one fp32
// log2-sum-exp. Splits for occupancy keep the CTAs below 2 * kCtasPerSmTarget * SMs (8.7 MB for
// head_dim 256 on 132 SMs); a block_topk too large for one split's slot table (above ~1000 blocks at
// c 4) forces splits at any batch size. 0 when no split can happen.
size_t qsa_attention_workspace_bytes(int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int64_t block_topk, int64_t compress_ratio) {
  const int64_t target = static_cast<int64_t>(cuda::kCtasPerSmTarget) * cuda::planning_sm_count();
  const int64_t group = num_kv_heads > 0 ? num_heads / num_kv_heads : 1;
  const int64_t base = std::max<int64_t>(num_tokens, 1) * std::max<int64_t>(num_kv_heads, 1) *
                       ((group + cuda::kRows - 1) / cuda::kRows);
  const int64_t c = std::max<int64_t>(compress_ratio, 1);
  const int64_t list_cap = (std::max<int64_t>(block_topk, 1) + 1) * c - 1;
  const int64_t entries_cap = static_cast<int64_t>(cuda::kMaxGroups) * c - cuda::kKeysPerTile - 2 * c;
  const int64_t min_splits = (list_cap + entries_cap - 1) / entries_cap;
  if (base >= target && min_splits == 1) return 0;
  return cuda::split_workspace_bytes(std::max(2 * target, base * min_splits), head_dim);
}

}  // namespace metrale::kernels
