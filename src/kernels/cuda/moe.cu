// CUDA MoE ops (see kernels/moe.h for the contracts):
//   moe_route            one warp per token: softmax in fp32 (sum in fp64, as the CPU) or sigmoid,
//                        the correction bias and the group limit on the choice scores, k rounds
//                        of warp argmax (ties to the lower id), optional renormalisation, scaling.
//   moe_sort             counting sort of slots by expert in three small launches: per-chunk
//                        histograms, one block that scans them, a stable scatter.
//   moe_decode_gate_up   per (slot, 8 intermediate rows) a 4-warp block; each warp streams 2 gate
//   moe_decode_down      and 2 up rows (or 4 down rows) of the slot's expert with 16-byte loads.
//   moe_grouped_gate_up  tensor-core grouped GEMMs over the expert-sorted rows (gemm_grouped.cuh).
//   moe_grouped_down
//   moe_combine          fp32 weighted sum over the k slots in order, plus the gated shared expert.
//   gather_rows, scatter_add_rows: row copies; the scatter runs one thread per column over the
//                        rows in order (deterministic, no atomics).
// FP8 experts (MoeExpertWeights::is_fp8) take the same paths: the decode kernels of
// moe_fp8_decode.cuh (e4m3 dequantised in registers), and the grouped GEMM with its B tiles
// dequantised to bf16 on the way into shared memory.
// f32 expert weights (f32 runs) take CUDA-core kernels on both paths, one warp per output element,
// fp32 throughout (correct, not fast).
#include <algorithm>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemm_gemv.cuh"
#include "kernels/cuda/gemm_grouped.cuh"
#include "kernels/cuda/moe_fp8_decode.cuh"
#include "kernels/moe.h"

namespace metrale::kernels::cuda {
namespace {

[[noreturn]] void fail(const std::string& message) { raise_message(ErrorCode::kInternal, message); }
void expect(bool condition, const char* op, const std::string& what) {
  if (!condition) fail(std::string(op) + ": " + what);
}

bool aligned_16(const void* pointer) { return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0; }

// A 2-D tensor whose rows can be read as 16-byte chunks: contiguous rows, 16-byte aligned base and row stride.
bool rows_vectorizable(const Tensor& t) {
  return t.ndim() == 2 && t.stride(1) == 1 && aligned_16(t.data()) &&
         (t.stride(0) * static_cast<int64_t>(t.element_size())) % 16 == 0;
}

std::string shape_of(const Tensor& t) { return t.describe(); }

// ---------------------------------------------------------------------------------------------
// moe_route

constexpr int kRouteWarps = 4;
constexpr int kRouteMaxExperts = 512;

struct RouteArgs {
  const void* logits;  // [T, E] f32 | bf16 | f16, rows strided
  int64_t logit_stride;
  int tokens, experts, top_k;
  bool normalize, sigmoid;
  const void* bias;  // [E] or null: added to the scores for the choice only
  WeightType bias_type;
  int n_group, topk_group;
  float scaling;
  int32_t* ids;
  float* weights;
};

// One warp per token. Lane l holds experts l, l + 32, ...: the score p (the weight) and the choice
// score c = p + bias; absent, group-masked or already chosen experts have c = -inf.
template <int kPerLane, typename LogitT>
__global__ void __launch_bounds__(kRouteWarps * 32) moe_route_kernel(RouteArgs a) {
  __shared__ float choice_s[kRouteWarps][kRouteMaxExperts];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int token = blockIdx.x * kRouteWarps + warp;
  if (token >= a.tokens) return;
  const LogitT* row = static_cast<const LogitT*>(a.logits) + static_cast<int64_t>(token) * a.logit_stride;
  float p[kPerLane], c[kPerLane];
  if (a.sigmoid) {
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      const int e = lane + 32 * q;
      p[q] = e < a.experts ? 1.0f / (1.0f + expf(-to_f32(row[e]))) : -INFINITY;
    }
  } else {
    float local_max = -INFINITY;
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      const int e = lane + 32 * q;
      p[q] = e < a.experts ? to_f32(row[e]) : -INFINITY;
      local_max = fmaxf(local_max, p[q]);
    }
    const float max_logit = warp_max(local_max);
    double local_sum = 0.0;  // fp64 sum, as the CPU
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      if (lane + 32 * q < a.experts) {
        p[q] = expf(p[q] - max_logit);
        local_sum += p[q];
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) local_sum += __shfl_xor_sync(0xffffffffu, local_sum, offset);
    const float inv = static_cast<float>(1.0 / local_sum);
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      if (lane + 32 * q < a.experts) p[q] *= inv;
    }
  }
#pragma unroll
  for (int q = 0; q < kPerLane; ++q) {
    const int e = lane + 32 * q;
    c[q] = e < a.experts ? (a.bias != nullptr ? p[q] + load_weight(a.bias, a.bias_type, e) : p[q]) : -INFINITY;
  }
  if (a.n_group > 1) {
    // Group g scores the sum of its two best choice scores; the topk_group best groups keep their experts.
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      if (lane + 32 * q < a.experts) choice_s[warp][lane + 32 * q] = c[q];
    }
    __syncwarp();
    const int per_group = a.experts / a.n_group;
    float group_score = -INFINITY;
    if (lane < a.n_group) {
      float best = -INFINITY, second = -INFINITY;
      for (int e = lane * per_group; e < (lane + 1) * per_group; ++e) {
        const float v = choice_s[warp][e];
        if (v > best) {
          second = best;
          best = v;
        } else if (v > second) {
          second = v;
        }
      }
      group_score = per_group >= 2 ? best + second : best;
    }
    uint32_t kept = 0;
    for (int j = 0; j < a.topk_group; ++j) {
      float best = lane < a.n_group && !((kept >> lane) & 1u) ? group_score : -INFINITY;
      int best_group = lane < a.n_group && !((kept >> lane) & 1u) ? lane : 0x7fffffff;
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_group = __shfl_xor_sync(0xffffffffu, best_group, offset);
        if (other > best || (other == best && other_group < best_group)) {
          best = other;
          best_group = other_group;
        }
      }
      if (best_group < a.n_group) kept |= 1u << best_group;
    }
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      const int e = lane + 32 * q;
      if (e < a.experts && !((kept >> (e / per_group)) & 1u)) c[q] = -INFINITY;
    }
  }
  int32_t* token_ids = a.ids + static_cast<int64_t>(token) * a.top_k;
  float* token_weights = a.weights + static_cast<int64_t>(token) * a.top_k;
  float selected_sum = 0.0f;
  for (int j = 0; j < a.top_k; ++j) {
    float best = -INFINITY, best_p = 0.0f;
    int best_expert = 0x7fffffff;
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      if (c[q] > best) {  // strict: within a lane, experts ascend with q, so ties keep the lower id
        best = c[q];
        best_p = p[q];
        best_expert = lane + 32 * q;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, offset);
      const float other_p = __shfl_xor_sync(0xffffffffu, best_p, offset);
      const int other_expert = __shfl_xor_sync(0xffffffffu, best_expert, offset);
      if (other > best || (other == best && other_expert < best_expert)) {
        best = other;
        best_p = other_p;
        best_expert = other_expert;
      }
    }
    if (best_expert >= a.experts) {
      // No finite score left (a NaN row: padding rows of graph layouts may read keys nobody
      // wrote): any valid expert with weight 0, so that the grouping downstream stays in bounds.
      best_expert = j;
      best_p = 0.0f;
    }
    if ((best_expert & 31) == lane) {
#pragma unroll
      for (int q = 0; q < kPerLane; ++q) {
        if (q == (best_expert >> 5)) c[q] = -INFINITY;
      }
    }
    if (lane == 0) {
      token_ids[j] = best_expert;
      token_weights[j] = best_p;
    }
    selected_sum += best_p;  // same order as the CPU: j ascending
  }
  if (a.sigmoid) selected_sum += 1e-20f;
  if (a.normalize || a.scaling != 1.0f) {
    __syncwarp();  // lane 0's stores above are visible to the warp after this
    for (int j = lane; j < a.top_k; j += 32) {
      const float w = a.normalize ? token_weights[j] / selected_sum : token_weights[j];
      token_weights[j] = a.scaling == 1.0f ? w : w * a.scaling;
    }
  }
}

