// The MoE decode path over FP8 experts (kernels/moe.h: moe_decode_gate_up, moe_decode_down and
// moe_decode_down_combine with MoeExpertWeights::is_fp8): e4m3 codes [E, 2I, H] / [E, H, I] with fp32 128x128 block
// scales, dequantised in registers. Per (slot, rows) a 4-warp block; each warp streams its weight rows of the slot's
// expert through fp8_gemv::warp_dot_partial (16 codes a lane per load, every row's loads of a step in flight together,
// each chunk's block scale applied once) and dots them with the slot's input in fp32. Needs H % 16 == 0, I % 16 == 0
// and 16-byte aligned input rows.
#pragma once

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_gemv.cuh"
#include "kernels/cuda/moe_experts_common.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/linear_fp8.h"

namespace metrale::kernels::cuda::moe_fp8 {

constexpr int kWarps = 4;
constexpr int kGateUpRows = 2;   // intermediate rows per warp (2 gate + 2 up weight rows)
constexpr int kGateUpLoads = 4;  // chunks per row in flight per lane (H = 2048: all of a lane's)
constexpr int kDownRows = 8;     // down rows per warp (I = 512 is one chunk a lane: depth comes from rows)
constexpr int kDownLoads = 1;

__device__ __forceinline__ float silu(float g) {
  return g / (1.0f + expf(-g));
}

// grid (ceil(I / (kWarps * kGateUpRows)), T * k (+ T)). h [T * k (+ T), I] f32: slots s < routed_slots
// read expert ids[s] (after the producer's wait: the router wrote them), the T slots after them the
// shared expert (whose weight loads issue before the wait). Launched through pdl::launch.
template <typename XT>
__global__ void __launch_bounds__(kWarps * 32)
    gate_up_kernel(const XT* x, int64_t x_stride, const int32_t* ids, int top_k, int routed_slots,
                   moe_common::DecodeWeights<uint8_t> w, float limit, float* h) {
  constexpr int R = kGateUpRows;
  const int slot = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i0 = (blockIdx.x * kWarps + warp) * R;
  const int inter = w.inter, hidden = w.hidden;
  if (i0 >= inter) return;
  const bool routed = slot < routed_slots;
  if (routed) pdl::wait_for_producer();
  // Route ids are always in range; clamping only keeps a corrupted id from reading outside the weights.
  const int e = routed ? moe_common::clamp_expert(ids[slot], w.experts) : -1;
  const moe_common::ExpertBases<uint8_t> bases = moe_common::expert_bases(w, e);
  const int hidden_blocks = (hidden + kFp8Block - 1) / kFp8Block;
  const uint8_t* rows[2 * R];
  const float* scales[2 * R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = min(i0 + r, inter - 1);
    rows[r] = bases.gate + static_cast<int64_t>(i) * hidden;
    rows[R + r] = bases.up + static_cast<int64_t>(i) * hidden;
    scales[r] = bases.gate_scale + static_cast<int64_t>(i / kFp8Block) * hidden_blocks;
    scales[R + r] = bases.up_scale + static_cast<int64_t>(i / kFp8Block) * hidden_blocks;
  }
  float acc[2 * R][1] = {};
  const int64_t token = routed ? slot / top_k : slot - routed_slots;
  const XT* const x_rows[1] = {x + token * x_stride};
  fp8_gemv::warp_dot_partial<2 * R, 1, kGateUpLoads>(rows, scales, x_rows, 1, hidden / fp8_gemv::kChunk, lane, acc,
                                                     moe_common::WaitUnlessWaited{routed});
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float gate = warp_sum(acc[r][0]);
    float up = warp_sum(acc[R + r][0]);
    if (limit > 0.0f) {  // clamped SwiGLU
      gate = fminf(gate, limit);
      up = fminf(fmaxf(up, -limit), limit);
    }
    if (lane == r && i0 + r < inter) h[static_cast<int64_t>(slot) * inter + i0 + r] = silu(gate) * up;
  }
}

