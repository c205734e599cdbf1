// QSA indexer ops on the GPU (semantics and rounding in kernels/qsa.h; the CPU twin is the
// reference). Metadata is read on the device only and grids come from tensor shapes and host
// bounds, so every launch can be captured in a CUDA graph.
//
//  * prologue: one CTA per token, a warp per index head (and one for the key's cache write); a
//    head's row is normalised in registers, staged in shared memory for RoPE's channel pairs.
//  * block keys: a warp per block key: the fp32 sum of its c raw keys (paged reads), the norm, RoPE
//    at the block's first position, one store. Grid (S, y): y strides over the blocks to write.
//  * scores: grid (T, W / 64): a CTA scores 64 blocks of one query row. L lanes per block key
//    (L = 4, 8, 16 or 32 for d_idx up to 8L), 8 channels per lane (one 16-byte load for bf16), the
//    query's heads in registers; per-head segment reductions; lane 0 of a segment writes the fp32
//    score. (Loading all of a CTA's keys before the first use, or 256 blocks per CTA, measured
//    slower at batch 128 and no faster at batch 1 on the H200.)
//    Memory-bound: it reads each block key once per query row (d_idx * 2 bytes).
//  * top-k: one CTA of 512 threads per query row, its scores staged in shared memory when they fit
//    (up to 160 KB, 40960 blocks). A radix select over the scores' order-preserving
//    32-bit keys (4 passes of 8 bits, histograms in shared memory with warp-aggregated atomics, a
//    parallel suffix sum to pick the digit) finds the k-th largest key t and how many entries equal
//    to t are taken; a last pass compacts, in index order, the entries above t and the first of those
//    equal to t (block prefix sums), so the output is ascending and ties go to the lower index.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/qsa.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kMaxWidth = 256;   // d_idx
constexpr int kMaxPerLane = kMaxWidth / 32;

template <typename T>
__device__ __forceinline__ float round_to(float value) {
  return to_f32(from_f32<T>(value));
}


// Position of `row`, or -1 when the row is past the batch.
__device__ __forceinline__ int row_position(const int32_t* cu_q, const int32_t* kv_lens, int num_seqs, int64_t row,
                                            int* seq_out) {
  if (row >= cu_q[num_seqs]) return -1;
  const int s = sequence_of(cu_q, num_seqs, row);
  *seq_out = s;
  return kv_lens[s] - (cu_q[s + 1] - cu_q[s]) + static_cast<int>(row - cu_q[s]);
}

// zc over a warp's row (lane holds channels lane + 32 i), then RoPE through `stage` (kMaxWidth
// floats of this warp's shared memory); the result goes to dst (width channels of T).
template <typename T>
__device__ __forceinline__ void norm_rope_store(float (&x)[kMaxPerLane], int width, const void* weight,
                                                WeightType weight_type, float eps, const float* cos_table,
                                                const float* sin_table, int half, float* stage, T* dst) {
  const int lane = threadIdx.x & 31;
  float squares = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < width) squares += x[i] * x[i];
  }
  const float inv = rsqrtf(warp_sum(squares) / static_cast<float>(width) + eps);
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int c = lane + 32 * i;
    if (c < width) stage[c] = round_to<T>(x[i] * inv * (1.0f + load_weight(weight, weight_type, c)));
  }
  __syncwarp();
  for (int c = lane; c < width; c += 32) {
    float value = stage[c];
    if (c < 2 * half) {
      const int i = c < half ? c : c - half;
      const float cs = cos_table[i], sn = sin_table[i];
      const float a = stage[i], b = stage[i + half];
      value = c < half ? __fsub_rn(round_to<T>(__fmul_rn(a, cs)), round_to<T>(__fmul_rn(b, sn)))
                       : __fadd_rn(round_to<T>(__fmul_rn(b, cs)), round_to<T>(__fmul_rn(a, sn)));
    }
    dst[c] = from_f32<T>(value);
  }
  __syncwarp();
}

// cos, sin = D(cos(p f) s), D(sin(p f) s) for i in [begin, half) by `step`.
template <typename T>
__device__ __forceinline__ void fill_rope_tables(int position, const float* inv_freq, int half, float scaling,
                                                 int begin, int step, float* cos_table, float* sin_table) {
  for (int i = begin; i < half; i += step) {
    float sine, cosine;
    sincosf(__fmul_rn(static_cast<float>(position), inv_freq[i]), &sine, &cosine);
    cos_table[i] = round_to<T>(__fmul_rn(cosine, scaling));
    sin_table[i] = round_to<T>(__fmul_rn(sine, scaling));
  }
}

