// CUDA paged attention over a ragged batch (decode, prefill, chunked prefill, mixed steps) and the
// KV-cache write. The CPU twin in kernels/cpu/attention.cpp is the reference for the semantics.
//
// Both attention kernels work on "packed rows": the query rows of one sequence and one KV head are
// the q_len * G (token, head-of-the-group) pairs, packed as p = token * G + head_in_group, where
// G = n_heads / n_kv_heads. A CTA takes a tile of consecutive packed rows of one (sequence, KV head),
// so every K/V element it gathers from the paged cache serves all G query heads of the group.
//
//  * split-KV kernel ("flash-decoding", attention_split.cu): tiles of 16 packed rows, the key range
//    optionally split over several CTAs whose partials are merged. Used for decode (q_len 1) and for
//    short query blocks (speculative verify) where the tiles alone would not fill the GPU.
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
#include <climits>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/attention.h"
#include "kernels/cuda/attention_paged.cuh"

namespace metrale::kernels {
namespace cuda {
namespace {

using namespace paged_attn;  // NOLINT(google-build-using-namespace): the kernels' shared pieces

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
      load_kv_tile<kHeadDim, kKeys, false>(a.kv, table, kv_head, first_key + tile_index * kKeys, g.key_lo, g.key_end,
                                           k_stages + buffer, v_stages + buffer);
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
}  // namespace

void paged_attn::allow_dynamic_smem(const void* kernel, size_t bytes, int device) {
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

namespace {

bool aligned16(const void* pointer) {
  return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0;
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
        if (split_merge_in_kernel_enabled() &&
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
