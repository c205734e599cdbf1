// CUDA MoE decode path (see kernels/moe.h for the contracts): the selected experts' rows read once
// per slot, with no sorting, for steps of at most kMoeDecodeMaxSlots (token, expert) pairs.
//   moe_decode_gate_up       per (slot, 8 intermediate rows) a 4-warp block; each warp streams 2 gate
//                            and 2 up rows of the slot's expert (or of the shared expert, one more
//                            slot per token) with 16-byte loads; h in fp32.
//   moe_decode_down          per (slot, 16 hidden rows) a 4-warp block: each slot's down projection.
//   moe_decode_down_combine  per (token, 8 hidden rows) a block of one warp per slot (the shared
//                            expert's included): every slot's down rows, then moe_combine's ordered
//                            fp32 sum in the same block, so the step needs neither slot outputs in
//                            memory nor a combine launch.
// FP8 experts run the kernels of moe_fp8_decode.cuh; f32 experts (f32 runs) the CUDA-core kernels
// of moe_experts_common.cuh. The gate/up and down-combine kernels are launched through pdl::launch:
// the shared expert's weight loads overlap the kernel before them.
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemm_gemv.cuh"
#include "kernels/cuda/moe_experts_common.cuh"
#include "kernels/cuda/moe_fp8_decode.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/moe.h"