// ---- prologue ----

constexpr int kPrologueWarps = 4;

struct PrologueArgs {
  void* q;  // [T, n_idx, d]
  int64_t q_token_stride, q_head_stride;
  const void* k;  // [T, d]
  int64_t k_row;
  const void* weight;
  WeightType weight_type;
  const int32_t* positions;
  const float* inv_freq;
  const int32_t* slots;
  void* cache;  // [cache_slots, d]
  int64_t cache_slots;
  int heads, width, half;
  float eps, scaling;
};

template <typename T>
__global__ void __launch_bounds__(32 * kPrologueWarps) prologue_kernel(PrologueArgs a) {
  __shared__ float cos_table[kMaxWidth / 2], sin_table[kMaxWidth / 2];
  __shared__ float stage[kPrologueWarps][kMaxWidth];
  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  fill_rope_tables<T>(a.positions[t], a.inv_freq, a.half, a.scaling, threadIdx.x, 32 * kPrologueWarps, cos_table,
                      sin_table);
  __syncthreads();
  for (int h = warp; h <= a.heads; h += kPrologueWarps) {
    if (h == a.heads) {  // the raw key to its cache slot
      const int64_t slot = a.slots[t];
      if (slot < 0 || slot >= a.cache_slots) continue;
      const T* src = static_cast<const T*>(a.k) + t * a.k_row;
      T* dst = static_cast<T*>(a.cache) + slot * a.width;
      for (int c = lane; c < a.width; c += 32) dst[c] = src[c];
      continue;
    }
    T* row = static_cast<T*>(a.q) + t * a.q_token_stride + h * a.q_head_stride;
    float x[kMaxPerLane];
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int c = lane + 32 * i;
      x[i] = c < a.width ? to_f32(row[c]) : 0.0f;
    }
    norm_rope_store<T>(x, a.width, a.weight, a.weight_type, a.eps, cos_table, sin_table, a.half, stage[warp], row);
  }
}

// ---- block keys ----

constexpr int kBlockKeyWarps = 4;

struct BlockKeyArgs {
  const void* cache;  // [num_blocks * block_size, d]
  void* keys;         // [num_blocks * block_size / c, d]
  const void* weight;
  WeightType weight_type;
  const float* inv_freq;
  const int32_t* cu_q;
  const int32_t* kv_lens;
  const int32_t* tables;
  const int32_t* row_slots;  // optional [T]: blocks completed by a row of slot -1 are skipped
  int64_t table_stride;
  int num_blocks, block_size, c, width, half, num_seqs;
  float eps, scaling;
  bool all_blocks;
};

template <typename T>
__global__ void __launch_bounds__(32 * kBlockKeyWarps) block_keys_kernel(BlockKeyArgs a) {
  __shared__ float tables_smem[kBlockKeyWarps][kMaxWidth];  // cos | sin per warp
  __shared__ float stage[kBlockKeyWarps][kMaxWidth];
  const int s = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q_len = a.cu_q[s + 1] - a.cu_q[s], kv_len = a.kv_lens[s];
  const int ctx = kv_len - q_len;
  const int first = a.all_blocks ? 0 : ctx / a.c, last = kv_len / a.c;
  const int32_t* table = a.tables + s * a.table_stride;
  float* cos_table = tables_smem[warp];
  float* sin_table = tables_smem[warp] + kMaxWidth / 2;
  for (int j = first + blockIdx.y * kBlockKeyWarps + warp; j < last; j += gridDim.y * kBlockKeyWarps) {
    const int token0 = j * a.c;
    const int last_token = token0 + a.c - 1;  // a row of this step when >= ctx
    if (a.row_slots != nullptr && last_token >= ctx && __ldg(a.row_slots + a.cu_q[s] + last_token - ctx) < 0) continue;
    const int page = __ldg(table + token0 / a.block_size);
    if (page < 0 || page >= a.num_blocks) continue;  // a corrupt table must not make us write outside the cache
    const int64_t slot0 = static_cast<int64_t>(page) * a.block_size + token0 % a.block_size;
    float x[kMaxPerLane];
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) x[i] = 0.0f;
    for (int i = 0; i < a.c; ++i) {  // the c tokens of a block share one page
      const T* key = static_cast<const T*>(a.cache) + (slot0 + i) * a.width;
#pragma unroll
      for (int e = 0; e < kMaxPerLane; ++e) {
        const int c = lane + 32 * e;
        if (c < a.width) x[e] += to_f32(key[c]);
      }
    }
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) x[e] = round_to<T>(x[e] / static_cast<float>(a.c));
    fill_rope_tables<T>(token0, a.inv_freq, a.half, a.scaling, lane, 32, cos_table, sin_table);
    __syncwarp();
    T* dst = static_cast<T*>(a.keys) + (slot0 / a.c) * a.width;
    norm_rope_store<T>(x, a.width, a.weight, a.weight_type, a.eps, cos_table, sin_table, a.half, stage[warp], dst);
  }
}

