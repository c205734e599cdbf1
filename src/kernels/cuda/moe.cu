// CUDA MoE ops (see kernels/moe.h for the contracts):
//   moe_route            one warp per token: softmax in fp32 (sum in fp64, as the CPU) or sigmoid,
//                        the correction bias and the group limit on the choice scores, k rounds
//                        of warp argmax (ties to the lower id), optional renormalisation, scaling.
//   moe_sort             counting sort of slots by expert in three small launches: per-chunk
//                        histograms, one block that scans them, a stable scatter.
//   (the decode path, moe_decode_gate_up / moe_decode_down / moe_decode_down_combine: moe_decode.cu)
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
#include "kernels/cuda/moe_experts_common.cuh"
#include "kernels/moe.h"

namespace metrale::kernels::cuda {
namespace {

using moe_common::aligned_16;
using moe_common::check_fused;
using moe_common::expect;
using moe_common::ExpertRows;
using moe_common::fail;
using moe_common::launch_down_simple;
using moe_common::launch_gate_up_simple;
using moe_common::rows_vectorizable;
using moe_common::shape_of;

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
  const bool has_shared = shared_out != nullptr;
  const float shared = has_shared ? shared_out[static_cast<int64_t>(t) * shared_stride + c] : 0.0f;
  const float* gate_logit = has_shared && !ungated ? shared_gate + static_cast<int64_t>(t) * gate_stride : nullptr;
  out[static_cast<int64_t>(t) * out_stride + c] =
      moe_common::combine_with_shared<OutT>(acc, has_shared, shared, gate_logit);
}

// ---------------------------------------------------------------------------------------------
// gather_rows / scatter_add_rows

// grid (n); out[i] = src[index[i]] as `Word`s (16, 4 or 2 bytes). An index outside src gives a zero row.
template <typename Word>
__global__ void gather_rows_kernel(const char* __restrict__ src, int64_t src_stride_bytes, int64_t src_rows,
                                   const int32_t* __restrict__ index, char* __restrict__ out, int64_t out_stride_bytes,
                                   int64_t words) {
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
  expect(router_logits.ndim() == 2 && router_logits.stride(1) == 1, op,
         "router logits must be [T, E] with contiguous rows");
  const int64_t tokens = router_logits.size(0), experts = router_logits.size(1);
  const int k = params.top_k;
  expect(k >= 1 && k <= experts, op, "top_k " + std::to_string(k) + " of " + std::to_string(experts) + " experts");
  expect(experts <= kRouteMaxExperts, op, "at most 512 experts on CUDA, got " + std::to_string(experts));
  expect(params.n_group >= 1 && params.n_group <= 32 && experts % params.n_group == 0 && params.topk_group >= 1 &&
             params.topk_group <= params.n_group &&
             static_cast<int64_t>(params.topk_group) * (experts / params.n_group) >= k,
         op,
         "groups: " + std::to_string(params.n_group) + " (keep " + std::to_string(params.topk_group) + ") of " +
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
    case DType::kF32:
      return launch_route<float>(args, stream_of(topk_ids));
    case DType::kBF16:
      return launch_route<__nv_bfloat16>(args, stream_of(topk_ids));
    case DType::kF16:
      return launch_route<__half>(args, stream_of(topk_ids));
    default:
      fail("moe_route: router logits must be f32, bf16 or f16");
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
    gather_rows_kernel<uint4><<<blocks, threads, 0, stream>>>(
        from, src_stride, src.size(0), index.data_as<const int32_t>(), to, out_stride, row_bytes / 16);
  } else if (elem == 4) {
    gather_rows_kernel<uint32_t><<<blocks, threads, 0, stream>>>(
        from, src_stride, src.size(0), index.data_as<const int32_t>(), to, out_stride, row_bytes / 4);
  } else {
    expect(elem == 2, op, "element size");
    gather_rows_kernel<uint16_t><<<blocks, threads, 0, stream>>>(
        from, src_stride, src.size(0), index.data_as<const int32_t>(), to, out_stride, row_bytes / 2);
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
  expect(out.ndim() == 2 && out.stride(1) == 1 && topk_weights.ndim() == 2, op,
         "out must be [T, H] with contiguous rows");
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
  const int64_t shared_stride = shared ? shared_out.stride(0) : 0,
                gate_stride = gated ? shared_gate_logits.stride(0) : 0;
  METRALE_DISPATCH_FLOAT(out.dtype(), op, [&] {
    moe_combine_kernel<scalar_t><<<grid, kCombineThreads, 0, stream_of(out)>>>(
        slot_out.data_as<const float>(), slot_out.stride(0), topk_weights.data_as<const float>(), static_cast<int>(k),
        shared_ptr, shared_stride, gate_ptr, gate_stride, out.data_as<scalar_t>(), out.stride(0),
        static_cast<int>(hidden), shared && !gated);
  });
  METRALE_CHECK_LAUNCH("moe_combine_kernel");
}

}  // namespace metrale::kernels::cuda
