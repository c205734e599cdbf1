// Manifold-constrained hyper-connections (mHC, glm_deepseek.md §2.4): n residual streams per token
// X [n, D], mixed around every sub-layer by maps computed from the streams themselves.
//
// mhc_pre, per token (fp32 throughout, fn/base/scale at their stored precision):
//   f = flatten(X) [n*D];  rho = f * rsqrt(mean(f^2) + norm_eps)             (unweighted RMSNorm)
//   m = fn . rho [(2+n)n];  m_pre = m[0:n], m_post = m[n:2n], m_comb[a][c] = m[2n + a*n + c]
//   pre_j  = sigmoid(m_pre_j  * scale[0] + base[j]) + hc_eps
//   post_j = 2 sigmoid(m_post_j * scale[1] + base[n + j])
//   M = softmax_c(m_comb * scale[2] + base[2n:]) + hc_eps;  M <- M / (colsum(M) + hc_eps);
//   (sinkhorn_iters - 1) times: M <- M / (rowsum(M) + hc_eps); M <- M / (colsum(M) + hc_eps)
//   h = D(sum_j pre_j X_j)                                                       (the sub-layer input)
// mhc_post, per token and column d (the reference's rounding points in the activation dtype D):
//   X'_c[d] = D( D(D(post_c) * y[d]) + D(sum_a D(M_ac) X_a[d]) )                 (M transposed)
// mhc_mean: out[d] = D(mean_j X_j[d]), the model's final collapse.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

struct MhcParams {
  int sinkhorn_iters = 20;  // hc_sinkhorn_iters (>= 1)
  float hc_eps = 1e-6f;     // Sinkhorn and pre eps
  float norm_eps = 1e-5f;   // rms_norm_eps of the unweighted RMSNorm over the n*D stream values
  // CUDA scratch of mhc_pre's split reduction: mhc_pre_workspace_bytes(...) bytes on the device. Its
  // arrival counters must be zero when the buffer is first used (allocate it zeroed); every call
  // leaves them zero again, so one buffer serves every site of every step. Unused on the CPU.
  Tensor workspace;
};

// X [T, n, D] activations (streams and columns contiguous: X.stride(1) == D; rows may be strided);
// fn [(2+n)n, n*D] (contiguous), base [(2+n)n], scale [3], any float dtype; post [T, n] and
// comb [T, n, n] f32 (comb[t][a][c] = M_ac), contiguous; h [T, D] activation dtype (rows may be
// strided). One pass over X and fn per token tile: on the GPU one kernel per site.
METRALE_DECLARE_OP_IMPLS(mhc_pre, (const Tensor& X, const Tensor& fn, const Tensor& base, const Tensor& scale,
                                  const Tensor& post, const Tensor& comb, const Tensor& h,
                                  const MhcParams& params))

// X, out [T, n, D] activations (as for mhc_pre; out may alias X); y [T, D] (the sub-layer output);
// post [T, n], comb [T, n, n] f32 from mhc_pre.
METRALE_DECLARE_OP_IMPLS(mhc_post, (const Tensor& X, const Tensor& y, const Tensor& post, const Tensor& comb,
                                   const Tensor& out))

// X [T, n, D]; out [T, D] (rows may be strided).
METRALE_DECLARE_OP_IMPLS(mhc_mean, (const Tensor& X, const Tensor& out))

// Bytes of MhcParams::workspace mhc_pre needs on `device` for up to `num_tokens` tokens
// of n streams of width D (0 on the CPU).
size_t mhc_pre_workspace_bytes(Device device, int64_t num_tokens, int64_t num_streams, int64_t hidden_size);

inline void mhc_pre(const Tensor& X, const Tensor& fn, const Tensor& base, const Tensor& scale, const Tensor& post,
                   const Tensor& comb, const Tensor& h, const MhcParams& params) {
  METRALE_KERNEL_DISPATCH(mhc_pre, h.device(), X, fn, base, scale, post, comb, h, params);
}
inline void mhc_post(const Tensor& X, const Tensor& y, const Tensor& post, const Tensor& comb, const Tensor& out) {
  METRALE_KERNEL_DISPATCH(mhc_post, out.device(), X, y, post, comb, out);
}
inline void mhc_mean(const Tensor& X, const Tensor& out) { METRALE_KERNEL_DISPATCH(mhc_mean, out.device(), X, out); }

}  // namespace metrale::kernels