// ---- scores ----

constexpr int kScoreWarps = 4;
constexpr int kBlocksPerScoreCta = 64;
constexpr int kMaxIndexHeads = 16;

struct ScoreArgs {
  const void* q;  // [T, n_idx, d]
  int64_t q_token_stride, q_head_stride;
  const void* keys;  // [num_blocks * block_size / c, d]
  float* scores;     // [T, W]
  int64_t score_row;
  const int32_t* cu_q;
  const int32_t* kv_lens;
  const int32_t* tables;
  int64_t table_stride;
  int num_blocks, block_size, c, width, heads, num_seqs;
  int64_t tokens;
  float inv_sqrt_width;
};

template <typename T, int kLanes, int kHeads>
__global__ void __launch_bounds__(32 * kScoreWarps) scores_kernel(ScoreArgs a) {
  constexpr int kSegments = 32 / kLanes;  // block keys per warp at a time
  __shared__ float q_smem[kHeads][kMaxWidth];
  const int64_t t = blockIdx.x;
  int s = 0;
  const int p = row_position(a.cu_q, a.kv_lens, a.num_seqs, t, &s);
  const int nb = (p + 1) / a.c;
  const int j_begin = blockIdx.y * kBlocksPerScoreCta;
  if (p < 0 || j_begin >= nb) return;
  for (int i = threadIdx.x; i < kHeads * a.width; i += 32 * kScoreWarps) {
    const int h = i / a.width, c = i % a.width;
    q_smem[h][c] = h < a.heads
                       ? to_f32(static_cast<const T*>(a.q)[t * a.q_token_stride + h * a.q_head_stride + c])
                       : 0.0f;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int segment = lane / kLanes, part = lane % kLanes;
  const int c0 = part * 8;  // this lane's 8 channels
  const bool active = c0 < a.width;
  float q[kHeads][8];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
#pragma unroll
    for (int e = 0; e < 8; ++e) q[h][e] = active ? q_smem[h][c0 + e] : 0.0f;
  }
  const int keys_per_page = a.block_size / a.c;
  const int32_t* table = a.tables + s * a.table_stride;
  const int j_end = min(nb, j_begin + kBlocksPerScoreCta);
  // `base` is uniform over the warp, so every lane takes part in the segment shuffles; lanes past the
  // end compute on zeros and store nothing.
  for (int base = j_begin + warp * kSegments; base < j_end; base += kSegments * kScoreWarps) {
    const int j = base + segment;
    const bool valid = j < j_end;
    float k[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (valid && active) {
      const int page = __ldg(table + j / keys_per_page);
      if (page >= 0 && page < a.num_blocks) {
        const T* key = static_cast<const T*>(a.keys) +
                       (static_cast<int64_t>(page) * keys_per_page + j % keys_per_page) * a.width + c0;
        const Vec<T, 8> raw = *reinterpret_cast<const Vec<T, 8>*>(key);
#pragma unroll
        for (int e = 0; e < 8; ++e) k[e] = to_f32(raw.v[e]);
      }
    }
    float total = 0.0f;
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) dot = fmaf(q[h][e], k[e], dot);
#pragma unroll
      for (int offset = kLanes / 2; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      total += fmaxf(dot, 0.0f);
    }
    if (valid && part == 0) a.scores[t * a.score_row + j] = total * a.inv_sqrt_width;
  }
}

// ---- top-k ----

constexpr int kTopkThreads = 512;
constexpr size_t kMaxStagedBytes = 160u * 1024u;  // 40960 blocks: 160K tokens at c = 4
constexpr int kTopkWarps = kTopkThreads / 32;

