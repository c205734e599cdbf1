// PLE gating (qwen.md §7.2 f), fused: the three grouped zero-centred norms, the per-stream gate and
// the gated value, in one pass per (token, stream). What comes before is two GEMMs on the gathered
// embedding E (key = key_proj(E) [T, N*H], value = value_proj(E) [T, H]); what comes after is the
// dilated causal conv of G_hat with G as its residual (causal_conv1d with dilation = n_max and
// `residual`, giving PLE(R) = D(G + C)), then hc_norm's kAdd update R <- D(R + PLE(R)).
//
// Per token and stream n (H channels, D = the activation dtype, zc(x; w) = x * rsqrt(mean(x^2) +
// eps) * (1 + w) in fp32):
//   k_n = D(zc(key_n; w_key_n))            q_n = D(zc(R_n; w_query_n))
//   s_n = D(D(sum_c D(k_n[c] * q_n[c])) / sqrt(H))   (the sum in fp32, one rounding)
//   s^_n = sign(s_n) * D(sqrt(D(max(|s_n|, 1e-6))))   (s_n = 0 gives 0)
//   G_n = D(D(sigmoid(s^_n)) * value)       G^_n = D(zc(G_n; w_conv_n))
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

struct PleGateParams {
  int num_streams = 4;  // N (hc_count)
  float eps = 1e-6f;    // rms_norm_eps
};

// key [T, N*H], value [T, H], residual [T, N*H] (rows may be strided, last dim contiguous; one
// activation dtype f32|bf16); key_norm_weight, query_norm_weight, conv_norm_weight [N*H] any float
// dtype; gated, gated_normed [T, N*H] activation dtype (outputs, rows may be strided, must not alias
// the inputs). CUDA: activations bf16|f32, metadata-free (graph-capturable).
METRALE_DECLARE_OP_IMPLS(ple_gate, (const Tensor& key, const Tensor& value, const Tensor& residual,
                                    const Tensor& key_norm_weight, const Tensor& query_norm_weight,
                                    const Tensor& conv_norm_weight, const Tensor& gated, const Tensor& gated_normed,
                                    const PleGateParams& params))

inline void ple_gate(const Tensor& key, const Tensor& value, const Tensor& residual, const Tensor& key_norm_weight,
                     const Tensor& query_norm_weight, const Tensor& conv_norm_weight, const Tensor& gated,
                     const Tensor& gated_normed, const PleGateParams& params) {
  METRALE_KERNEL_DISPATCH(ple_gate, gated.device(), key, value, residual, key_norm_weight, query_norm_weight,
                          conv_norm_weight, gated, gated_normed, params);
}

}  // namespace metrale::kernels