template <typename LogitT>
void launch_route(const RouteArgs& args, cudaStream_t stream) {
  const int blocks = ceil_div(args.tokens, kRouteWarps);
  const auto launch = [&](auto per_lane) {
    constexpr int kPerLane = decltype(per_lane)::value;
    moe_route_kernel<kPerLane, LogitT><<<blocks, kRouteWarps * 32, 0, stream>>>(args);
  };
  if (args.experts <= 32) {
    launch(std::integral_constant<int, 1>{});
  } else if (args.experts <= 64) {
    launch(std::integral_constant<int, 2>{});
  } else if (args.experts <= 128) {
    launch(std::integral_constant<int, 4>{});
  } else if (args.experts <= 256) {
    launch(std::integral_constant<int, 8>{});
  } else {
    launch(std::integral_constant<int, 16>{});
  }
  METRALE_CHECK_LAUNCH("moe_route_kernel");
}

// ---------------------------------------------------------------------------------------------
// moe_sort

constexpr int kSortChunk = 256;  // slots per block; must match moe_sort_scratch_elements
constexpr int kMaxSortExperts = 1024;

// chunk_counts[c][e] = number of slots of chunk c routed to expert e.
__global__ void __launch_bounds__(kSortChunk)
    moe_sort_count_kernel(const int32_t* __restrict__ ids, int slots, int experts, int32_t* __restrict__ chunk_counts) {
  extern __shared__ int32_t histogram[];  // [experts]
  for (int e = threadIdx.x; e < experts; e += blockDim.x) histogram[e] = 0;
  __syncthreads();
  const int slot = blockIdx.x * kSortChunk + threadIdx.x;
  if (slot < slots) {
    const int e = ids[slot];
    if (static_cast<unsigned>(e) < static_cast<unsigned>(experts)) atomicAdd(&histogram[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    chunk_counts[static_cast<int64_t>(blockIdx.x) * experts + e] = histogram[e];
  }
}

// One block of kMaxSortExperts threads, thread e for expert e: offsets[e] = slots of experts
// before e; chunk_counts[c][e] becomes the first sorted position of chunk c's slots of expert e.
__global__ void __launch_bounds__(kMaxSortExperts)
    moe_sort_scan_kernel(int32_t* __restrict__ chunk_counts, int chunks, int experts, int32_t* __restrict__ offsets) {
  __shared__ int32_t warp_totals[32];
  const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
  // The loops over chunks are unrolled so that many independent loads are in flight (the counts
  // sit in L2; a serial walk would pay its latency once per chunk).
  int total = 0;
  if (e < experts) {
#pragma unroll 16
    for (int c = 0; c < chunks; ++c) total += chunk_counts[static_cast<int64_t>(c) * experts + e];
  }
  // Block-wide exclusive scan of the totals over e.
  int inclusive = total;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = warp_totals[lane];  // blockDim.x == 1024: all 32 warps wrote
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += v;
    }
    warp_totals[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int exclusive = inclusive - total + (warp > 0 ? warp_totals[warp - 1] : 0);
  if (e < experts) {
    offsets[e] = exclusive;
    int running = exclusive;
    constexpr int kBatch = 16;  // loads of a batch issue before its stores (they alias as far as the compiler knows)
    for (int c0 = 0; c0 < chunks; c0 += kBatch) {
      int counts[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        counts[i] = c0 + i < chunks ? chunk_counts[static_cast<int64_t>(c0 + i) * experts + e] : 0;
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (c0 + i < chunks) chunk_counts[static_cast<int64_t>(c0 + i) * experts + e] = running;
        running += counts[i];
      }
    }
    if (e == experts - 1) offsets[experts] = running;
  }
}

// Stable scatter: a slot's position is its chunk's base for its expert plus the number of earlier
// slots of the chunk routed to the same expert.
__global__ void __launch_bounds__(kSortChunk)
    moe_sort_place_kernel(const int32_t* __restrict__ ids, int slots, int experts,
                          const int32_t* __restrict__ chunk_bases, int32_t* __restrict__ sorted_slots) {
  __shared__ int32_t chunk_ids[kSortChunk];
  const int slot = blockIdx.x * kSortChunk + threadIdx.x;
  const int e = slot < slots ? ids[slot] : -1;
  chunk_ids[threadIdx.x] = e;
  __syncthreads();
  if (slot >= slots || static_cast<unsigned>(e) >= static_cast<unsigned>(experts)) return;
  int rank = 0;
  for (int j = 0; j < static_cast<int>(threadIdx.x); ++j) rank += chunk_ids[j] == e ? 1 : 0;
  sorted_slots[chunk_bases[static_cast<int64_t>(blockIdx.x) * experts + e] + rank] = slot;
}

// ---------------------------------------------------------------------------------------------
// Decode path

constexpr int kDecodeWarps = 4;
constexpr int kDecodeGateUpRows = 2;  // intermediate rows per warp (2 gate + 2 up weight rows)
constexpr int kDecodeDownRows = 4;    // down rows per warp
constexpr int kDecodeLoads = 4;       // 16-byte chunks per row in flight per lane

__device__ __forceinline__ int clamp_expert(int e, int experts) { return min(max(e, 0), experts - 1); }

// grid (ceil(I / (kDecodeWarps * kDecodeGateUpRows)), slots). h [slots, I] f32.
template <typename XT>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    moe_decode_gate_up_kernel(const XT* __restrict__ x, int64_t x_stride, const int32_t* __restrict__ ids, int top_k,
                              int experts, const __nv_bfloat16* __restrict__ gate_up, int inter, int hidden,
                              float limit, float* __restrict__ h) {
  constexpr int R = kDecodeGateUpRows;
  const int slot = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i0 = (blockIdx.x * kDecodeWarps + warp) * R;
  if (i0 >= inter) return;
  // Route ids are always in range; clamping only keeps a corrupted id from reading outside the weights.
  const int e = clamp_expert(ids[slot], experts);
  const __nv_bfloat16* expert = gate_up + static_cast<int64_t>(e) * 2 * inter * hidden;
  const __nv_bfloat16* w_rows[2 * R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = min(i0 + r, inter - 1);
    w_rows[r] = expert + static_cast<int64_t>(i) * hidden;              // gate row i
    w_rows[R + r] = expert + static_cast<int64_t>(inter + i) * hidden;  // up row i
  }
  const XT* x_rows[1] = {x + static_cast<int64_t>(slot / top_k) * x_stride};
  float acc[2 * R][1];
#pragma unroll
  for (int r = 0; r < 2 * R; ++r) acc[r][0] = 0.0f;
  gemv::warp_dot_partial<2 * R, 1, kDecodeLoads>(w_rows, x_rows, 1, hidden / gemv::kChunk, lane, acc);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float gate = warp_sum(acc[r][0]);
    float up = warp_sum(acc[R + r][0]);
    if (limit > 0.0f) {  // clamped SwiGLU
      gate = fminf(gate, limit);
      up = fminf(fmaxf(up, -limit), limit);
    }
    if (lane == r && i0 + r < inter) h[static_cast<int64_t>(slot) * inter + i0 + r] = gemv::silu(gate) * up;
  }
}

// grid (ceil(H / (kDecodeWarps * kDecodeDownRows)), slots). h [slots, I] f32; slot_out [slots, H] f32.
__global__ void __launch_bounds__(kDecodeWarps * 32)
    moe_decode_down_kernel(const float* __restrict__ h, const int32_t* __restrict__ ids, int experts,
                           const __nv_bfloat16* __restrict__ down, int hidden, int inter,
                           float* __restrict__ slot_out, int64_t out_stride) {
  constexpr int R = kDecodeDownRows;
  const int slot = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kDecodeWarps + warp) * R;
  if (row0 >= hidden) return;
  const int e = clamp_expert(ids[slot], experts);
  const __nv_bfloat16* expert = down + static_cast<int64_t>(e) * hidden * inter;
  const __nv_bfloat16* w_rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) w_rows[r] = expert + static_cast<int64_t>(min(row0 + r, hidden - 1)) * inter;
  const float* x_rows[1] = {h + static_cast<int64_t>(slot) * inter};
  float acc[R][1];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;
  gemv::warp_dot_partial<R, 1, kDecodeLoads>(w_rows, x_rows, 1, inter / gemv::kChunk, lane, acc);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float total = warp_sum(acc[r][0]);
    if (lane == r && row0 + r < hidden) slot_out[static_cast<int64_t>(slot) * out_stride + row0 + r] = total;
  }
}

