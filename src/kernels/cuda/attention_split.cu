// CUDA split-KV ("flash-decoding") attention over the paged cache: tiles of 16 packed rows (one m16
// tensor-core fragment) of one (sequence, KV head), 4 warps that each take 16 keys of every 64-key
// K/V tile, a 3-stage cp.async pipeline, and optionally a split of the key range over several CTAs
// whose fp32 partial results (normalised output + log2-sum-exp) go to the workspace and are combined
// by the last CTA of the chunk to finish (a per-chunk arrival counter), or by a small merge kernel.
// Used for decode (q_len 1) and for short query blocks (speculative verify) where the tiles alone
// would not fill the GPU. attention.cu chooses between it and the prefill kernel.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>

#include "kernels/attention.h"
#include "kernels/cuda/attention_paged.cuh"
#include "kernels/cuda/pdl.cuh"

namespace metrale::kernels::cuda {
namespace paged_attn {
namespace {

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
      load_kv_tile<kHeadDim, kSplitKeysPerTile, true>(a.kv, table, kv_head, start, range_begin, range_end,
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

    float scores[2][4];
    attn::warp_scores_16keys<kHeadDim>(q_frag, k_tile, lane, scores);
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

    attn::warp_pv_16keys<kHeadDim>(scores, v_tile, lane, acc);
  }
  cp_async_wait<0>();
  __syncthreads();  // the stages are free: reuse them for the combine

  attn::stage_warp_state<kSplitRows, kDimTiles>(row_max, row_sum, acc, warp, lane, combine_max, combine_sum, combine_acc,
                                        Config::kCombineStride);
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

std::atomic<bool>& split_merge_in_kernel_setting() {
  static std::atomic<bool> in_kernel = [] {
    const char* text = std::getenv("METRALE_SPLIT_MERGE_KERNEL");
    return !(text != nullptr && std::string(text) == "1");
  }();
  return in_kernel;
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

}  // namespace

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

bool split_merge_in_kernel_enabled() { return split_merge_in_kernel_setting().load(std::memory_order_relaxed); }

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

}  // namespace paged_attn

bool split_merge_in_kernel() { return paged_attn::split_merge_in_kernel_enabled(); }

void set_split_merge_in_kernel(bool in_kernel) {
  paged_attn::split_merge_in_kernel_setting().store(in_kernel, std::memory_order_relaxed);
}

}  // namespace metrale::kernels::cuda
