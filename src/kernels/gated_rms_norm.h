// Gated RMSNorm, per row of D (= one value head of dv), in one of two forms:
//   kSilu (the GDN output norm, qwen.md §3.1), rounding in the activation dtype D as transformers:
//     n = x * rsqrt(mean(x^2) + eps);  t = D(w * D(n));  y = D(t * silu(z))
//   kSigmoid (the KDA output norm Glm5NextTextRMSNormGated, glm_deepseek.md §2.5), all in fp32:
//     y = D(w * (x * rsqrt(mean(x^2) + eps)) * sigmoid(z))
//   kSigmoidRounded (qwen4_exp's GDN output norm with output_gate_type "sigmoid", qwen.md §3.1): the
//     roundings of kSilu with the sigmoid gate: t = D(w * D(n)); y = D(t * sigmoid(z))
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

enum class GatedNormGate { kSilu, kSigmoid, kSigmoidRounded };

// x, z, out [T, Hv, D] activations (any strides with the last dim contiguous; z is usually a column
// slice of a projection); weight [D] any float dtype. out may alias x. The CPU computes in fp32.
METRALE_DECLARE_OP_IMPLS(gated_rms_norm, (const Tensor& x, const Tensor& z, const Tensor& weight, const Tensor& out,
                                          float eps, GatedNormGate gate))

inline void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, const Tensor& out, float eps,
                           GatedNormGate gate = GatedNormGate::kSilu) {
  METRALE_KERNEL_DISPATCH(gated_rms_norm, out.device(), x, z, weight, out, eps, gate);
}

}  // namespace metrale::kernels
