// Gated DeltaNet core over a ragged batch (qwen.md §6.3-§6.6): the gates, and the gated delta rule
// in two forms that compute the same thing, the chunked (WY) form for prefill and the token-by-token
// recurrent form for decode and speculative verify.
//
// Per value head h (key head h / (Hv / Hk)) and token t, with fp32 state S [dk, dv]:
//   q, k <- l2norm(q), l2norm(k)  (x * rsqrt(sum(x^2) + 1e-6), when params.qk_l2norm); q <- q * scale
//   S <- exp(g_t) * S;  delta = (v_t - S^T k_t) * beta_t;  S <- S + k_t delta^T;  o_t = S^T q_t
// Batch layout as in attention.h; sequence s reads its initial state from state[state_slots[s]]
// (zero when ctx_s = kv_lens[s] - q_len_s is 0, whatever the slot holds) and leaves the state after
// its last row there.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// a, b [T, Hv] activations (rows may be strided); A_log, dt_bias [Hv] any float dtype;
// g, beta [T, Hv] f32 outputs, contiguous:
//   beta = D(sigmoid(b)) (rounded to the activation dtype, then widened), g = -exp(A_log) * softplus(a + dt_bias)
// in fp32 (softplus(x) = x for x > 20).
METRALE_DECLARE_OP_IMPLS(gdn_gates, (const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                                     const Tensor& g, const Tensor& beta))

struct GatedDeltaRuleParams {
  float scale = 1.0f;     // applied to q after the l2 norm; usually dk^-0.5
  bool qk_l2norm = true;  // use_qk_l2norm_in_kernel
  int64_t max_q_len = 0;  // host upper bound of q_len over the batch (0: not given), for planning
  // CUDA scratch of the chunked form: at least gated_delta_rule_workspace_bytes(...) bytes on the
  // device; nothing survives the call. Unused on the CPU and by the recurrent form.
  Tensor workspace;
  // Recurrent form only, optional: [T, Hv, dk, dv] f32; when given, row t receives the state after
  // token t (speculative verify keeps the state of every draft row). The slot still receives the
  // state after the last row.
  Tensor row_states;
  // Recurrent form only: false reads the slots and leaves them as they were (a speculative verify
  // keeps them for its commit). The chunked form requires true.
  bool write_state = true;
};

// q, k [T, Hk, dk] and v [T, Hv, dv] activations (strided rows allowed, e.g. column slices of the
// conv output; the last dim contiguous); g, beta [T, Hv] f32; state [num_slots, Hv, dk, dv] f32,
// contiguous; cu_q [S+1], kv_lens [S], state_slots [S] i32 on the device; out [T, Hv, dv]
// activation dtype (contiguous). Outputs are rounded to the activation dtype once. Recurrent form
// only: a slot of -1 has no state (the sequence starts from zero, its final state is discarded).
METRALE_DECLARE_OP_IMPLS(gated_delta_rule_chunked,
                         (const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& state, const Tensor& cu_q, const Tensor& kv_lens, const Tensor& state_slots,
                          const Tensor& out, const GatedDeltaRuleParams& params))
METRALE_DECLARE_OP_IMPLS(gated_delta_rule_recurrent,
                         (const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& state, const Tensor& cu_q, const Tensor& kv_lens, const Tensor& state_slots,
                          const Tensor& out, const GatedDeltaRuleParams& params))

// Bytes of GatedDeltaRuleParams::workspace the CUDA chunked form needs for a batch within these
// bounds on `device` (0 on the CPU).
size_t gated_delta_rule_workspace_bytes(Device device, int64_t num_tokens, int64_t num_seqs, int64_t num_v_heads,
                                        int64_t key_head_dim, int64_t value_head_dim);

inline void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, const Tensor& g,
                      const Tensor& beta) {
  METRALE_KERNEL_DISPATCH(gdn_gates, g.device(), a, b, A_log, dt_bias, g, beta);
}
inline void gated_delta_rule_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                     const Tensor& beta, const Tensor& state, const Tensor& cu_q,
                                     const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out,
                                     const GatedDeltaRuleParams& params) {
  METRALE_KERNEL_DISPATCH(gated_delta_rule_chunked, out.device(), q, k, v, g, beta, state, cu_q, kv_lens, state_slots,
                          out, params);
}
inline void gated_delta_rule_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                       const Tensor& beta, const Tensor& state, const Tensor& cu_q,
                                       const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out,
                                       const GatedDeltaRuleParams& params) {
  METRALE_KERNEL_DISPATCH(gated_delta_rule_recurrent, out.device(), q, k, v, g, beta, state, cu_q, kv_lens,
                          state_slots, out, params);
}

}  // namespace metrale::kernels
