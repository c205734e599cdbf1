// Hyper-connections (qwen.md §7.1, §5.5): the elementwise pieces around the mixing GEMMs, fused so
// that a site costs three small launches besides its GEMMs. With R [T, N*H] the N residual streams
// (stream n = channels [n*H, (n+1)*H)) and D the activation dtype, one connection site is
//
//   hc_norm   (update; R~ = D(zc_n(R; w)))    the previous site's injection (or PLE's add) fused in
//   GEMM      d = R~ W_down^T [T, r_hc], j = R~ W_inj^T [T, N]   (one GEMM over the concatenated weights)
//   hc_gates  a = D(silu(D(d / N)));  beta = 2 * D(sigmoid(D(j / N)))
//   GEMM      m' = a W_up^T [T, N*H]
//   hc_mix    x = D(mean_n D(D(sigmoid(m'_n)) * R~_n))   (fp32 sum over the streams, one rounding)
//   block     u = mixer or FFN(x) [T, H]
//   (the next site's hc_norm with kInject: R_n <- D(R_n + D(beta_n * u)))
//
// The final hyper_connection_mixer is hc_norm (kInject of the last FFN), GEMM down, hc_gates without
// the injection weights, GEMM up, hc_mix. zc_n is the grouped zero-centred RMSNorm: each stream has
// its own mean square and weights w[n*H : (n+1)*H], y = D(x * rsqrt(mean(x^2) + eps) * (1 + w)).
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// How hc_norm updates R (in place) before normalising it.
enum class HcUpdate {
  kNone,       // R unchanged
  kAdd,        // R <- D(R + a), a [T, N*H] (PLE: a = PLE(R))
  kInject,     // R_n <- D(R_n + D(b[t, n] * a)), a [T, H] the block output, b [T, N] the injection weights beta
  kBroadcast,  // R_n <- a for every stream, a [T, H] (the embedding: all streams start equal)
};

struct HcParams {
  int num_streams = 4;  // N (hc_count)
  float eps = 1e-6f;    // rms_norm_eps
  HcUpdate update = HcUpdate::kNone;
};

// residual [T, N*H] activation dtype D (rows may be strided, last dim contiguous), updated in place
// as params.update says; update_a, update_b as the mode says (empty when unused; rows may be
// strided; update_b [T, N] any float dtype, e.g. f32 or D); weight [N*H] any float dtype; normed
// [T, N*H] (output in D; may be empty: only the update runs; must not alias residual).
// CUDA: D bf16|f32; no metadata (graph-capturable).
METRALE_DECLARE_OP_IMPLS(hc_norm, (const Tensor& residual, const Tensor& update_a, const Tensor& update_b,
                                   const Tensor& weight, const Tensor& normed, const HcParams& params))

// down [T, r] and inject [T, N] (GEMM outputs in D, rows may be strided: e.g. column slices of one
// GEMM over [W_down; W_inj]); act [T, r], beta [T, N] outputs in D. inject and beta may both be
// empty (the final mixer). act = D(silu(D(down / N))); beta = 2 * D(sigmoid(D(inject / N))).
METRALE_DECLARE_OP_IMPLS(hc_gates, (const Tensor& down, const Tensor& inject, const Tensor& act, const Tensor& beta,
                                    const HcParams& params))

// up [T, N*H] (the W_up GEMM output), normed [T, N*H] (hc_norm's R~), x [T, H] output, all D, rows
// may be strided: x[t, c] = D(sum_n D(D(sigmoid(up[t, nH + c])) * normed[t, nH + c]) / N).
METRALE_DECLARE_OP_IMPLS(hc_mix, (const Tensor& up, const Tensor& normed, const Tensor& x, const HcParams& params))

// hc_gates, the W_up GEMM and hc_mix of one site as one op (the same roundings as the three ops
// with linear() between them; the GEMM's fp32 sum may run in another order):
//   act = hc_gates(down) [T, r]; beta = hc_gates(inject) when inject is given;
//   up = D(act . w_up^T) [T, N*H]; x = hc_mix(up, normed).
// down, inject, normed, x as the three ops; w_up [N*H, r] plain in D; act [T, r] and up [T, N*H]
// are the op's scratch in D (rows contiguous), left with those values where the op runs the three
// ops. CUDA: a bf16 W_up, T <= 4, N <= 4, r <= 512 and r % 8 == 0 run one kernel (the gates staged
// in shared memory per block, the N rows of an output channel dotted by one warp, which mixes them).
METRALE_DECLARE_OP_IMPLS(hc_gates_up_mix, (const Tensor& down, const Tensor& inject, const Tensor& w_up,
                                           const Tensor& normed, const Tensor& act, const Tensor& beta,
                                           const Tensor& up, const Tensor& x, const HcParams& params))

inline void hc_norm(const Tensor& residual, const Tensor& update_a, const Tensor& update_b, const Tensor& weight,
                    const Tensor& normed, const HcParams& params) {
  METRALE_KERNEL_DISPATCH(hc_norm, residual.device(), residual, update_a, update_b, weight, normed, params);
}
inline void hc_gates(const Tensor& down, const Tensor& inject, const Tensor& act, const Tensor& beta,
                     const HcParams& params) {
  METRALE_KERNEL_DISPATCH(hc_gates, act.device(), down, inject, act, beta, params);
}
inline void hc_mix(const Tensor& up, const Tensor& normed, const Tensor& x, const HcParams& params) {
  METRALE_KERNEL_DISPATCH(hc_mix, x.device(), up, normed, x, params);
}

inline void hc_gates_up_mix(const Tensor& down, const Tensor& inject, const Tensor& w_up, const Tensor& normed,
                            const Tensor& act, const Tensor& beta, const Tensor& up, const Tensor& x,
                            const HcParams& params) {
  METRALE_KERNEL_DISPATCH(hc_gates_up_mix, x.device(), down, inject, w_up, normed, act, beta, up, x, params);
}

}  // namespace metrale::kernels