// ---------------------------------------------------------------------------------------------
// f32 expert weights (f32 runs): one warp per output element on CUDA cores, for both paths.

// Which expert and slot a row of the expert ops belongs to. Decode path (sorted_slots null): row r
// is slot r, its expert ids[r]. Grouped path: row p is sorted position p, its slot sorted_slots[p],
// its expert the segment of expert_offsets [E + 1] that holds p.
struct ExpertRows {
  const int32_t* ids;             // [T * k] (decode)
  const int32_t* sorted_slots;    // [T * k] (grouped) or null
  const int32_t* expert_offsets;  // [E + 1] (grouped)
  int experts;
};

__device__ __forceinline__ int row_slot(const ExpertRows& rows, int64_t r) {
  return rows.sorted_slots != nullptr ? rows.sorted_slots[r] : static_cast<int>(r);
}

__device__ __forceinline__ int row_expert(const ExpertRows& rows, int64_t r) {
  if (rows.sorted_slots == nullptr) return clamp_expert(rows.ids[r], rows.experts);
  int lo = 0, hi = rows.experts - 1;  // the last e with offsets[e] <= r
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (rows.expert_offsets[mid] <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// h[r, i] = silu(x[t] . gate[e][i]) * (x[t] . up[e][i]) with t = slot / top_k; rows * inter warps.
template <typename XT, typename HT>
__global__ void expert_gate_up_simple_kernel(const XT* __restrict__ x, int64_t x_stride, ExpertRows rows, int top_k,
                                             const float* __restrict__ gate_up, int inter, int hidden, float limit,
                                             HT* __restrict__ h, int64_t h_stride, int64_t count) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t index = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; index < count;
       index += warps) {
    const int64_t r = index / inter;
    const int i = static_cast<int>(index % inter);
    const int e = row_expert(rows, r);
    const XT* x_row = x + static_cast<int64_t>(row_slot(rows, r) / top_k) * x_stride;
    const float* gate_row = gate_up + (static_cast<int64_t>(e) * 2 * inter + i) * hidden;
    const float* up_row = gate_row + static_cast<int64_t>(inter) * hidden;
    float gate = 0.0f, up = 0.0f;
    for (int c = lane; c < hidden; c += 32) {
      const float value = to_f32(x_row[c]);
      gate = fmaf(value, gate_row[c], gate);
      up = fmaf(value, up_row[c], up);
    }
    gate = warp_sum(gate);
    up = warp_sum(up);
    if (lane == 0) {
      if (limit > 0.0f) {  // clamped SwiGLU
        gate = fminf(gate, limit);
        up = fminf(fmaxf(up, -limit), limit);
      }
      h[r * h_stride + i] = from_f32<HT>(gemv::silu(gate) * up);
    }
  }
}

// slot_out[slot(r), c] = h[r] . down[e][c]; rows * hidden warps.
template <typename HT>
__global__ void expert_down_simple_kernel(const HT* __restrict__ h, int64_t h_stride, ExpertRows rows,
                                          const float* __restrict__ down, int hidden, int inter,
                                          float* __restrict__ slot_out, int64_t out_stride, int64_t count) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t index = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; index < count;
       index += warps) {
    const int64_t r = index / hidden;
    const int c = static_cast<int>(index % hidden);
    const float* down_row = down + (static_cast<int64_t>(row_expert(rows, r)) * hidden + c) * inter;
    const HT* h_row = h + r * h_stride;
    float sum = 0.0f;
    for (int i = lane; i < inter; i += 32) sum = fmaf(to_f32(h_row[i]), down_row[i], sum);
    sum = warp_sum(sum);
    if (lane == 0) slot_out[static_cast<int64_t>(row_slot(rows, r)) * out_stride + c] = sum;
  }
}

constexpr int kSimpleThreads = 256;

unsigned simple_blocks(int64_t warps) {
  return static_cast<unsigned>(std::min<int64_t>((warps + kSimpleThreads / 32 - 1) / (kSimpleThreads / 32), 132 * 64));
}

