// Kimi Delta Attention (KDA) core over a ragged batch (glm_deepseek.md §2.5): the forget gate and
// beta, and the per-channel-decay delta rule in two forms that compute the same thing, the chunked
// (WY, chunk 64) form for prefill and the token-by-token recurrent form for decode and speculative
// verify. The gates are computed inside both forms from the raw projections, so no [T, H, dk] f32
// decay tensor ever goes through memory.
//
// Per head h and token t, with fp32 state S [dk, dv] (key rows x value columns):
//   phi = f_t[h*dk + d] + dt_bias[h*dk + d], A_h = exp(A_log[h])                   (fp32)
//   g_t[d] = lower_bound * sigmoid(A_h phi)          (KdaParams::has_lower_bound, the default)
//          = -A_h softplus(phi)                      (otherwise; softplus(x) = x for x > 20, else log(1 + e^x))
//   beta_t = D(sigmoid(b_t[h]))                      (the sigmoid rounded to the activation dtype D)
//   q = q / sqrt(sum(q^2) + 1e-6) * scale,  k = k / sqrt(sum(k^2) + 1e-6)      (fp32)
//   S <- diag(exp(g_t)) S;  delta = beta_t (v_t - S^T k);  S <- S + k delta^T;  o_t = S^T q
// The output is rounded to D once. Batch layout as in attention.h; sequence s reads its initial
// state from state[state_slots[s]] (zero when ctx_s = kv_lens[s] - q_len_s is 0, whatever the slot
// holds) and leaves the state after its last row there.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

struct KdaParams {
  float scale = 1.0f;           // applied to q after the l2 norm; dk^-0.5 in the model
  bool has_lower_bound = true;  // linear_lower_bound set: the bounded sigmoid gate; false: softplus
  float lower_bound = -5.0f;    // lambda < 0 of the bounded gate (g in (lambda, 0))
  int64_t max_q_len = 0;        // host upper bound of q_len over the batch (0: not given), for planning
  // CUDA scratch of the chunked form: at least kda_workspace_bytes(...) bytes on the device, 256-byte
  // aligned; nothing survives the call. Unused on the CPU and by the recurrent form.
  Tensor workspace;
  // Recurrent form only, optional: [T, H, dk, dv] f32; when given, row t receives the state after
  // token t (a speculative verify keeps the state of every draft row for its commit).
  Tensor row_states;
  // Recurrent form only: false reads the slots and leaves them as they were (a speculative verify).
  // The chunked form requires true.
  bool write_state = true;
};

// Gates alone (the reference the fused kernels are tested against, and for callers that want them):
// f [T, H*dk] activations (rows may be strided); b [T, H] activations (rows may be strided);
// A_log [H], dt_bias [H*dk] any float dtype; g [T, H, dk] f32 and beta [T, H] f32, contiguous.
METRALE_DECLARE_OP_IMPLS(kda_gates, (const Tensor& f, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                                     const Tensor& g, const Tensor& beta, const KdaParams& params))

// q, k [T, H, dk] and v [T, H, dv] activations (strided rows and heads allowed, e.g. column slices of
// the conv output; the last dim contiguous); f [T, H*dk] and b [T, H] as for kda_gates; A_log [H],
// dt_bias [H*dk]; state [num_slots, H, dk, dv] f32, contiguous; cu_q [S+1], kv_lens [S],
// state_slots [S] i32 on the device; out [T, H, dv] activation dtype (last dim contiguous).
// A slot of -1 has no state: the sequence starts from zero and its final state is discarded (both
// forms).
// CUDA: bf16 or f32 activations; metadata read on the device only (graph-capturable). The chunked
// form runs on tensor cores for bf16 with dk = 128 and dv a multiple of 64 (rows 16-byte aligned);
// other shapes take the recurrent kernel row by row (same function, slower).
METRALE_DECLARE_OP_IMPLS(kda_chunked,
                         (const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f, const Tensor& b,
                          const Tensor& A_log, const Tensor& dt_bias, const Tensor& state, const Tensor& cu_q,
                          const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out,
                          const KdaParams& params))
METRALE_DECLARE_OP_IMPLS(kda_recurrent,
                         (const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f, const Tensor& b,
                          const Tensor& A_log, const Tensor& dt_bias, const Tensor& state, const Tensor& cu_q,
                          const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out,
                          const KdaParams& params))

// Bytes of KdaParams::workspace the CUDA chunked form needs for a batch within these bounds on
// `device` (0 on the CPU): per chunk of 64 rows and head, the inverse T = (I + A)^-1 as two bf16
// 64x64 matrices and the intra-chunk q.k matrix in bf16 (24 KiB), plus the chunk offsets.
size_t kda_workspace_bytes(Device device, int64_t num_tokens, int64_t num_seqs, int64_t num_heads,
                           int64_t key_head_dim, int64_t value_head_dim);

inline void kda_gates(const Tensor& f, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, const Tensor& g,
                      const Tensor& beta, const KdaParams& params) {
  METRALE_KERNEL_DISPATCH(kda_gates, g.device(), f, b, A_log, dt_bias, g, beta, params);
}
inline void kda_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f, const Tensor& b,
                        const Tensor& A_log, const Tensor& dt_bias, const Tensor& state, const Tensor& cu_q,
                        const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out,
                        const KdaParams& params) {
  METRALE_KERNEL_DISPATCH(kda_chunked, out.device(), q, k, v, f, b, A_log, dt_bias, state, cu_q, kv_lens,
                          state_slots, out, params);
}
inline void kda_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f, const Tensor& b,
                          const Tensor& A_log, const Tensor& dt_bias, const Tensor& state, const Tensor& cu_q,
                          const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out,
                          const KdaParams& params) {
  METRALE_KERNEL_DISPATCH(kda_recurrent, out.device(), q, k, v, f, b, A_log, dt_bias, state, cu_q, kv_lens,
                          state_slots, out, params);
}

}  // namespace metrale::kernels