// Order-preserving key of an fp32 score (-0 maps with +0; NaN scores are not expected).
__device__ __forceinline__ uint32_t order_key(float value) {
  uint32_t bits = __float_as_uint(value == 0.0f ? 0.0f : value);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

struct TopkArgs {
  const float* scores;
  int64_t score_row;
  int32_t* selected;
  int64_t selected_row;
  const int32_t* cu_q;
  const int32_t* kv_lens;
  int num_seqs, c, k;
};

// Exclusive prefix sum (in thread order) of `value` over the CTA, and the CTA's total;
// `warp_sums` holds kTopkWarps ints. Contains barriers: every thread must call it.
__device__ __forceinline__ int block_exclusive_sum(int value, int* warp_sums, int* total) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  __syncthreads();  // warp_sums may still be read by the previous call
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int before = 0, sum = 0;
#pragma unroll
  for (int w = 0; w < kTopkWarps; ++w) {
    const int count = warp_sums[w];
    before += w < warp ? count : 0;
    sum += count;
  }
  *total = sum;
  return before + inclusive - value;
}

// kStaged: the row's scores are first copied into dynamic shared memory (one coalesced read from
// global memory), and every pass reads them from there.
template <bool kStaged>
__global__ void __launch_bounds__(kTopkThreads) topk_kernel(TopkArgs a) {
  extern __shared__ float staged[];
  __shared__ int histogram[256];
  __shared__ int warp_counts[kTopkWarps];
  __shared__ int inclusive_scan[256];
  __shared__ int digit_warp_totals[8];
  __shared__ uint32_t chosen_prefix;
  __shared__ int chosen_remaining;
  const int64_t t = blockIdx.x;
  int s = 0;
  const int p = row_position(a.cu_q, a.kv_lens, a.num_seqs, t, &s);
  if (p < 0) return;
  const int nb = (p + 1) / a.c;
  int32_t* out = a.selected + t * a.selected_row;
  if (nb <= a.k) {
    for (int i = threadIdx.x; i < a.k; i += kTopkThreads) out[i] = i < nb ? i : -1;
    return;
  }
  const float* row = a.scores + t * a.score_row;
  if constexpr (kStaged) {
    // 8 loads in flight per thread before the first store (a plain loop would wait for each).
    constexpr int kBatch = 8;
    for (int base = 0; base < nb; base += kTopkThreads * kBatch) {
      float values[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int j = base + u * kTopkThreads + threadIdx.x;
        values[u] = j < nb ? row[j] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int j = base + u * kTopkThreads + threadIdx.x;
        if (j < nb) staged[j] = values[u];
      }
    }
    __syncthreads();
    row = staged;
  }
  uint32_t prefix = 0, mask = 0;
  int remaining = a.k;  // entries still to take at or below the current prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kTopkThreads) histogram[i] = 0;
    __syncthreads();
    // Scores of one row share their high bits: lanes with the same digit add once per warp, so
    // the shared-memory atomics do not serialise on one bin. `base` is uniform over the warp.
    for (int base = 0; base < nb; base += kTopkThreads) {
      const int j = base + threadIdx.x;
      const uint32_t key = j < nb ? order_key(row[j]) : 0u;
      const unsigned digit = j < nb && (key & mask) == prefix ? (key >> shift) & 255u : 256u;
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      if (digit < 256u && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&histogram[digit], __popc(peers));
    }
    __syncthreads();
    // Suffix sums over the digits: thread i holds digit 255 - i; an inclusive scan in thread order.
    if (threadIdx.x < 256) {
      const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
      int value = histogram[255 - threadIdx.x];
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, value, offset);
        if (lane >= offset) value += other;
      }
      inclusive_scan[threadIdx.x] = value;
      if (lane == 31) digit_warp_totals[warp] = value;
    }
    __syncthreads();
    if (threadIdx.x < 256) {
      const int warp = threadIdx.x >> 5;
      int offset = 0;
      for (int w = 0; w < warp; ++w) offset += digit_warp_totals[w];
      const int inclusive = inclusive_scan[threadIdx.x] + offset;
      const int exclusive = inclusive - histogram[255 - threadIdx.x];
      if (exclusive < remaining && inclusive >= remaining) {
        chosen_prefix = static_cast<uint32_t>(255 - threadIdx.x);
        chosen_remaining = remaining - exclusive;
      }
    }
    __syncthreads();
    prefix |= chosen_prefix << shift;
    mask |= 255u << shift;
    remaining = chosen_remaining;
    __syncthreads();
  }
  // prefix is the k-th largest key; `remaining` entries equal to it are taken, lowest indices first.
  // Each thread takes 4 consecutive entries of a 2048-entry tile, so thread order is index order.
  constexpr int kPerThread = 4;
  int taken_equal = 0, written = 0;
  for (int base = 0; base < nb; base += kTopkThreads * kPerThread) {
    const int first = base + threadIdx.x * kPerThread;
    uint32_t keys[kPerThread];
    int equal_count = 0;
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      keys[e] = first + e < nb ? order_key(row[first + e]) : 0u;
      equal_count += first + e < nb && keys[e] == prefix;
    }
    int equal_total = 0;
    int equal_seen = taken_equal + block_exclusive_sum(equal_count, warp_counts, &equal_total);
    bool take[kPerThread];
    int take_count = 0;
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      const bool valid = first + e < nb, equal = valid && keys[e] == prefix;
      take[e] = valid && (keys[e] > prefix || (equal && equal_seen < remaining));
      equal_seen += equal;
      take_count += take[e];
    }
    int take_total = 0;
    int position = written + block_exclusive_sum(take_count, warp_counts, &take_total);