void launch_gate_up_simple(const Tensor& x, const ExpertRows& rows, int top_k, const MoeExpertWeights& experts,
                           const Tensor& h, int64_t num_rows, cudaStream_t stream) {
  const int64_t count = num_rows * experts.intermediate_size;
  if (count == 0) return;
  METRALE_DISPATCH_FLOAT(x.dtype(), "moe expert x", [&] {
    using XT = scalar_t;
    METRALE_DISPATCH_FLOAT(h.dtype(), "moe expert h", [&] {
      expert_gate_up_simple_kernel<XT, scalar_t><<<simple_blocks(count), kSimpleThreads, 0, stream>>>(
          x.data_as<const XT>(), x.stride(0), rows, top_k, experts.gate_up.data_as<const float>(),
          static_cast<int>(experts.intermediate_size), static_cast<int>(experts.hidden_size), experts.swiglu_limit,
          h.data_as<scalar_t>(), h.stride(0), count);
    });
  });
  METRALE_CHECK_LAUNCH("expert_gate_up_simple_kernel");
}

void launch_down_simple(const Tensor& h, const ExpertRows& rows, const MoeExpertWeights& experts,
                        const Tensor& slot_out, int64_t num_rows, cudaStream_t stream) {
  const int64_t count = num_rows * experts.hidden_size;
  if (count == 0) return;
  METRALE_DISPATCH_FLOAT(h.dtype(), "moe expert h", [&] {
    expert_down_simple_kernel<scalar_t><<<simple_blocks(count), kSimpleThreads, 0, stream>>>(
        h.data_as<const scalar_t>(), h.stride(0), rows, experts.down_fused.data_as<const float>(),
        static_cast<int>(experts.hidden_size), static_cast<int>(experts.intermediate_size), slot_out.data_as<float>(),
        slot_out.stride(0), count);
  });
  METRALE_CHECK_LAUNCH("expert_down_simple_kernel");
}

// ---------------------------------------------------------------------------------------------
// Combine

constexpr int kCombineThreads = 256;

// grid (T, ceil(H / kCombineThreads)); one thread per (token, column).
template <typename OutT>
__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const float* __restrict__ slot_out, int64_t slot_stride, const float* __restrict__ weights,
                       int top_k, const float* __restrict__ shared_out, int64_t shared_stride,
                       const float* __restrict__ shared_gate, int64_t gate_stride, OutT* __restrict__ out,
                       int64_t out_stride, int hidden, bool ungated) {
  const int t = blockIdx.x, c = blockIdx.y * kCombineThreads + threadIdx.x;
  if (c >= hidden) return;
  float acc = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    const int64_t slot = static_cast<int64_t>(t) * top_k + j;
    // No FMA contraction: the same two roundings per term as the CPU twin.
    acc = __fadd_rn(acc, __fmul_rn(weights[slot], slot_out[slot * slot_stride + c]));
  }
  if (ungated) {
    // The routed sum in OutT, then the shared expert added in OutT (DeepSeek-V3 MoE).
    const float shared = to_f32(from_f32<OutT>(shared_out[static_cast<int64_t>(t) * shared_stride + c]));
    acc = __fadd_rn(to_f32(from_f32<OutT>(acc)), shared);
  } else if (shared_out != nullptr) {
    const float gate = 1.0f / (1.0f + expf(-shared_gate[static_cast<int64_t>(t) * gate_stride]));
    acc = __fadd_rn(acc, __fmul_rn(gate, shared_out[static_cast<int64_t>(t) * shared_stride + c]));
  }
  out[static_cast<int64_t>(t) * out_stride + c] = from_f32<OutT>(acc);
}

// ---------------------------------------------------------------------------------------------
// gather_rows / scatter_add_rows

// grid (n); out[i] = src[index[i]] as `Word`s (16, 4 or 2 bytes). An index outside src gives a zero row.
template <typename Word>
__global__ void gather_rows_kernel(const char* __restrict__ src, int64_t src_stride_bytes, int64_t src_rows,
                                   const int32_t* __restrict__ index, char* __restrict__ out,
                                   int64_t out_stride_bytes, int64_t words) {
  const int64_t i = blockIdx.x;
  const int32_t row = index[i];
  const bool valid = row >= 0 && row < src_rows;
  const Word* from = reinterpret_cast<const Word*>(src + (valid ? row : 0) * src_stride_bytes);
  Word* to = reinterpret_cast<Word*>(out + i * out_stride_bytes);
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) to[w] = valid ? from[w] : Word{};
}

// grid (ceil(W / 256)); thread c adds rows in order of i (deterministic; duplicates in index are fine).
template <typename SrcT>
__global__ void scatter_add_rows_kernel(float* __restrict__ dst, int64_t dst_stride, int64_t dst_rows,
                                        const SrcT* __restrict__ src, int64_t src_stride,
                                        const int32_t* __restrict__ index, const float* __restrict__ weight, int64_t n,
                                        int64_t width) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= width) return;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t row = index[i];
    if (row < 0 || row >= dst_rows) continue;
    float* at = dst + row * dst_stride + c;
    *at = __fadd_rn(*at, __fmul_rn(weight[i], to_f32(src[i * src_stride + c])));
  }
}

// ---------------------------------------------------------------------------------------------
// Shared checks of the expert ops.

void check_fused(const MoeExpertWeights& experts, const char* op) {
  expect(experts.has_fused(), op, "the CUDA path needs the fused expert weights (gate_up, down_fused)");
  const int64_t e = experts.num_experts, h = experts.hidden_size, i = experts.intermediate_size;
  const Tensor& gate_up = experts.gate_up;
  const Tensor& down = experts.down_fused;
  const bool fp8 = experts.is_fp8();
  const DType dtype = fp8 ? DType::kF8E4M3 : gate_up.dtype() == DType::kF32 ? DType::kF32 : DType::kBF16;
  expect(gate_up.dtype() == dtype && down.dtype() == dtype && gate_up.is_contiguous() && down.is_contiguous() &&
             gate_up.ndim() == 3 && down.ndim() == 3 && gate_up.size(0) == e && gate_up.size(1) == 2 * i &&
             gate_up.size(2) == h && down.size(0) == e && down.size(1) == h && down.size(2) == i,
         op,
         "fused expert weights must be contiguous gate_up [E, 2I, H] and down [E, H, I], both bf16, both f32 or "
         "both f8e4m3; got " + std::string(dtype_name(gate_up.dtype())) + " " + shape_of(gate_up) + " and " +
             std::string(dtype_name(down.dtype())) + " " + shape_of(down));
  if (dtype == DType::kF32) {
    expect(e >= 1 && e * 2 * i * h < (int64_t{1} << 62) && h < (1 << 30) && i < (1 << 30), op, "expert sizes");
    return;  // the f32 kernels read any sizes and alignments
  }
  if (fp8) {
    const int64_t hb = fp8_scale_blocks(h), ib = fp8_scale_blocks(i);
    expect(experts.gate_up_scale.dtype() == DType::kF32 && experts.down_scale.dtype() == DType::kF32 &&
               experts.gate_up_scale.is_contiguous() && experts.down_scale.is_contiguous() &&
               experts.gate_up_scale.shape() == (Shape{e, 2 * ib, hb}) &&
               experts.down_scale.shape() == (Shape{e, hb, ib}),
           op,
           "FP8 expert scales must be contiguous f32 [E, 2 ceil(I/128), ceil(H/128)] and [E, ceil(H/128), "
           "ceil(I/128)]; got " +
               shape_of(experts.gate_up_scale) + " and " + shape_of(experts.down_scale));
  }
  const int64_t multiple = fp8 ? 16 : 8;
  if (h % multiple != 0 || i % multiple != 0) {
    raise_message(ErrorCode::kUnsupported, std::string(op) + ": the CUDA MoE kernels need hidden (" +
                                               std::to_string(h) + ") and expert intermediate (" + std::to_string(i) +
                                               ") sizes that are multiples of " + std::to_string(multiple) +
                                               (fp8 ? " with FP8 experts" : ""));
  }
  expect(aligned_16(gate_up.data()) && aligned_16(down.data()), op, "fused expert weights must be 16-byte aligned");
  expect(e >= 1 && e * 2 * i * h < (int64_t{1} << 62) && h < (1 << 30) && i < (1 << 30), op, "expert sizes");
}