// grid (ceil(H / (kWarps * kDownRows)), slots). h [slots, I] f32; slot_out [slots, H] f32;
// down_scale [E, ceil(H/128), ceil(I/128)].
__global__ void __launch_bounds__(kWarps * 32)
    down_kernel(const float* __restrict__ h, const int32_t* __restrict__ ids, int experts,
                const uint8_t* __restrict__ down, const float* __restrict__ down_scale, int hidden, int inter,
                float* __restrict__ slot_out, int64_t out_stride) {
  constexpr int R = kDownRows;
  const int slot = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + warp) * R;
  if (row0 >= hidden) return;
  const int e = min(max(ids[slot], 0), experts - 1);
  const int hidden_blocks = (hidden + kFp8Block - 1) / kFp8Block, inter_blocks = (inter + kFp8Block - 1) / kFp8Block;
  const uint8_t* expert = down + static_cast<int64_t>(e) * hidden * inter;
  const float* expert_scales = down_scale + static_cast<int64_t>(e) * hidden_blocks * inter_blocks;
  const uint8_t* rows[R];
  const float* scales[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = min(row0 + r, hidden - 1);
    rows[r] = expert + static_cast<int64_t>(row) * inter;
    scales[r] = expert_scales + static_cast<int64_t>(row / kFp8Block) * inter_blocks;
  }
  float acc[R][1] = {};
  const float* const h_rows[1] = {h + static_cast<int64_t>(slot) * inter};
  fp8_gemv::warp_dot_partial<R, 1, kDownLoads>(rows, scales, h_rows, 1, inter / fp8_gemv::kChunk, lane, acc);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float total = warp_sum(acc[r][0]);
    if (lane == r && row0 + r < hidden) slot_out[static_cast<int64_t>(slot) * out_stride + row0 + r] = total;
  }
}

// grid (ceil(H / kCombineRows), T), block (k (+ 1)) warps: warp j < k computes rows [c0, c0 + 8) of
// token t's slot j (its expert's down rows dotted with h[t * k + j]), warp k those of the shared
// expert with h[T * k + t]; then the first 8 threads combine the slots in order of j
// (moe_common::combine_with_shared). gate_logits [T] strided, or null: ungated. Launched through
// pdl::launch; the shared warp's weight loads issue before the producer's wait.
constexpr int kCombineRows = 8;
constexpr int kCombineLoads = 1;  // as kDownLoads: I = 512 is one chunk a lane

template <typename OutT>
__global__ void __launch_bounds__(static_cast<int>(kMoeDecodeCombineMaxSlots) * 32)
    down_combine_kernel(const float* h, const int32_t* ids, const float* topk_weights, int top_k, int tokens,
                        moe_common::DecodeWeights<uint8_t> w, const float* gate_logits, int64_t gate_stride,
                        OutT* __restrict__ out, int64_t out_stride) {
  constexpr int R = kCombineRows;
  __shared__ float dots[kMoeDecodeCombineMaxSlots][R];
  const int t = blockIdx.y, j = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c0 = blockIdx.x * R, hidden = w.hidden, inter = w.inter;
  const bool routed = j < top_k;
  if (routed) pdl::wait_for_producer();
  const int64_t slot = routed ? static_cast<int64_t>(t) * top_k + j : static_cast<int64_t>(tokens) * top_k + t;
  const int e = routed ? moe_common::clamp_expert(ids[slot], w.experts) : -1;
  const moe_common::ExpertBases<uint8_t> bases = moe_common::expert_bases(w, e);
  const int inter_blocks = (inter + kFp8Block - 1) / kFp8Block;
  const uint8_t* rows[R];
  const float* scales[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = min(c0 + r, hidden - 1);
    rows[r] = bases.down + static_cast<int64_t>(row) * inter;
    scales[r] = bases.down_scale + static_cast<int64_t>(row / kFp8Block) * inter_blocks;
  }
  float acc[R][1] = {};
  const float* const h_rows[1] = {h + slot * inter};
  fp8_gemv::warp_dot_partial<R, 1, kCombineLoads>(rows, scales, h_rows, 1, inter / fp8_gemv::kChunk, lane, acc,
                                                  moe_common::WaitUnlessWaited{routed});
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float total = warp_sum(acc[r][0]);
    if (lane == r) dots[j][r] = total;
  }
  __syncthreads();
  const int r = threadIdx.x;
  if (r < R && c0 + r < hidden) {
    float routed_sum = 0.0f;
    for (int k = 0; k < top_k; ++k) {
      routed_sum = __fadd_rn(routed_sum, __fmul_rn(topk_weights[static_cast<int64_t>(t) * top_k + k], dots[k][r]));
    }
    const bool has_shared = w.shared_down != nullptr;
    const float* gate_logit = gate_logits != nullptr ? gate_logits + static_cast<int64_t>(t) * gate_stride : nullptr;
    out[static_cast<int64_t>(t) * out_stride + c0 + r] =
        moe_common::combine_with_shared<OutT>(routed_sum, has_shared, has_shared ? dots[top_k][r] : 0.0f, gate_logit);
  }
}

}  // namespace metrale::kernels::cuda::moe_fp8
