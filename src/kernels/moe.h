// Mixture-of-experts ops: routing, device-side grouping of (token, slot) pairs by expert, the
// routed SwiGLU experts (a decode path that reads only the selected experts' rows, and a grouped
// path over expert-sorted rows for prefill), and the weighted k-slot reduce.
//
// Vocabulary. T tokens each pick k experts; slot s = t * k + j is token t's j-th pick (descending
// probability). H is the hidden size, I an expert's intermediate size, E the number of experts.
// Every op derives its launch shape from tensor shapes only, never from device values, so that all
// of them run inside CUDA graphs.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/dispatch.h"
#include "kernels/linear_weight.h"

namespace metrale::kernels {

// How router logits become expert scores: softmax over the experts (Qwen), or an independent
// sigmoid per expert (the DeepSeek-V3 router of glm_deepseek.md §1).
enum class MoeScoring { kSoftmax, kSigmoid };

struct MoeRouteParams {
  int top_k = 1;
  bool normalize = false;  // renormalise the top-k probabilities to sum to 1
  MoeScoring scoring = MoeScoring::kSoftmax;
  // [E] any float dtype, or empty: added to the scores for the choice of experts only (the weights
  // stay the unbiased scores); e_score_correction_bias.
  Tensor correction_bias{};
  // Group limit: the E experts form n_group contiguous groups; a group scores the sum of its two
  // best choice scores, and only the topk_group best groups (ties toward the lower group) keep
  // their experts. n_group = 1 does nothing.
  int n_group = 1;
  int topk_group = 1;
  float routed_scaling_factor = 1.0f;  // multiplies the final weights (after the renormalisation)
};

// The routed experts' weights as the expert ops read them. Expert e computes
//   h = silu(x . gate[e]^T) * (x . up[e]^T)   [I]   (clamped first when swiglu_limit > 0)
//   y = h . down[e]^T                          [H]
struct MoeExpertWeights {
  int64_t num_experts = 0;
  int64_t hidden_size = 0;        // H
  int64_t intermediate_size = 0;  // I
  // Clamped SwiGLU (swiglu_limit L > 0, glm_deepseek.md §1): the projections become
  // min(x . gate^T, L) and clamp(x . up^T, -L, L) before silu. 0: no clamp.
  float swiglu_limit = 0.0f;

  // Per-expert views (the CPU ops read these): gate[e], up[e] [I, H]; down[e] [H, I]; rows contiguous;
  // plain, or f8e4m3 codes with their 128x128 block scales (kernels::LinearWeight). They may point
  // anywhere (one tensor per expert in the checkpoint, or into the fused tensors).
  std::vector<LinearWeight> gate, up, down;

  // The fused layout the CUDA ops read: contiguous on the device, bf16 (tensor-core and 16-byte GEMV
  // kernels), f8e4m3 (with block scales) or f32 (f32 runs: CUDA-core kernels, fp32 throughout).
  //   gate_up [E, 2I, H]: rows [0, I) are expert e's gate rows, rows [I, 2I) its up rows;
  //   down_fused [E, H, I].
  // Empty on the CPU when the checkpoint stores one tensor per expert.
  Tensor gate_up;
  Tensor down_fused;
  // With f8e4m3 fused weights, their fp32 block scales (contiguous; empty for bf16):
  //   gate_up_scale [E, 2 * ceil(I/128), ceil(H/128)]: the gate rows' ceil(I/128) block rows, then
  //     the up rows' (so gate row i reads block row i / 128 and up row i block row ceil(I/128) + i / 128;
  //     when I % 128 == 0 this is the checkpoint's own [E, 2I/128, H/128] layout);
  //   down_scale [E, ceil(H/128), ceil(I/128)].
  Tensor gate_up_scale;
  Tensor down_scale;