template <grouped::Epilogue kEpilogue, bool kFp8B>
void launch_grouped_as(const grouped::Params& params, int64_t slots, int64_t experts, cudaStream_t stream) {
  const int64_t max_m_tiles = slots / grouped::kBlockM + std::min(experts, slots);
  const int64_t blocks = max_m_tiles * params.n_tiles;
  METRALE_EXPECT(blocks < (int64_t{1} << 31), "grouped GEMM grid too large");
  allow_dynamic_smem(reinterpret_cast<const void*>(grouped::grouped_gemm_kernel<kEpilogue, kFp8B>),
                     grouped::kSmemBytes);
  grouped::grouped_gemm_kernel<kEpilogue, kFp8B>
      <<<static_cast<unsigned>(blocks), grouped::kThreads, grouped::kSmemBytes, stream>>>(params);
  METRALE_CHECK_LAUNCH("grouped_gemm_kernel");
}

// B from bf16 weights, or from FP8 codes (params.b_codes set) dequantised on the way into shared memory.
template <grouped::Epilogue kEpilogue>
void launch_grouped(const grouped::Params& params, int64_t slots, int64_t experts, cudaStream_t stream) {
  if (params.b_codes != nullptr) {
    launch_grouped_as<kEpilogue, true>(params, slots, experts, stream);
  } else {
    launch_grouped_as<kEpilogue, false>(params, slots, experts, stream);
  }
}

void check_i32_vector(const Tensor& t, int64_t n, const char* op, const char* what) {
  expect(t.dtype() == DType::kI32 && t.numel() == n && t.is_contiguous(), op,
         std::string(what) + " must be contiguous i32 of " + std::to_string(n) + " elements; got " + shape_of(t));
}

}  // namespace

void moe_route(const Tensor& router_logits, const Tensor& topk_ids, const Tensor& topk_weights,
               const MoeRouteParams& params) {
  constexpr const char* op = "moe_route";
  expect(router_logits.ndim() == 2 && router_logits.stride(1) == 1, op, "router logits must be [T, E] with contiguous rows");
  const int64_t tokens = router_logits.size(0), experts = router_logits.size(1);
  const int k = params.top_k;
  expect(k >= 1 && k <= experts, op, "top_k " + std::to_string(k) + " of " + std::to_string(experts) + " experts");
  expect(experts <= kRouteMaxExperts, op, "at most 512 experts on CUDA, got " + std::to_string(experts));
  expect(params.n_group >= 1 && params.n_group <= 32 && experts % params.n_group == 0 && params.topk_group >= 1 &&
             params.topk_group <= params.n_group &&
             static_cast<int64_t>(params.topk_group) * (experts / params.n_group) >= k,
         op, "groups: " + std::to_string(params.n_group) + " (keep " + std::to_string(params.topk_group) + ") of " +
                 std::to_string(experts) + " experts for top_k " + std::to_string(k));
  expect(topk_ids.numel() == tokens * k && topk_weights.numel() == tokens * k && topk_ids.dtype() == DType::kI32 &&
             topk_weights.dtype() == DType::kF32 && topk_ids.is_contiguous() && topk_weights.is_contiguous(),
         op, "outputs must be contiguous i32 / f32 [T, k]");
  expect(tokens < (int64_t{1} << 31) / kRouteWarps, op, "too many tokens");
  RouteArgs args{};
  args.logits = router_logits.data();
  args.logit_stride = router_logits.stride(0);
  args.tokens = static_cast<int>(tokens);
  args.experts = static_cast<int>(experts);
  args.top_k = k;
  args.normalize = params.normalize;
  args.sigmoid = params.scoring == MoeScoring::kSigmoid;
  if (!params.correction_bias.empty()) {
    expect(params.correction_bias.device().is_cuda() && params.correction_bias.numel() == experts &&
               params.correction_bias.is_contiguous(),
           op, "correction_bias must be a contiguous [E] tensor on the GPU; got " + shape_of(params.correction_bias));
    args.bias = params.correction_bias.data();
    args.bias_type = weight_type_of(params.correction_bias, op);
  }
  args.n_group = params.n_group;
  args.topk_group = params.topk_group;
  args.scaling = params.routed_scaling_factor;
  args.ids = topk_ids.data_as<int32_t>();
  args.weights = topk_weights.data_as<float>();
  if (tokens == 0) return;
  switch (router_logits.dtype()) {
    case DType::kF32: return launch_route<float>(args, stream_of(topk_ids));
    case DType::kBF16: return launch_route<__nv_bfloat16>(args, stream_of(topk_ids));
    case DType::kF16: return launch_route<__half>(args, stream_of(topk_ids));
    default: fail("moe_route: router logits must be f32, bf16 or f16");
  }
}