#pragma unroll
    for (int e = 0; e < kPerThread; ++e) {
      if (take[e]) out[position++] = first + e;
    }
    taken_equal += equal_total;
    written += take_total;
  }
}

// ---- host side ----

[[noreturn]] void unsupported(const std::string& message) {
  raise_message(ErrorCode::kUnsupported, "qsa (cuda): " + message);
}

void expect_gpu(std::initializer_list<const Tensor*> tensors, const char* op) {
  for (const Tensor* t : tensors) {
    METRALE_EXPECT(t->device().is_cuda(), std::string(op) + ": tensors must be on the GPU (" + t->describe() + ")");
  }
}

void expect_batch(const Tensor& cu_q, const Tensor& kv_lens, const char* op) {
  METRALE_EXPECT(cu_q.numel() == kv_lens.numel() + 1 && cu_q.dtype() == DType::kI32 && kv_lens.dtype() == DType::kI32 &&
                     cu_q.is_contiguous() && kv_lens.is_contiguous() && kv_lens.numel() <= INT32_MAX,
                 std::string(op) + ": cu_q " + cu_q.describe() + " kv_lens " + kv_lens.describe());
}

void expect_rope(const QsaParams& params, const Tensor& inv_freq, int64_t width, const char* op) {
  METRALE_EXPECT(params.rope.rotary_dim % 2 == 0 && params.rope.rotary_dim <= width &&
                     inv_freq.numel() == params.rope.rotary_dim / 2 && inv_freq.dtype() == DType::kF32 &&
                     inv_freq.is_contiguous(),
                 std::string(op) + ": rotary_dim " + std::to_string(params.rope.rotary_dim) + " inv_freq " +
                     inv_freq.describe());
  if (width > kMaxWidth) unsupported(std::string(op) + ": d_idx " + std::to_string(width) + " above 256");
}

template <typename Body>
void dispatch_activation(DType dtype, const char* op, const Body& body) {
  switch (dtype) {
    case DType::kBF16: body(__nv_bfloat16{}); break;
    case DType::kF32: body(float{}); break;
    default: unsupported(std::string(op) + ": activation dtype " + std::string(dtype_name(dtype)));
  }
}

}  // namespace

