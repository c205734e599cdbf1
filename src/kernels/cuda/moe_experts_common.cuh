// Host checks and CUDA-core kernels shared by the MoE op files (moe.cu: routing, sorting, the
// grouped path and the combine; moe_decode.cu: the decode path): argument checks, the f32 expert
// kernels of f32 runs (one warp per output element, fp32 throughout; correct, not fast), and the
// combine's last step with the shared expert.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemm_gemv.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/moe.h"

namespace metrale::kernels::cuda::moe_common {

[[noreturn]] inline void fail(const std::string& message) {
  raise_message(ErrorCode::kInternal, message);
}
inline void expect(bool condition, const char* op, const std::string& what) {
  if (!condition) fail(std::string(op) + ": " + what);
}

inline bool aligned_16(const void* pointer) {
  return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0;
}

// A 2-D tensor whose rows can be read as 16-byte chunks: contiguous rows, 16-byte aligned base and row stride.
inline bool rows_vectorizable(const Tensor& t) {
  return t.ndim() == 2 && t.stride(1) == 1 && aligned_16(t.data()) &&
         (t.stride(0) * static_cast<int64_t>(t.element_size())) % 16 == 0;
}

inline std::string shape_of(const Tensor& t) {
  return t.describe();
}

__device__ __forceinline__ int clamp_expert(int e, int experts) {
  return min(max(e, 0), experts - 1);
}

// moe_combine's last step for one element (kernels/moe.h): `routed` is the fp32 routed sum (summed
// in order of j, no FMA contraction), `shared` the shared expert's fp32 output when there is one.
// gate_logit null: ungated (the routed sum rounded to OutT, then the shared value added in OutT).
template <typename OutT>
__device__ __forceinline__ OutT combine_with_shared(float routed, bool has_shared, float shared,
                                                    const float* gate_logit) {
  float acc = routed;
  if (has_shared && gate_logit == nullptr) {
    acc = __fadd_rn(to_f32(from_f32<OutT>(acc)), to_f32(from_f32<OutT>(shared)));
  } else if (has_shared) {
    const float gate = 1.0f / (1.0f + expf(-*gate_logit));
    acc = __fadd_rn(acc, __fmul_rn(gate, shared));
  }
  return from_f32<OutT>(acc);
}

// ---------------------------------------------------------------------------------------------
// The decode kernels' view of the weights: the routed experts and the optional shared expert, in
// one format W (__nv_bfloat16, or uint8_t e4m3 codes with fp32 128x128 block scales).

template <typename W>
struct DecodeWeights {
  const W* gate_up = nullptr;                // [E, 2I, H]: expert e's gate rows, then its up rows
  const float* gate_up_scale = nullptr;      // FP8: [E, 2 ceil(I/128), ceil(H/128)]
  const W* down = nullptr;                   // [E, H, I]
  const float* down_scale = nullptr;         // FP8: [E, ceil(H/128), ceil(I/128)]
  const W* shared_gate = nullptr;            // [I, H]; null: no shared expert
  const W* shared_up = nullptr;              // [I, H]
  const W* shared_down = nullptr;            // [H, I]
  const float* shared_gate_scale = nullptr;  // FP8: [ceil(I/128), ceil(H/128)]
  const float* shared_up_scale = nullptr;    // FP8: [ceil(I/128), ceil(H/128)]
  const float* shared_down_scale = nullptr;  // FP8: [ceil(H/128), ceil(I/128)]
  int experts = 0, hidden = 0, inter = 0;
};

// Row 0 of an expert's gate, up and down matrices (and of their scale rows): routed expert e, or
// the shared expert for e < 0.
template <typename W>
struct ExpertBases {
  const W* gate;
  const W* up;
  const W* down;
  const float* gate_scale;
  const float* up_scale;
  const float* down_scale;
};

template <typename W>
__device__ __forceinline__ ExpertBases<W> expert_bases(const DecodeWeights<W>& w, int e) {
  if (e < 0) {
    return {w.shared_gate, w.shared_up, w.shared_down, w.shared_gate_scale, w.shared_up_scale, w.shared_down_scale};
  }
  const int64_t matrix = static_cast<int64_t>(w.inter) * w.hidden;
  const W* gate = w.gate_up + static_cast<int64_t>(e) * 2 * matrix;
  ExpertBases<W> bases{gate, gate + matrix, w.down + static_cast<int64_t>(e) * matrix, nullptr, nullptr, nullptr};
  if (w.gate_up_scale != nullptr) {
    const int64_t hidden_blocks = (w.hidden + 127) / 128, inter_blocks = (w.inter + 127) / 128;
    bases.gate_scale = w.gate_up_scale + static_cast<int64_t>(e) * 2 * inter_blocks * hidden_blocks;
    bases.up_scale = bases.gate_scale + inter_blocks * hidden_blocks;
    bases.down_scale = w.down_scale + static_cast<int64_t>(e) * hidden_blocks * inter_blocks;
  }
  return bases;
}

// The before_inputs hook of the GEMV building blocks for a warp that may or may not have waited
// for its producer already (pdl.cuh): waits when it has not, then lets the next kernel be scheduled.
struct WaitUnlessWaited {
  bool waited;
  __device__ __forceinline__ void operator()() const {
    if (!waited) pdl::wait_for_producer();
    pdl::allow_dependents();
  }
};

// ---------------------------------------------------------------------------------------------
// f32 expert weights (f32 runs): one warp per output element on CUDA cores, for both paths.

// Which expert, slot and token a row of the expert ops belongs to. Decode path (sorted_slots null):
// row r < routed_rows is slot r, its expert ids[r], its token r / top_k; a row r >= routed_rows is
// token r - routed_rows's shared expert (shared_gate / shared_up / shared_down [I, H], [I, H],
// [H, I]). Grouped path: row p is sorted position p, its slot sorted_slots[p], its expert the
// segment of expert_offsets [E + 1] that holds p.
struct ExpertRows {
  const int32_t* ids;             // [T * k] (decode)
  const int32_t* sorted_slots;    // [T * k] (grouped) or null
  const int32_t* expert_offsets;  // [E + 1] (grouped)
  int experts;
  int64_t routed_rows = INT64_MAX;  // decode: T * k
  const float* shared_gate = nullptr;
  const float* shared_up = nullptr;
  const float* shared_down = nullptr;
};

__device__ __forceinline__ int row_slot(const ExpertRows& rows, int64_t r) {
  return rows.sorted_slots != nullptr ? rows.sorted_slots[r] : static_cast<int>(r);
}

__device__ __forceinline__ int64_t row_token(const ExpertRows& rows, int64_t r, int top_k) {
  return r < rows.routed_rows ? row_slot(rows, r) / top_k : r - rows.routed_rows;
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

// h[r, i] = silu(x[t] . gate[e][i]) * (x[t] . up[e][i]) for row r's token t and expert e (or the
// shared expert); rows * inter warps.
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
    const XT* x_row = x + row_token(rows, r, top_k) * x_stride;
    const float* gate_row;
    const float* up_row;
    if (r < rows.routed_rows) {
      gate_row = gate_up + (static_cast<int64_t>(row_expert(rows, r)) * 2 * inter + i) * hidden;
      up_row = gate_row + static_cast<int64_t>(inter) * hidden;
    } else {
      gate_row = rows.shared_gate + static_cast<int64_t>(i) * hidden;
      up_row = rows.shared_up + static_cast<int64_t>(i) * hidden;
    }
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

// slot_out[slot(r), c] = h[r] . down[e][c]; rows * hidden warps (routed rows only).
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

inline unsigned simple_blocks(int64_t warps) {
  return static_cast<unsigned>(std::min<int64_t>((warps + kSimpleThreads / 32 - 1) / (kSimpleThreads / 32), 132 * 64));
}

inline void launch_gate_up_simple(const Tensor& x, const ExpertRows& rows, int top_k, const MoeExpertWeights& experts,
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

inline void launch_down_simple(const Tensor& h, const ExpertRows& rows, const MoeExpertWeights& experts,
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
// Shared checks of the expert ops.

inline void check_fused(const MoeExpertWeights& experts, const char* op) {
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
         "both f8e4m3; got " +
             std::string(dtype_name(gate_up.dtype())) + " " + shape_of(gate_up) + " and " +
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

}  // namespace metrale::kernels::cuda::moe_common