void gather_rows(const Tensor& src, const Tensor& index, const Tensor& out) {
  constexpr const char* op = "gather_rows";
  const int64_t n = index.numel();
  expect(src.ndim() == 2 && out.ndim() == 2 && out.size(0) == n && out.size(1) == src.size(1) &&
             src.dtype() == out.dtype() && src.stride(1) == 1 && out.stride(1) == 1 && index.dtype() == DType::kI32 &&
             index.is_contiguous(),
         op, "src " + shape_of(src) + " index " + shape_of(index) + " out " + shape_of(out));
  if (n == 0 || src.size(1) == 0) return;
  const int64_t elem = static_cast<int64_t>(src.element_size());
  const int64_t row_bytes = src.size(1) * elem, src_stride = src.stride(0) * elem, out_stride = out.stride(0) * elem;
  const auto* from = static_cast<const char*>(src.data());
  auto* to = static_cast<char*>(out.data());
  const cudaStream_t stream = stream_of(out);
  const int threads = 128;
  const unsigned blocks = static_cast<unsigned>(n);
  if (row_bytes % 16 == 0 && src_stride % 16 == 0 && out_stride % 16 == 0 && aligned_16(from) && aligned_16(to)) {
    gather_rows_kernel<uint4><<<blocks, threads, 0, stream>>>(from, src_stride, src.size(0), index.data_as<const int32_t>(),
                                                             to, out_stride, row_bytes / 16);
  } else if (elem == 4) {
    gather_rows_kernel<uint32_t><<<blocks, threads, 0, stream>>>(from, src_stride, src.size(0),
                                                                 index.data_as<const int32_t>(), to, out_stride,
                                                                 row_bytes / 4);
  } else {
    expect(elem == 2, op, "element size");
    gather_rows_kernel<uint16_t><<<blocks, threads, 0, stream>>>(from, src_stride, src.size(0),
                                                                 index.data_as<const int32_t>(), to, out_stride,
                                                                 row_bytes / 2);
  }
  METRALE_CHECK_LAUNCH("gather_rows_kernel");
}

void scatter_add_rows(const Tensor& dst, const Tensor& src, const Tensor& index, const Tensor& weight) {
  constexpr const char* op = "scatter_add_rows";
  const int64_t n = index.numel();
  expect(dst.ndim() == 2 && src.ndim() == 2 && dst.dtype() == DType::kF32 && src.size(0) == n &&
             src.size(1) == dst.size(1) && weight.numel() == n && weight.dtype() == DType::kF32 &&
             index.dtype() == DType::kI32 && index.is_contiguous() && weight.is_contiguous() && dst.stride(1) == 1 &&
             src.stride(1) == 1,
         op, "dst " + shape_of(dst) + " src " + shape_of(src) + " index " + shape_of(index));
  const int64_t width = dst.size(1);
  if (n == 0 || width == 0) return;
  const unsigned blocks = static_cast<unsigned>(ceil_div(width, 256));
  METRALE_DISPATCH_FLOAT(src.dtype(), "scatter_add_rows", [&] {
    scatter_add_rows_kernel<scalar_t><<<blocks, 256, 0, stream_of(dst)>>>(
        dst.data_as<float>(), dst.stride(0), dst.size(0), src.data_as<const scalar_t>(), src.stride(0),
        index.data_as<const int32_t>(), weight.data_as<const float>(), n, width);
  });
  METRALE_CHECK_LAUNCH("scatter_add_rows_kernel");
}

void moe_sort(const Tensor& topk_ids, const Tensor& expert_offsets, const Tensor& sorted_slots, const Tensor& scratch) {
  constexpr const char* op = "moe_sort";
  const int64_t slots = topk_ids.numel(), experts = expert_offsets.numel() - 1;
  expect(topk_ids.dtype() == DType::kI32 && topk_ids.is_contiguous(), op, "topk_ids must be contiguous i32");
  expect(experts >= 1 && experts <= kMaxSortExperts, op, "1 to 1024 experts");
  check_i32_vector(expert_offsets, experts + 1, op, "expert_offsets");
  check_i32_vector(sorted_slots, slots, op, "sorted_slots");
  expect(scratch.dtype() == DType::kI32 && scratch.is_contiguous() &&
             scratch.numel() >= moe_sort_scratch_elements(slots, experts),
         op, "scratch too small: " + shape_of(scratch));
  expect(slots < (int64_t{1} << 30), op, "too many slots");
  const cudaStream_t stream = stream_of(sorted_slots);
  const int chunks = ceil_div(slots, kSortChunk);
  const int e = static_cast<int>(experts), s = static_cast<int>(slots);
  auto* counts = scratch.data_as<int32_t>();
  if (chunks > 0) {
    moe_sort_count_kernel<<<chunks, kSortChunk, static_cast<size_t>(experts) * sizeof(int32_t), stream>>>(
        topk_ids.data_as<const int32_t>(), s, e, counts);
    METRALE_CHECK_LAUNCH("moe_sort_count_kernel");
  }
  moe_sort_scan_kernel<<<1, kMaxSortExperts, 0, stream>>>(counts, chunks, e, expert_offsets.data_as<int32_t>());
  METRALE_CHECK_LAUNCH("moe_sort_scan_kernel");
  if (chunks > 0) {
    moe_sort_place_kernel<<<chunks, kSortChunk, 0, stream>>>(topk_ids.data_as<const int32_t>(), s, e, counts,
                                                            sorted_slots.data_as<int32_t>());
    METRALE_CHECK_LAUNCH("moe_sort_place_kernel");
  }
}

void moe_decode_gate_up(const Tensor& x, const Tensor& topk_ids, const MoeExpertWeights& experts, const Tensor& h) {
  constexpr const char* op = "moe_decode_gate_up";
  check_fused(experts, op);
  const int64_t tokens = x.size(0), hidden = experts.hidden_size, inter = experts.intermediate_size;
  expect(x.ndim() == 2 && x.size(1) == hidden && topk_ids.ndim() == 2 && topk_ids.size(0) == tokens &&
             topk_ids.dtype() == DType::kI32 && topk_ids.is_contiguous(),
         op, "x " + shape_of(x) + " topk_ids " + shape_of(topk_ids));
  const int64_t k = topk_ids.size(1), slots = tokens * k;
  expect(h.dtype() == DType::kF32 && h.ndim() == 2 && h.size(0) == slots && h.size(1) == inter && h.is_contiguous(), op,
         "h must be contiguous f32 [T * k, I]; got " + shape_of(h));
  expect(slots <= 65535, op, "too many slots for the decode path");
  if (experts.gate_up.dtype() == DType::kF32) {
    expect(x.stride(1) == 1, op, "x rows must be contiguous; got " + shape_of(x));
    const ExpertRows rows{topk_ids.data_as<const int32_t>(), nullptr, nullptr, static_cast<int>(experts.num_experts)};
    launch_gate_up_simple(x, rows, static_cast<int>(k), experts, h, slots, stream_of(h));
    return;
  }
  expect((x.dtype() == DType::kBF16 || x.dtype() == DType::kF32) && rows_vectorizable(x), op,
         "x must be bf16 or f32 with 16-byte aligned rows; got " + shape_of(x));
  if (slots == 0) return;
  const int e = static_cast<int>(experts.num_experts), i = static_cast<int>(inter), hd = static_cast<int>(hidden);
  if (experts.is_fp8()) {
    const dim3 fp8_grid(static_cast<unsigned>(ceil_div(inter, moe_fp8::kWarps * moe_fp8::kGateUpRows)),
                        static_cast<unsigned>(slots));
    const auto* codes = static_cast<const uint8_t*>(experts.gate_up.data());
    const float* scales = experts.gate_up_scale.data_as<const float>();
    if (x.dtype() == DType::kBF16) {
      moe_fp8::gate_up_kernel<__nv_bfloat16><<<fp8_grid, moe_fp8::kWarps * 32, 0, stream_of(h)>>>(
          x.data_as<const __nv_bfloat16>(), x.stride(0), topk_ids.data_as<const int32_t>(), static_cast<int>(k), e,
          codes, scales, i, hd, experts.swiglu_limit, h.data_as<float>());
    } else {
      moe_fp8::gate_up_kernel<float><<<fp8_grid, moe_fp8::kWarps * 32, 0, stream_of(h)>>>(
          x.data_as<const float>(), x.stride(0), topk_ids.data_as<const int32_t>(), static_cast<int>(k), e, codes,
          scales, i, hd, experts.swiglu_limit, h.data_as<float>());
    }
    METRALE_CHECK_LAUNCH("moe_fp8::gate_up_kernel");
    return;
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(inter, kDecodeWarps * kDecodeGateUpRows)), static_cast<unsigned>(slots));
  const auto* weights = experts.gate_up.data_as<const __nv_bfloat16>();
  if (x.dtype() == DType::kBF16) {
    moe_decode_gate_up_kernel<__nv_bfloat16><<<grid, kDecodeWarps * 32, 0, stream_of(h)>>>(
        x.data_as<const __nv_bfloat16>(), x.stride(0), topk_ids.data_as<const int32_t>(), static_cast<int>(k), e,
        weights, i, hd, experts.swiglu_limit, h.data_as<float>());
  } else {
    moe_decode_gate_up_kernel<float><<<grid, kDecodeWarps * 32, 0, stream_of(h)>>>(
        x.data_as<const float>(), x.stride(0), topk_ids.data_as<const int32_t>(), static_cast<int>(k), e, weights, i,
        hd, experts.swiglu_limit, h.data_as<float>());
  }
  METRALE_CHECK_LAUNCH("moe_decode_gate_up_kernel");
}