void qsa_index_prologue(const Tensor& q_idx, const Tensor& k_tok, const Tensor& q_norm_weight,
                        const Tensor& positions, const Tensor& inv_freq, const Tensor& slot_mapping,
                        const Tensor& index_cache, const QsaParams& params) {
  expect_gpu({&q_idx, &k_tok, &q_norm_weight, &positions, &inv_freq, &slot_mapping, &index_cache},
             "qsa_index_prologue");
  METRALE_EXPECT(q_idx.ndim() == 3 && q_idx.stride(2) == 1 && k_tok.ndim() == 2 && k_tok.stride(1) == 1 &&
                     index_cache.ndim() == 3 && index_cache.is_contiguous(),
                 "qsa_index_prologue: q " + q_idx.describe() + " k " + k_tok.describe() + " cache " +
                     index_cache.describe());
  const int64_t tokens = q_idx.size(0), heads = q_idx.size(1), width = q_idx.size(2);
  METRALE_EXPECT(k_tok.size(0) == tokens && k_tok.size(1) == width && index_cache.size(2) == width &&
                     q_norm_weight.numel() == width && positions.numel() == tokens &&
                     slot_mapping.numel() == tokens && positions.dtype() == DType::kI32 &&
                     slot_mapping.dtype() == DType::kI32 && k_tok.dtype() == q_idx.dtype() &&
                     index_cache.dtype() == q_idx.dtype(),
                 "qsa_index_prologue: shapes or dtypes of k " + k_tok.describe() + " positions " +
                     positions.describe() + " slots " + slot_mapping.describe());
  expect_rope(params, inv_freq, width, "qsa_index_prologue");
  if (tokens == 0) return;
  PrologueArgs a{};
  a.q = q_idx.data();
  a.q_token_stride = q_idx.stride(0);
  a.q_head_stride = q_idx.stride(1);
  a.k = k_tok.data();
  a.k_row = k_tok.stride(0);
  a.weight = q_norm_weight.data();
  a.weight_type = weight_type_of(q_norm_weight, "qsa_index_prologue");
  a.positions = positions.data_as<const int32_t>();
  a.inv_freq = inv_freq.data_as<const float>();
  a.slots = slot_mapping.data_as<const int32_t>();
  a.cache = index_cache.data();
  a.cache_slots = index_cache.size(0) * index_cache.size(1);
  a.heads = static_cast<int>(heads);
  a.width = static_cast<int>(width);
  a.half = params.rope.rotary_dim / 2;
  a.eps = params.eps;
  a.scaling = params.rope.attention_scaling;
  const cudaStream_t stream = stream_of(q_idx);
  dispatch_activation(q_idx.dtype(), "qsa_index_prologue", [&](auto tag) {
    using T = decltype(tag);
    prologue_kernel<T><<<static_cast<unsigned>(tokens), 32 * kPrologueWarps, 0, stream>>>(a);
  });
  METRALE_CHECK_LAUNCH("qsa_index_prologue");
}

void qsa_block_keys(const Tensor& index_cache, const Tensor& k_norm_weight, const Tensor& inv_freq,
                    const Tensor& cu_q, const Tensor& kv_lens, const Tensor& block_tables, const Tensor& block_keys,
                    const QsaParams& params) {
  expect_gpu({&index_cache, &k_norm_weight, &inv_freq, &cu_q, &kv_lens, &block_tables, &block_keys}, "qsa_block_keys");
  expect_batch(cu_q, kv_lens, "qsa_block_keys");
  const int64_t c = params.compress_ratio;
  METRALE_EXPECT(index_cache.ndim() == 3 && index_cache.is_contiguous() && block_keys.ndim() == 3 &&
                     block_keys.is_contiguous() && c >= 1 && index_cache.size(1) % c == 0 &&
                     block_keys.size(0) == index_cache.size(0) && block_keys.size(1) == index_cache.size(1) / c &&
                     block_keys.size(2) == index_cache.size(2) && block_keys.dtype() == index_cache.dtype() &&
                     k_norm_weight.numel() == index_cache.size(2),
                 "qsa_block_keys: index_cache " + index_cache.describe() + " block_keys " + block_keys.describe() +
                     " c " + std::to_string(c));
  METRALE_EXPECT(block_tables.ndim() == 2 && block_tables.dtype() == DType::kI32 && block_tables.is_contiguous() &&
                     block_tables.size(0) >= kv_lens.numel(),
                 "qsa_block_keys: block_tables " + block_tables.describe());
  const int64_t width = index_cache.size(2);
  expect_rope(params, inv_freq, width, "qsa_block_keys");
  const int64_t num_seqs = kv_lens.numel();
  if (num_seqs == 0) return;
  BlockKeyArgs a{};
  a.cache = index_cache.data();
  a.keys = block_keys.data();
  a.weight = k_norm_weight.data();
  a.weight_type = weight_type_of(k_norm_weight, "qsa_block_keys");
  a.inv_freq = inv_freq.data_as<const float>();
  a.cu_q = cu_q.data_as<const int32_t>();
  a.kv_lens = kv_lens.data_as<const int32_t>();
  a.tables = block_tables.data_as<const int32_t>();
  if (!params.row_slots.empty()) {
    METRALE_EXPECT(params.row_slots.device().is_cuda() && params.row_slots.dtype() == DType::kI32 &&
                       params.row_slots.is_contiguous(),
                   "qsa_block_keys: row_slots " + params.row_slots.describe());
    a.row_slots = params.row_slots.data_as<const int32_t>();
  }
  a.table_stride = block_tables.size(1);
  a.num_blocks = static_cast<int>(index_cache.size(0));
  a.block_size = static_cast<int>(index_cache.size(1));
  a.c = static_cast<int>(c);
  a.width = static_cast<int>(width);
  a.half = params.rope.rotary_dim / 2;
  a.num_seqs = static_cast<int>(num_seqs);
  a.eps = params.eps;
  a.scaling = params.rope.attention_scaling;
  a.all_blocks = params.all_blocks;
  // Blocks one sequence may write: all complete ones, or those the step's rows complete.
  const int64_t kv_bound = params.max_kv_len > 0 ? params.max_kv_len : block_tables.size(1) * a.block_size;
  const int64_t q_bound = params.max_q_len > 0 ? params.max_q_len : kv_bound;
  const int64_t blocks = params.all_blocks ? kv_bound / c : std::min(kv_bound / c, q_bound / c + 1);
  const auto grid_y = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(
                                                                     (blocks + kBlockKeyWarps - 1) / kBlockKeyWarps, 1024)));
  const cudaStream_t stream = stream_of(block_keys);
  dispatch_activation(block_keys.dtype(), "qsa_block_keys", [&](auto tag) {
    using T = decltype(tag);
    block_keys_kernel<T><<<dim3(static_cast<unsigned>(num_seqs), grid_y), 32 * kBlockKeyWarps, 0, stream>>>(a);
  });
  METRALE_CHECK_LAUNCH("qsa_block_keys");
}

