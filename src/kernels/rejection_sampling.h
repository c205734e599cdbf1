// Rejection sampling of speculative drafts, one draft per row (Leviathan et al., Chen et al.):
// given the target distribution p of a row and the distribution q its draft d was drawn from,
//   accept d          when u_accept * q(d) < p(d)   (probability min(1, p(d) / q(d)));
//   otherwise emit    a token of the residual norm(max(0, p - q)), drawn with u_residual;
// so that the emitted token follows p whatever q is. A deterministic draft (n-gram lookup, an argmax
// draft) has a one-hot q: accepted with probability p(d), and the residual is p without d,
// renormalised. When the residual has no mass (p <= q everywhere, i.e. p == q up to rounding) the
// draft is accepted.
//
// The decision, written once for both implementations:
//   accept     (double) u_accept * (double) q(d) < (double) p(d)    (q(d) = 1 for a one-hot q)
//   residual   r_i = max(0, p_i - q_i) rounded to float, as fixed point floor(r_i x 2^100)
//              (sampling_detail::fixed_weight); masses are 128-bit integer sums, so the order of
//              summation does not matter and the CPU and CUDA twins pick the same token
//   draw       the first token, by id, whose running residual mass reaches floor(u x mass) + 1
//              (sampling_detail::draw_target)
// Given the same uniforms the two implementations give identical tokens and accept flags.
#pragma once

#include "kernels/dispatch.h"
#include "kernels/sampling.h"

namespace metrale::kernels {

// target [R, V] f32 (rows of p: non-negative, summing to ~1; last dim contiguous), V < 2^27;
// draft_probs [R, V] f32 like target, or an empty tensor: every draft is one-hot; drafts [R] i32 in
// [0, V); accept_uniform, residual_uniform [R] f32 in [0, 1); tokens [R] i32 (the draft when
// accepted, else the residual's draw); accepted [R] i32 (1 or 0).
//
// CUDA: one CTA of 256 threads per row, each summing a contiguous slice of the row's residual; no
// workspace, graph-safe.
struct RejectionRows {
  Tensor target;            // [R, V] f32
  Tensor draft_probs;       // [R, V] f32, or empty (one-hot)
  Tensor drafts;            // [R] i32
  Tensor accept_uniform;    // [R] f32
  Tensor residual_uniform;  // [R] f32
};

METRALE_DECLARE_OP_IMPLS(rejection_sample_rows,
                         (const RejectionRows& rows, const Tensor& tokens, const Tensor& accepted))

inline void rejection_sample_rows(const RejectionRows& rows, const Tensor& tokens, const Tensor& accepted) {
  METRALE_KERNEL_DISPATCH(rejection_sample_rows, tokens.device(), rows, tokens, accepted);
}

namespace rejection_detail {

// Whether the draft passes: u * q(d) < p(d), in double, without contraction into an FMA.
METRALE_HOST_DEVICE inline bool accepts(float uniform, float q_draft, float p_draft) {
  return sampling_detail::dmul_rn(static_cast<double>(uniform), static_cast<double>(q_draft)) <
         static_cast<double>(p_draft);
}

// The residual weight of token i as fixed point: floor(max(0, p_i - q_i) x 2^100), p and q clamped to
// [0, 1] (a residual is a probability difference).
METRALE_HOST_DEVICE inline sampling_detail::Fixed128 residual_fixed(float p, float q) {
  const float clamped_p = p > 0.0f ? (p < 1.0f ? p : 1.0f) : 0.0f;
  const float clamped_q = q > 0.0f ? (q < 1.0f ? q : 1.0f) : 0.0f;
  const float r = sampling_detail::sub_rn(clamped_p, clamped_q);
  return r > 0.0f ? sampling_detail::fixed_weight(r) : 0;
}

}  // namespace rejection_detail
}  // namespace metrale::kernels