void moe_decode_down(const Tensor& h, const Tensor& topk_ids, const MoeExpertWeights& experts, const Tensor& slot_out) {
  constexpr const char* op = "moe_decode_down";
  check_fused(experts, op);
  const int64_t slots = topk_ids.numel(), hidden = experts.hidden_size, inter = experts.intermediate_size;
  expect(topk_ids.dtype() == DType::kI32 && topk_ids.is_contiguous(), op, "topk_ids must be contiguous i32");
  expect(h.dtype() == DType::kF32 && h.ndim() == 2 && h.size(0) == slots && h.size(1) == inter && h.is_contiguous() &&
             aligned_16(h.data()),
         op, "h must be contiguous f32 [T * k, I]; got " + shape_of(h));
  expect(slot_out.dtype() == DType::kF32 && slot_out.ndim() == 2 && slot_out.size(0) == slots &&
             slot_out.size(1) == hidden && slot_out.stride(1) == 1,
         op, "slot_out must be f32 [T * k, H]; got " + shape_of(slot_out));
  expect(slots <= 65535, op, "too many slots for the decode path");
  if (slots == 0) return;
  if (experts.down_fused.dtype() == DType::kF32) {
    const ExpertRows rows{topk_ids.data_as<const int32_t>(), nullptr, nullptr, static_cast<int>(experts.num_experts)};
    launch_down_simple(h, rows, experts, slot_out, slots, stream_of(slot_out));
    return;
  }
  if (experts.is_fp8()) {
    const dim3 fp8_grid(static_cast<unsigned>(ceil_div(hidden, moe_fp8::kWarps * moe_fp8::kDownRows)),
                        static_cast<unsigned>(slots));
    moe_fp8::down_kernel<<<fp8_grid, moe_fp8::kWarps * 32, 0, stream_of(slot_out)>>>(
        h.data_as<const float>(), topk_ids.data_as<const int32_t>(), static_cast<int>(experts.num_experts),
        static_cast<const uint8_t*>(experts.down_fused.data()), experts.down_scale.data_as<const float>(),
        static_cast<int>(hidden), static_cast<int>(inter), slot_out.data_as<float>(), slot_out.stride(0));
    METRALE_CHECK_LAUNCH("moe_fp8::down_kernel");
    return;
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(hidden, kDecodeWarps * kDecodeDownRows)), static_cast<unsigned>(slots));
  moe_decode_down_kernel<<<grid, kDecodeWarps * 32, 0, stream_of(slot_out)>>>(
      h.data_as<const float>(), topk_ids.data_as<const int32_t>(), static_cast<int>(experts.num_experts),
      experts.down_fused.data_as<const __nv_bfloat16>(), static_cast<int>(hidden), static_cast<int>(inter),
      slot_out.data_as<float>(), slot_out.stride(0));
  METRALE_CHECK_LAUNCH("moe_decode_down_kernel");
}

void moe_grouped_gate_up(const Tensor& x, const Tensor& sorted_slots, const Tensor& expert_offsets, int top_k,
                         const MoeExpertWeights& experts, const Tensor& h) {
  constexpr const char* op = "moe_grouped_gate_up";
  check_fused(experts, op);
  const int64_t slots = sorted_slots.numel(), hidden = experts.hidden_size, inter = experts.intermediate_size;
  check_i32_vector(sorted_slots, slots, op, "sorted_slots");
  check_i32_vector(expert_offsets, experts.num_experts + 1, op, "expert_offsets");
  if (experts.gate_up.dtype() == DType::kF32) {
    expect(top_k >= 1 && x.ndim() == 2 && x.size(0) * top_k == slots && x.size(1) == hidden && x.stride(1) == 1 &&
               h.ndim() == 2 && h.size(0) == slots && h.size(1) == inter && h.stride(1) == 1,
           op,
           "x [T, H] with T * top_k = slots and h [T * k, I], rows contiguous; got x " + shape_of(x) + " h " +
               shape_of(h));
    const ExpertRows rows{nullptr, sorted_slots.data_as<const int32_t>(), expert_offsets.data_as<const int32_t>(),
                          static_cast<int>(experts.num_experts)};
    launch_gate_up_simple(x, rows, top_k, experts, h, slots, stream_of(h));
    return;
  }
  expect(top_k >= 1 && x.ndim() == 2 && x.size(0) * top_k == slots && x.size(1) == hidden &&
             x.dtype() == DType::kBF16 && rows_vectorizable(x),
         op, "x must be bf16 [T, H] with 16-byte aligned rows and T * top_k = slots; got " + shape_of(x));
  expect(h.dtype() == DType::kBF16 && h.ndim() == 2 && h.size(0) == slots && h.size(1) == inter && h.stride(1) == 1 &&
             rows_vectorizable(h),
         op, "h must be bf16 [T * k, I] with 16-byte aligned rows; got " + shape_of(h));
  if (slots == 0) return;
  grouped::Params params{};
  params.a = x.data_as<const __nv_bfloat16>();
  params.a_stride = x.stride(0);
  params.sorted_slots = sorted_slots.data_as<const int32_t>();
  params.expert_offsets = expert_offsets.data_as<const int32_t>();
  params.num_experts = static_cast<int>(experts.num_experts);
  params.top_k = top_k;
  params.b_expert_stride = 2 * inter * hidden;
  if (experts.is_fp8()) {
    params.b_codes = static_cast<const uint8_t*>(experts.gate_up.data());
    params.b_scales = experts.gate_up_scale.data_as<const float>();
    params.b_scale_expert_stride = experts.gate_up_scale.size(1) * experts.gate_up_scale.size(2);
    params.b_up_scale_row0 = static_cast<int>(fp8_scale_blocks(inter));
  } else {
    params.b = experts.gate_up.data_as<const __nv_bfloat16>();
  }
  params.n = static_cast<int>(inter);
  params.k = static_cast<int>(hidden);
  params.out = h.data();
  params.out_stride = h.stride(0);
  params.n_tiles = ceil_div(inter, grouped::kBlockN / 2);
  params.swiglu_limit = experts.swiglu_limit;
  launch_grouped<grouped::Epilogue::kSwiGlu>(params, slots, experts.num_experts, stream_of(h));
}