void qsa_scores(const Tensor& q_idx, const Tensor& block_keys, const Tensor& cu_q, const Tensor& kv_lens,
                const Tensor& block_tables, const Tensor& scores, const QsaParams& params) {
  expect_gpu({&q_idx, &block_keys, &cu_q, &kv_lens, &block_tables, &scores}, "qsa_scores");
  expect_batch(cu_q, kv_lens, "qsa_scores");
  const int64_t c = params.compress_ratio;
  METRALE_EXPECT(q_idx.ndim() == 3 && q_idx.stride(2) == 1 && block_keys.ndim() == 3 && block_keys.is_contiguous() &&
                     block_keys.size(2) == q_idx.size(2) && block_keys.dtype() == q_idx.dtype() && scores.ndim() == 2 &&
                     scores.dtype() == DType::kF32 && scores.stride(1) == 1 && scores.size(0) == q_idx.size(0) &&
                     c >= 1,
                 "qsa_scores: q " + q_idx.describe() + " block_keys " + block_keys.describe() + " scores " +
                     scores.describe());
  METRALE_EXPECT(block_tables.ndim() == 2 && block_tables.dtype() == DType::kI32 && block_tables.is_contiguous() &&
                     block_tables.size(0) >= kv_lens.numel(),
                 "qsa_scores: block_tables " + block_tables.describe());
  const int64_t tokens = q_idx.size(0), heads = q_idx.size(1), width = q_idx.size(2);
  if (width > kMaxWidth || width % 8 != 0) unsupported("qsa_scores: d_idx must be a multiple of 8 up to 256");
  if (heads > kMaxIndexHeads) unsupported("qsa_scores: at most 16 index heads");
  if (tokens == 0 || kv_lens.numel() == 0) return;
  const int64_t element = static_cast<int64_t>(q_idx.element_size());
  METRALE_EXPECT(reinterpret_cast<uintptr_t>(block_keys.data()) % (8 * element) == 0,
                 "qsa_scores: block_keys must be aligned to 8 elements");
  ScoreArgs a{};
  a.q = q_idx.data();
  a.q_token_stride = q_idx.stride(0);
  a.q_head_stride = q_idx.stride(1);
  a.keys = block_keys.data();
  a.scores = scores.data_as<float>();
  a.score_row = scores.stride(0);
  a.cu_q = cu_q.data_as<const int32_t>();
  a.kv_lens = kv_lens.data_as<const int32_t>();
  a.tables = block_tables.data_as<const int32_t>();
  a.table_stride = block_tables.size(1);
  a.num_blocks = static_cast<int>(block_keys.size(0));
  a.block_size = static_cast<int>(block_keys.size(1) * c);
  a.c = static_cast<int>(c);
  a.width = static_cast<int>(width);
  a.heads = static_cast<int>(heads);
  a.num_seqs = static_cast<int>(kv_lens.numel());
  a.tokens = tokens;
  a.inv_sqrt_width = static_cast<float>(1.0 / std::sqrt(static_cast<double>(width)));
  const dim3 grid(static_cast<unsigned>(tokens),
                  static_cast<unsigned>(std::max<int64_t>(1, (scores.size(1) + kBlocksPerScoreCta - 1) / kBlocksPerScoreCta)));
  const cudaStream_t stream = stream_of(scores);
  const int lanes = width <= 32 ? 4 : width <= 64 ? 8 : width <= 128 ? 16 : 32;
  dispatch_activation(q_idx.dtype(), "qsa_scores", [&](auto tag) {
    using T = decltype(tag);
    const auto launch_heads = [&](auto lanes_tag) {
      constexpr int kLanes = decltype(lanes_tag)::value;
      if (heads <= 4) {
        scores_kernel<T, kLanes, 4><<<grid, 32 * kScoreWarps, 0, stream>>>(a);
      } else if (heads <= 8) {
        scores_kernel<T, kLanes, 8><<<grid, 32 * kScoreWarps, 0, stream>>>(a);
      } else {
        scores_kernel<T, kLanes, 16><<<grid, 32 * kScoreWarps, 0, stream>>>(a);
      }
    };
    switch (lanes) {
      case 4: launch_heads(std::integral_constant<int, 4>{}); break;
      case 8: launch_heads(std::integral_constant<int, 8>{}); break;
      case 16: launch_heads(std::integral_constant<int, 16>{}); break;
      default: launch_heads(std::integral_constant<int, 32>{}); break;
    }
  });
  METRALE_CHECK_LAUNCH("qsa_scores");
}