  // Views over the fused tensors (any device): fills the per-expert views from them.
  static MoeExpertWeights from_fused(const Tensor& gate_up, const Tensor& down);
  // The same over f8e4m3 fused tensors and their scales (layouts above).
  static MoeExpertWeights from_fused_fp8(const Tensor& gate_up, const Tensor& gate_up_scale, const Tensor& down,
                                         const Tensor& down_scale);
  bool is_fp8() const { return !gate.empty() && gate.front().is_fp8(); }
  bool has_fused() const { return !gate_up.empty() && !down_fused.empty(); }
};

// A shared expert the decode ops run beside the routed ones, as one more slot per token: slot
// T * k + t is token t's shared expert (h rows [T * k, T * k + T) of moe_decode_gate_up). It must be
// in the routed experts' format (moe_shared_expert_fits): the same intermediate size I, and the same
// weights (plain of one dtype, or f8e4m3 with 128x128 block scales). Empty: no shared slot.
struct MoeSharedExpert {
  LinearWeight gate, up;  // [I, H]
  LinearWeight down;      // [H, I]
  bool empty() const { return down.empty(); }
};

// Whether the decode ops can run `shared` as the extra slot of every token (see MoeSharedExpert).
bool moe_shared_expert_fits(const MoeExpertWeights& experts, const MoeSharedExpert& shared);

// A token count up to which the block runs the decode path: with T * k slots at most this, reading
// the selected experts' rows once per slot costs less than sorting and a grouped GEMM (whose
// tensor-core tiles would be mostly padding). Both devices use the same rule.
inline constexpr int64_t kMoeDecodeMaxSlots = 64;

// The most slots per token (k, plus one for a shared expert) moe_decode_down_combine runs on CUDA
// (one warp per slot in a block); the block falls back to moe_decode_down + moe_combine above it.
inline constexpr int64_t kMoeDecodeCombineMaxSlots = 16;

// Scores in fp32 (softmax over experts, or sigmoid per expert), then top-k of the choice scores
// (score + correction_bias, within the kept groups; descending; ties broken by lower expert id).
// The weights are the unbiased scores of the chosen experts, optionally renormalised (softmax:
// w / sum(w); sigmoid: w / (sum(w) + 1e-20), as the reference), then times routed_scaling_factor.
// router_logits [T, E] f32|bf16; topk_ids [T, k] i32; topk_weights [T, k] f32. CUDA: E <= 512,
// n_group <= 32.
METRALE_DECLARE_OP_IMPLS(moe_route, (const Tensor& router_logits, const Tensor& topk_ids, const Tensor& topk_weights,
                                     const MoeRouteParams& params))

// out[i] = src[index[i]]. src [T, W]; index [n] i32; out [n, W] (same dtype as src, any float dtype).
METRALE_DECLARE_OP_IMPLS(gather_rows, (const Tensor& src, const Tensor& index, const Tensor& out))

// dst[index[i]] += weight[i] * src[i], in order of i (deterministic). dst [T, W] f32; src [n, W];
// index [n] i32; weight [n] f32.
METRALE_DECLARE_OP_IMPLS(scatter_add_rows,
                         (const Tensor& dst, const Tensor& src, const Tensor& index, const Tensor& weight))

// i32 elements of the scratch tensor moe_sort needs for `slots` = T * k pairs over E experts.
inline int64_t moe_sort_scratch_elements(int64_t slots, int64_t experts) {
  constexpr int64_t kSlotsPerChunk = 256;  // = the CUDA sort's block size
  return ((slots + kSlotsPerChunk - 1) / kSlotsPerChunk) * experts;
}

// Counting sort of the slots by expert (stable: within an expert, ascending slot id).
// topk_ids [T, k] i32 (values in [0, E)); expert_offsets [E + 1] i32 (expert e's slots sit at sorted
// positions [offsets[e], offsets[e+1]); offsets[E] = T * k); sorted_slots [T * k] i32 (slot id at
// each sorted position); scratch [moe_sort_scratch_elements(T * k, E)] i32 (clobbered).
METRALE_DECLARE_OP_IMPLS(moe_sort, (const Tensor& topk_ids, const Tensor& expert_offsets, const Tensor& sorted_slots,
                                    const Tensor& scratch))

// Decode path, step 1: for every slot s = t * k + j with e = topk_ids[t, j],
//   h[s] = silu(x[t] . gate[e]^T) * (x[t] . up[e]^T),
// and with a shared expert, for every token t, h[T * k + t] = the same over the shared expert.
// x [T, H] bf16|f32 (rows may be strided); topk_ids [T, k] i32; h [T * k (+ T), I] f32.
METRALE_DECLARE_OP_IMPLS(moe_decode_gate_up, (const Tensor& x, const Tensor& topk_ids, const MoeExpertWeights& experts,
                                              const Tensor& h, const MoeSharedExpert& shared))

// Decode path, step 2: slot_out[s] = h[s] . down[e]^T. h [T * k, I] f32; slot_out [T * k, H] f32.
METRALE_DECLARE_OP_IMPLS(moe_decode_down, (const Tensor& h, const Tensor& topk_ids, const MoeExpertWeights& experts,
                                           const Tensor& slot_out))

// Decode path, step 2 with the reduce: the down projections of every slot (and of the shared slot)
// and moe_combine's sum in one op, with moe_combine's roundings:
//   out[t] = combine(topk_weights[t], h[t * k + j] . down[topk_ids[t, j]]^T for j < k,
//                    shared: h[T * k + t] . down_shared^T, shared_gate_logits[t])
// (gated when shared_gate_logits is given, ungated otherwise; no shared expert: the routed sum).
// h [T * k (+ T), I] f32; topk_ids [T, k] i32; topk_weights [T, k] f32; shared_gate_logits [T, 1]
// f32 (rows may be strided) or empty; out [T, H] f32|bf16. CUDA: k + (shared ? 1 : 0) <=
// kMoeDecodeCombineMaxSlots.
METRALE_DECLARE_OP_IMPLS(moe_decode_down_combine, (const Tensor& h, const Tensor& topk_ids, const Tensor& topk_weights,
                                                   const MoeExpertWeights& experts, const MoeSharedExpert& shared,
                                                   const Tensor& shared_gate_logits, const Tensor& out))

// Grouped path, step 1 (after moe_sort): for every sorted position p of expert e's segment, with
// slot s = sorted_slots[p] and token t = s / top_k,
//   h[p] = silu(x[t] . gate[e]^T) * (x[t] . up[e]^T).
// x [T, H] (CUDA: bf16 with bf16 expert weights, any float dtype with f32 ones; rows may be
// strided); sorted_slots [T * k] i32; expert_offsets [E + 1] i32; h [T * k, I] (CUDA: bf16 with bf16
// expert weights, any float dtype with f32 ones; CPU: f32 or bf16), rows in sorted order.
METRALE_DECLARE_OP_IMPLS(moe_grouped_gate_up,
                         (const Tensor& x, const Tensor& sorted_slots, const Tensor& expert_offsets, int top_k,
                          const MoeExpertWeights& experts, const Tensor& h))

// Grouped path, step 2: slot_out[sorted_slots[p]] = h[p] . down[e]^T for p in expert e's segment.
// h [T * k, I] (CUDA: bf16 with bf16 expert weights, any float dtype with f32 ones), sorted order;
// slot_out [T * k, H] f32, slot order.
METRALE_DECLARE_OP_IMPLS(moe_grouped_down, (const Tensor& h, const Tensor& sorted_slots, const Tensor& expert_offsets,
                                            const MoeExpertWeights& experts, const Tensor& slot_out))

// The weighted k-slot reduce, plus the optional shared expert:
//   r[t] = sum_{j = 0..k-1} topk_weights[t, j] * slot_out[t * k + j]   (fp32, in order of j)
//   gated (shared_gate_logits given): out[t] = D(r[t] + sigmoid(shared_gate_logits[t]) * shared_out[t])
//   ungated (shared_gate_logits empty): out[t] = D(D(r[t]) + D(shared_out[t])), the routed sum
//     rounded to out's dtype D before the shared expert is added in D (DeepSeek-V3 MoE, §1)
//   no shared expert: out[t] = D(r[t]).
// slot_out [T * k, H] f32; topk_weights [T, k] f32; shared_out [T, H] f32 or empty;
// shared_gate_logits [T, 1] f32 or empty; out [T, H] f32|bf16.
METRALE_DECLARE_OP_IMPLS(moe_combine, (const Tensor& slot_out, const Tensor& topk_weights, const Tensor& shared_out,
                                       const Tensor& shared_gate_logits, const Tensor& out))

inline void moe_route(const Tensor& router_logits, const Tensor& topk_ids, const Tensor& topk_weights,
                      const MoeRouteParams& params) {
  METRALE_KERNEL_DISPATCH(moe_route, topk_ids.device(), router_logits, topk_ids, topk_weights, params);
}
inline void gather_rows(const Tensor& src, const Tensor& index, const Tensor& out) {
  METRALE_KERNEL_DISPATCH(gather_rows, out.device(), src, index, out);
}
inline void scatter_add_rows(const Tensor& dst, const Tensor& src, const Tensor& index, const Tensor& weight) {
  METRALE_KERNEL_DISPATCH(scatter_add_rows, dst.device(), dst, src, index, weight);
}
inline void moe_sort(const Tensor& topk_ids, const Tensor& expert_offsets, const Tensor& sorted_slots,
                     const Tensor& scratch) {
  METRALE_KERNEL_DISPATCH(moe_sort, sorted_slots.device(), topk_ids, expert_offsets, sorted_slots, scratch);
}
inline void moe_decode_gate_up(const Tensor& x, const Tensor& topk_ids, const MoeExpertWeights& experts,
                               const Tensor& h, const MoeSharedExpert& shared = {}) {
  METRALE_KERNEL_DISPATCH(moe_decode_gate_up, h.device(), x, topk_ids, experts, h, shared);
}
inline void moe_decode_down_combine(const Tensor& h, const Tensor& topk_ids, const Tensor& topk_weights,
                                    const MoeExpertWeights& experts, const MoeSharedExpert& shared,
                                    const Tensor& shared_gate_logits, const Tensor& out) {
  METRALE_KERNEL_DISPATCH(moe_decode_down_combine, out.device(), h, topk_ids, topk_weights, experts, shared,
                          shared_gate_logits, out);
}
inline void moe_decode_down(const Tensor& h, const Tensor& topk_ids, const MoeExpertWeights& experts,
                            const Tensor& slot_out) {
  METRALE_KERNEL_DISPATCH(moe_decode_down, slot_out.device(), h, topk_ids, experts, slot_out);
}
inline void moe_grouped_gate_up(const Tensor& x, const Tensor& sorted_slots, const Tensor& expert_offsets, int top_k,
                                const MoeExpertWeights& experts, const Tensor& h) {
  METRALE_KERNEL_DISPATCH(moe_grouped_gate_up, h.device(), x, sorted_slots, expert_offsets, top_k, experts, h);
}
inline void moe_grouped_down(const Tensor& h, const Tensor& sorted_slots, const Tensor& expert_offsets,
                             const MoeExpertWeights& experts, const Tensor& slot_out) {
  METRALE_KERNEL_DISPATCH(moe_grouped_down, slot_out.device(), h, sorted_slots, expert_offsets, experts, slot_out);
}
inline void moe_combine(const Tensor& slot_out, const Tensor& topk_weights, const Tensor& shared_out,
                        const Tensor& shared_gate_logits, const Tensor& out) {
  METRALE_KERNEL_DISPATCH(moe_combine, out.device(), slot_out, topk_weights, shared_out, shared_gate_logits, out);
}

}  // namespace metrale::kernels