void moe_grouped_down(const Tensor& h, const Tensor& sorted_slots, const Tensor& expert_offsets,
                      const MoeExpertWeights& experts, const Tensor& slot_out) {
  constexpr const char* op = "moe_grouped_down";
  check_fused(experts, op);
  const int64_t slots = sorted_slots.numel(), hidden = experts.hidden_size, inter = experts.intermediate_size;
  check_i32_vector(sorted_slots, slots, op, "sorted_slots");
  check_i32_vector(expert_offsets, experts.num_experts + 1, op, "expert_offsets");
  if (experts.down_fused.dtype() == DType::kF32) {
    expect(h.ndim() == 2 && h.size(0) == slots && h.size(1) == inter && h.stride(1) == 1 &&
               slot_out.dtype() == DType::kF32 && slot_out.ndim() == 2 && slot_out.size(0) == slots &&
               slot_out.size(1) == hidden && slot_out.stride(1) == 1,
           op,
           "h [T * k, I] and slot_out f32 [T * k, H], rows contiguous; got h " + shape_of(h) + " slot_out " +
               shape_of(slot_out));
    const ExpertRows rows{nullptr, sorted_slots.data_as<const int32_t>(), expert_offsets.data_as<const int32_t>(),
                          static_cast<int>(experts.num_experts)};
    launch_down_simple(h, rows, experts, slot_out, slots, stream_of(slot_out));
    return;
  }
  expect(h.dtype() == DType::kBF16 && h.ndim() == 2 && h.size(0) == slots && h.size(1) == inter && rows_vectorizable(h),
         op, "h must be bf16 [T * k, I] with 16-byte aligned rows; got " + shape_of(h));
  expect(slot_out.dtype() == DType::kF32 && slot_out.ndim() == 2 && slot_out.size(0) == slots &&
             slot_out.size(1) == hidden && slot_out.stride(1) == 1 && slot_out.stride(0) % 2 == 0 &&
             (reinterpret_cast<uintptr_t>(slot_out.data()) & 7u) == 0,
         op, "slot_out must be f32 [T * k, H] with 8-byte aligned rows; got " + shape_of(slot_out));
  if (slots == 0) return;
  grouped::Params params{};
  params.a = h.data_as<const __nv_bfloat16>();
  params.a_stride = h.stride(0);
  params.sorted_slots = sorted_slots.data_as<const int32_t>();
  params.expert_offsets = expert_offsets.data_as<const int32_t>();
  params.num_experts = static_cast<int>(experts.num_experts);
  params.top_k = 1;
  params.b_expert_stride = hidden * inter;
  if (experts.is_fp8()) {
    params.b_codes = static_cast<const uint8_t*>(experts.down_fused.data());
    params.b_scales = experts.down_scale.data_as<const float>();
    params.b_scale_expert_stride = experts.down_scale.size(1) * experts.down_scale.size(2);
  } else {
    params.b = experts.down_fused.data_as<const __nv_bfloat16>();
  }
  params.n = static_cast<int>(hidden);
  params.k = static_cast<int>(inter);
  params.out = slot_out.data();
  params.out_stride = slot_out.stride(0);
  params.n_tiles = ceil_div(hidden, grouped::kBlockN);
  launch_grouped<grouped::Epilogue::kScatterF32>(params, slots, experts.num_experts, stream_of(slot_out));
}

void moe_combine(const Tensor& slot_out, const Tensor& topk_weights, const Tensor& shared_out,
                 const Tensor& shared_gate_logits, const Tensor& out) {
  constexpr const char* op = "moe_combine";
  expect(out.ndim() == 2 && out.stride(1) == 1 && topk_weights.ndim() == 2, op, "out must be [T, H] with contiguous rows");
  const int64_t tokens = out.size(0), hidden = out.size(1), k = topk_weights.size(1);
  expect(slot_out.dtype() == DType::kF32 && slot_out.ndim() == 2 && slot_out.size(0) == tokens * k &&
             slot_out.size(1) == hidden && slot_out.stride(1) == 1 && topk_weights.dtype() == DType::kF32 &&
             topk_weights.size(0) == tokens && topk_weights.is_contiguous(),
         op, "slot_out " + shape_of(slot_out) + " weights " + shape_of(topk_weights) + " out " + shape_of(out));
  const bool shared = !shared_out.empty(), gated = shared && !shared_gate_logits.empty();
  if (shared) {
    expect(shared_out.dtype() == DType::kF32 && shared_out.ndim() == 2 && shared_out.size(0) == tokens &&
               shared_out.size(1) == hidden && shared_out.stride(1) == 1,
           op, "shared " + shape_of(shared_out));
  }
  if (gated) {
    expect(shared_gate_logits.dtype() == DType::kF32 && shared_gate_logits.numel() == tokens, op,
           "gate " + shape_of(shared_gate_logits));
  }
  if (tokens == 0 || hidden == 0) return;
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(ceil_div(hidden, kCombineThreads)));
  const float* shared_ptr = shared ? shared_out.data_as<const float>() : nullptr;
  const float* gate_ptr = gated ? shared_gate_logits.data_as<const float>() : nullptr;
  const int64_t shared_stride = shared ? shared_out.stride(0) : 0, gate_stride = gated ? shared_gate_logits.stride(0) : 0;
  METRALE_DISPATCH_FLOAT(out.dtype(), op, [&] {
    moe_combine_kernel<scalar_t><<<grid, kCombineThreads, 0, stream_of(out)>>>(
        slot_out.data_as<const float>(), slot_out.stride(0), topk_weights.data_as<const float>(), static_cast<int>(k),
        shared_ptr, shared_stride, gate_ptr, gate_stride, out.data_as<scalar_t>(), out.stride(0),
        static_cast<int>(hidden), shared && !gated);
  });
  METRALE_CHECK_LAUNCH("moe_combine_kernel");
}

}  // namespace metrale::kernels::cuda