namespace metrale::kernels::cuda {
namespace {

using moe_common::check_fused;
using moe_common::DecodeWeights;
using moe_common::expect;
using moe_common::ExpertRows;
using moe_common::shape_of;

constexpr int kDecodeWarps = 4;
constexpr int kDecodeGateUpRows = 2;  // intermediate rows per warp (2 gate + 2 up weight rows)
constexpr int kDecodeDownRows = 4;    // down rows per warp
constexpr int kDecodeLoads = 4;       // 16-byte chunks per row in flight per lane
constexpr int kCombineRows = 8;       // hidden rows per down-combine block (every warp: all of them)
constexpr int kCombineLoads = 2;

// grid (ceil(I / (kDecodeWarps * kDecodeGateUpRows)), T * k (+ T)). h [T * k (+ T), I] f32: slots
// s < routed_slots read expert ids[s] after the producer's wait (the router wrote the ids); the T
// slots after them read the shared expert, whose weight loads issue before the wait.
template <typename XT>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    moe_decode_gate_up_kernel(const XT* x, int64_t x_stride, const int32_t* ids, int top_k, int routed_slots,
                              DecodeWeights<__nv_bfloat16> w, float limit, float* h) {
  constexpr int R = kDecodeGateUpRows;
  const int slot = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i0 = (blockIdx.x * kDecodeWarps + warp) * R;
  const int inter = w.inter, hidden = w.hidden;
  if (i0 >= inter) return;
  const bool routed = slot < routed_slots;
  if (routed) pdl::wait_for_producer();
  // Route ids are always in range; clamping only keeps a corrupted id from reading outside the weights.
  const int e = routed ? moe_common::clamp_expert(ids[slot], w.experts) : -1;
  const moe_common::ExpertBases<__nv_bfloat16> bases = moe_common::expert_bases(w, e);
  const __nv_bfloat16* w_rows[2 * R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = min(i0 + r, inter - 1);
    w_rows[r] = bases.gate + static_cast<int64_t>(i) * hidden;
    w_rows[R + r] = bases.up + static_cast<int64_t>(i) * hidden;
  }
  const int64_t token = routed ? slot / top_k : slot - routed_slots;
  const XT* x_rows[1] = {x + token * x_stride};
  float acc[2 * R][1];
#pragma unroll
  for (int r = 0; r < 2 * R; ++r) acc[r][0] = 0.0f;
  gemv::warp_dot_partial<2 * R, 1, kDecodeLoads>(w_rows, x_rows, 1, hidden / gemv::kChunk, lane, acc,
                                                 moe_common::WaitUnlessWaited{routed});
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
                           const __nv_bfloat16* __restrict__ down, int hidden, int inter, float* __restrict__ slot_out,
                           int64_t out_stride) {
  constexpr int R = kDecodeDownRows;
  const int slot = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kDecodeWarps + warp) * R;
  if (row0 >= hidden) return;
  const int e = moe_common::clamp_expert(ids[slot], experts);
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

// grid (ceil(H / kCombineRows), T), block (k (+ 1)) warps: warp j < k computes rows [c0, c0 + 8) of
// token t's slot j (its expert's down rows dotted with h[t * k + j]), warp k those of the shared
// expert with h[T * k + t]; then the first 8 threads combine the slots in order of j
// (moe_common::combine_with_shared). gate_logits [T] strided, or null: ungated.
template <typename OutT>
__global__ void __launch_bounds__(static_cast<int>(kMoeDecodeCombineMaxSlots) * 32)
    moe_decode_down_combine_kernel(const float* h, const int32_t* ids, const float* topk_weights, int top_k, int tokens,
                                   DecodeWeights<__nv_bfloat16> w, const float* gate_logits, int64_t gate_stride,
                                   OutT* __restrict__ out, int64_t out_stride) {
  constexpr int R = kCombineRows;
  __shared__ float dots[kMoeDecodeCombineMaxSlots][R];
  const int t = blockIdx.y, j = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c0 = blockIdx.x * R, hidden = w.hidden, inter = w.inter;
  const bool routed = j < top_k;
  if (routed) pdl::wait_for_producer();
  const int64_t slot = routed ? static_cast<int64_t>(t) * top_k + j : static_cast<int64_t>(tokens) * top_k + t;
  const int e = routed ? moe_common::clamp_expert(ids[slot], w.experts) : -1;
  const __nv_bfloat16* base = moe_common::expert_bases(w, e).down;
  const __nv_bfloat16* w_rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) w_rows[r] = base + static_cast<int64_t>(min(c0 + r, hidden - 1)) * inter;
  const float* x_rows[1] = {h + slot * inter};
  float acc[R][1];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;
  gemv::warp_dot_partial<R, 1, kCombineLoads>(w_rows, x_rows, 1, inter / gemv::kChunk, lane, acc,
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

// f32 experts: one warp per (token, hidden row), every slot's dot in order, then the combine.
template <typename OutT>
__global__ void moe_decode_down_combine_simple_kernel(const float* __restrict__ h, const int32_t* __restrict__ ids,
                                                      const float* __restrict__ topk_weights, int top_k, int tokens,
                                                      DecodeWeights<float> w, const float* __restrict__ gate_logits,
                                                      int64_t gate_stride, OutT* __restrict__ out, int64_t out_stride) {
  const int lane = threadIdx.x & 31;
  const int64_t count = static_cast<int64_t>(tokens) * w.hidden;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const bool has_shared = w.shared_down != nullptr;
  for (int64_t index = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; index < count;
       index += warps) {
    const int64_t t = index / w.hidden;
    const int c = static_cast<int>(index % w.hidden);
    float routed_sum = 0.0f, shared = 0.0f;
    for (int j = 0; j <= top_k; ++j) {
      if (j == top_k && !has_shared) break;
      const int64_t slot = j < top_k ? t * top_k + j : static_cast<int64_t>(tokens) * top_k + t;
      const int e = j < top_k ? moe_common::clamp_expert(ids[slot], w.experts) : -1;
      const float* down_row = moe_common::expert_bases(w, e).down + static_cast<int64_t>(c) * w.inter;
      const float* h_row = h + slot * w.inter;
      float dot = 0.0f;
      for (int i = lane; i < w.inter; i += 32) dot = fmaf(h_row[i], down_row[i], dot);
      dot = warp_sum(dot);
      if (j < top_k) {
        routed_sum = __fadd_rn(routed_sum, __fmul_rn(topk_weights[t * top_k + j], dot));
      } else {
        shared = dot;
      }
    }
    if (lane == 0) {
      const float* gate_logit = gate_logits != nullptr ? gate_logits + t * gate_stride : nullptr;
      out[t * out_stride + c] = moe_common::combine_with_shared<OutT>(routed_sum, has_shared, shared, gate_logit);
    }
  }
}

// The kernels' view of `experts` and `shared` in format W, after the checks of the ops.
template <typename W>
DecodeWeights<W> decode_weights(const MoeExpertWeights& experts, const MoeSharedExpert& shared) {
  DecodeWeights<W> w;
  w.gate_up = static_cast<const W*>(experts.gate_up.data());
  w.down = static_cast<const W*>(experts.down_fused.data());
  if (experts.is_fp8()) {
    w.gate_up_scale = experts.gate_up_scale.data_as<const float>();
    w.down_scale = experts.down_scale.data_as<const float>();
  }
  if (!shared.empty()) {
    w.shared_gate = static_cast<const W*>(shared.gate.weight.data());
    w.shared_up = static_cast<const W*>(shared.up.weight.data());
    w.shared_down = static_cast<const W*>(shared.down.weight.data());
    if (shared.down.is_fp8()) {
      w.shared_gate_scale = shared.gate.scale_inv.data_as<const float>();
      w.shared_up_scale = shared.up.scale_inv.data_as<const float>();
      w.shared_down_scale = shared.down.scale_inv.data_as<const float>();
    }
  }
  w.experts = static_cast<int>(experts.num_experts);
  w.hidden = static_cast<int>(experts.hidden_size);
  w.inter = static_cast<int>(experts.intermediate_size);
  return w;
}

// The shared expert as the CUDA decode kernels read it: the routed experts' format (fits), every
// part contiguous and 16-byte aligned, FP8 scales contiguous in their [ceil(N/128), ceil(K/128)] layout.
void check_shared(const MoeExpertWeights& experts, const MoeSharedExpert& shared, const char* op) {
  if (shared.empty()) return;
  expect(moe_shared_expert_fits(experts, shared), op,
         "the shared expert " + shape_of(shared.down.weight) + " is not in the routed experts' format");
  for (const LinearWeight* part : {&shared.gate, &shared.up, &shared.down}) {
    expect(
        part->weight.device().is_cuda() && part->weight.is_contiguous() && moe_common::aligned_16(part->weight.data()),
        op, "shared expert weights must be contiguous and 16-byte aligned on the GPU; got " + shape_of(part->weight));
    if (part->is_fp8()) {
      expect(part->scale_inv.is_contiguous() && part->scale_inv.dtype() == DType::kF32 &&
                 part->scale_inv.shape() ==
                     (Shape{fp8_scale_blocks(part->weight.size(0)), fp8_scale_blocks(part->weight.size(1))}),
             op,
             "shared expert FP8 scales must be contiguous f32 [ceil(N/128), ceil(K/128)]; got " +
                 shape_of(part->scale_inv));
    }
  }
}

}  // namespace

void moe_decode_gate_up(const Tensor& x, const Tensor& topk_ids, const MoeExpertWeights& experts, const Tensor& h,
                        const MoeSharedExpert& shared) {
  constexpr const char* op = "moe_decode_gate_up";
  check_fused(experts, op);
  check_shared(experts, shared, op);
  const int64_t tokens = x.size(0), hidden = experts.hidden_size, inter = experts.intermediate_size;
  expect(x.ndim() == 2 && x.size(1) == hidden && topk_ids.ndim() == 2 && topk_ids.size(0) == tokens &&
             topk_ids.dtype() == DType::kI32 && topk_ids.is_contiguous(),
         op, "x " + shape_of(x) + " topk_ids " + shape_of(topk_ids));
  const int64_t k = topk_ids.size(1), routed_slots = tokens * k, slots = routed_slots + (shared.empty() ? 0 : tokens);
  expect(h.dtype() == DType::kF32 && h.ndim() == 2 && h.size(0) == slots && h.size(1) == inter && h.is_contiguous(), op,
         "h must be contiguous f32 [T * k (+ T with a shared expert), I]; got " + shape_of(h));
  expect(slots <= 65535, op, "too many slots for the decode path");
  if (experts.gate_up.dtype() == DType::kF32) {
    expect(x.stride(1) == 1, op, "x rows must be contiguous; got " + shape_of(x));
    ExpertRows rows{topk_ids.data_as<const int32_t>(), nullptr, nullptr, static_cast<int>(experts.num_experts)};
    rows.routed_rows = routed_slots;
    if (!shared.empty()) {
      rows.shared_gate = shared.gate.weight.data_as<const float>();
      rows.shared_up = shared.up.weight.data_as<const float>();
    }
    moe_common::launch_gate_up_simple(x, rows, static_cast<int>(k), experts, h, slots, stream_of(h));
    return;
  }
  expect((x.dtype() == DType::kBF16 || x.dtype() == DType::kF32) && moe_common::rows_vectorizable(x), op,
         "x must be bf16 or f32 with 16-byte aligned rows; got " + shape_of(x));
  if (slots == 0) return;
  const auto* ids = topk_ids.data_as<const int32_t>();
  const int top_k = static_cast<int>(k), routed = static_cast<int>(routed_slots);
  const float limit = experts.swiglu_limit;
  if (experts.is_fp8()) {
    const dim3 grid(static_cast<unsigned>(ceil_div(inter, moe_fp8::kWarps * moe_fp8::kGateUpRows)),
                    static_cast<unsigned>(slots));
    const DecodeWeights<uint8_t> w = decode_weights<uint8_t>(experts, shared);
    if (x.dtype() == DType::kBF16) {
      pdl::launch(moe_fp8::gate_up_kernel<__nv_bfloat16>, grid, dim3(moe_fp8::kWarps * 32), 0, stream_of(h),
                  x.data_as<const __nv_bfloat16>(), x.stride(0), ids, top_k, routed, w, limit, h.data_as<float>());
    } else {
      pdl::launch(moe_fp8::gate_up_kernel<float>, grid, dim3(moe_fp8::kWarps * 32), 0, stream_of(h),
                  x.data_as<const float>(), x.stride(0), ids, top_k, routed, w, limit, h.data_as<float>());
    }
    return;
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(inter, kDecodeWarps * kDecodeGateUpRows)),
                  static_cast<unsigned>(slots));
  const DecodeWeights<__nv_bfloat16> w = decode_weights<__nv_bfloat16>(experts, shared);
  if (x.dtype() == DType::kBF16) {
    pdl::launch(moe_decode_gate_up_kernel<__nv_bfloat16>, grid, dim3(kDecodeWarps * 32), 0, stream_of(h),
                x.data_as<const __nv_bfloat16>(), x.stride(0), ids, top_k, routed, w, limit, h.data_as<float>());
  } else {
    pdl::launch(moe_decode_gate_up_kernel<float>, grid, dim3(kDecodeWarps * 32), 0, stream_of(h),
                x.data_as<const float>(), x.stride(0), ids, top_k, routed, w, limit, h.data_as<float>());
  }
}

void moe_decode_down(const Tensor& h, const Tensor& topk_ids, const MoeExpertWeights& experts, const Tensor& slot_out) {
  constexpr const char* op = "moe_decode_down";
  check_fused(experts, op);
  const int64_t slots = topk_ids.numel(), hidden = experts.hidden_size, inter = experts.intermediate_size;
  expect(topk_ids.dtype() == DType::kI32 && topk_ids.is_contiguous(), op, "topk_ids must be contiguous i32");
  expect(h.dtype() == DType::kF32 && h.ndim() == 2 && h.size(0) == slots && h.size(1) == inter && h.is_contiguous() &&
             moe_common::aligned_16(h.data()),
         op, "h must be contiguous f32 [T * k, I]; got " + shape_of(h));
  expect(slot_out.dtype() == DType::kF32 && slot_out.ndim() == 2 && slot_out.size(0) == slots &&
             slot_out.size(1) == hidden && slot_out.stride(1) == 1,
         op, "slot_out must be f32 [T * k, H]; got " + shape_of(slot_out));
  expect(slots <= 65535, op, "too many slots for the decode path");
  if (slots == 0) return;
  if (experts.down_fused.dtype() == DType::kF32) {
    const ExpertRows rows{topk_ids.data_as<const int32_t>(), nullptr, nullptr, static_cast<int>(experts.num_experts)};
    moe_common::launch_down_simple(h, rows, experts, slot_out, slots, stream_of(slot_out));
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
  const dim3 grid(static_cast<unsigned>(ceil_div(hidden, kDecodeWarps * kDecodeDownRows)),
                  static_cast<unsigned>(slots));
  moe_decode_down_kernel<<<grid, kDecodeWarps * 32, 0, stream_of(slot_out)>>>(
      h.data_as<const float>(), topk_ids.data_as<const int32_t>(), static_cast<int>(experts.num_experts),
      experts.down_fused.data_as<const __nv_bfloat16>(), static_cast<int>(hidden), static_cast<int>(inter),
      slot_out.data_as<float>(), slot_out.stride(0));
  METRALE_CHECK_LAUNCH("moe_decode_down_kernel");
}

void moe_decode_down_combine(const Tensor& h, const Tensor& topk_ids, const Tensor& topk_weights,
                             const MoeExpertWeights& experts, const MoeSharedExpert& shared,
                             const Tensor& shared_gate_logits, const Tensor& out) {
  constexpr const char* op = "moe_decode_down_combine";
  check_fused(experts, op);
  check_shared(experts, shared, op);
  const int64_t tokens = out.size(0), hidden = experts.hidden_size, inter = experts.intermediate_size;
  expect(
      topk_ids.dtype() == DType::kI32 && topk_ids.is_contiguous() && topk_ids.ndim() == 2 && topk_ids.size(0) == tokens,
      op, "topk_ids must be contiguous i32 [T, k]; got " + shape_of(topk_ids));
  const int64_t k = topk_ids.size(1), routed_slots = tokens * k, slots = routed_slots + (shared.empty() ? 0 : tokens);
  expect(topk_weights.dtype() == DType::kF32 && topk_weights.is_contiguous() && topk_weights.numel() == routed_slots,
         op, "topk_weights must be contiguous f32 [T, k]; got " + shape_of(topk_weights));
  expect(h.dtype() == DType::kF32 && h.ndim() == 2 && h.size(0) == slots && h.size(1) == inter && h.is_contiguous() &&
             moe_common::aligned_16(h.data()),
         op, "h must be contiguous f32 [T * k (+ T with a shared expert), I]; got " + shape_of(h));
  expect(out.ndim() == 2 && out.size(1) == hidden && out.stride(1) == 1, op,
         "out must be [T, H] with contiguous rows; got " + shape_of(out));
  expect(k + (shared.empty() ? 0 : 1) <= kMoeDecodeCombineMaxSlots && tokens <= 65535, op,
         "at most " + std::to_string(kMoeDecodeCombineMaxSlots) + " slots per token and 65535 tokens");
  const bool gated = !shared.empty() && !shared_gate_logits.empty();
  if (gated) {
    expect(shared_gate_logits.dtype() == DType::kF32 && shared_gate_logits.ndim() == 2 &&
               shared_gate_logits.size(0) == tokens && shared_gate_logits.size(1) == 1,
           op, "shared_gate_logits must be f32 [T, 1]; got " + shape_of(shared_gate_logits));
  }
  if (tokens == 0) return;
  const auto* ids = topk_ids.data_as<const int32_t>();
  const float* weights = topk_weights.data_as<const float>();
  const float* gate = gated ? shared_gate_logits.data_as<const float>() : nullptr;
  const int64_t gate_stride = gated ? shared_gate_logits.stride(0) : 0;
  const int top_k = static_cast<int>(k), token_count = static_cast<int>(tokens);
  cudaStream_t stream = stream_of(out);
  if (experts.down_fused.dtype() == DType::kF32) {
    const DecodeWeights<float> w = decode_weights<float>(experts, shared);
    METRALE_DISPATCH_FLOAT(out.dtype(), op, [&] {
      moe_decode_down_combine_simple_kernel<scalar_t>
          <<<moe_common::simple_blocks(tokens * hidden), moe_common::kSimpleThreads, 0, stream>>>(
              h.data_as<const float>(), ids, weights, top_k, token_count, w, gate, gate_stride, out.data_as<scalar_t>(),
              out.stride(0));
    });
    METRALE_CHECK_LAUNCH("moe_decode_down_combine_simple_kernel");
    return;
  }
  const dim3 block(static_cast<unsigned>(32 * (slots / tokens)));
  METRALE_DISPATCH_FLOAT(out.dtype(), op, [&] {
    if (experts.is_fp8()) {
      const dim3 grid(static_cast<unsigned>(ceil_div(hidden, moe_fp8::kCombineRows)), static_cast<unsigned>(tokens));
      pdl::launch(moe_fp8::down_combine_kernel<scalar_t>, grid, block, 0, stream, h.data_as<const float>(), ids,
                  weights, top_k, token_count, decode_weights<uint8_t>(experts, shared), gate, gate_stride,
                  out.data_as<scalar_t>(), out.stride(0));
    } else {
      const dim3 grid(static_cast<unsigned>(ceil_div(hidden, kCombineRows)), static_cast<unsigned>(tokens));
      pdl::launch(moe_decode_down_combine_kernel<scalar_t>, grid, block, 0, stream, h.data_as<const float>(), ids,
                  weights, top_k, token_count, decode_weights<__nv_bfloat16>(experts, shared), gate, gate_stride,
                  out.data_as<scalar_t>(), out.stride(0));
    }
  });
}

}  // namespace metrale::kernels::cuda