void qsa_topk(const Tensor& scores, const Tensor& cu_q, const Tensor& kv_lens, const Tensor& selected,
              const QsaParams& params) {
  expect_gpu({&scores, &cu_q, &kv_lens, &selected}, "qsa_topk");
  expect_batch(cu_q, kv_lens, "qsa_topk");
  METRALE_EXPECT(scores.ndim() == 2 && scores.dtype() == DType::kF32 && scores.stride(1) == 1 && selected.ndim() == 2 &&
                     selected.dtype() == DType::kI32 && selected.stride(1) == 1 &&
                     selected.size(0) == scores.size(0) && selected.size(1) == params.block_topk &&
                     params.compress_ratio >= 1 && params.block_topk >= 1,
                 "qsa_topk: scores " + scores.describe() + " selected " + selected.describe());
  const int64_t tokens = scores.size(0);
  if (tokens == 0 || kv_lens.numel() == 0) return;
  TopkArgs a{};
  a.scores = scores.data_as<const float>();
  a.score_row = scores.stride(0);
  a.selected = selected.data_as<int32_t>();
  a.selected_row = selected.stride(0);
  a.cu_q = cu_q.data_as<const int32_t>();
  a.kv_lens = kv_lens.data_as<const int32_t>();
  a.num_seqs = static_cast<int>(kv_lens.numel());
  a.c = params.compress_ratio;
  a.k = params.block_topk;
  // Stage rows in shared memory when the widest row fits (8192 blocks = 32K context: 32 KB).
  const size_t staged_bytes = static_cast<size_t>(scores.size(1)) * sizeof(float);
  if (staged_bytes <= kMaxStagedBytes) {
    if (staged_bytes > 48u * 1024u) {
      METRALE_CUDA_CHECK(cudaFuncSetAttribute(topk_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(kMaxStagedBytes)));
    }
    topk_kernel<true><<<static_cast<unsigned>(tokens), kTopkThreads, staged_bytes, stream_of(selected)>>>(a);
  } else {
    topk_kernel<false><<<static_cast<unsigned>(tokens), kTopkThreads, 0, stream_of(selected)>>>(a);
  }
  METRALE_CHECK_LAUNCH("qsa_topk");
}

}  // namespace metrale::kernels::cuda
