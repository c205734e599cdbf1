// RMSNorm and its fused residual variant.
//   plain:         y = w * (x / sqrt(mean(x^2) + eps))
//   zero-centred:  y = (1 + w) * (x / sqrt(mean(x^2) + eps))
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

enum class RmsNormKind { kPlain, kZeroCentered };

struct RmsNormParams {
  float eps = 1e-6f;
  RmsNormKind kind = RmsNormKind::kPlain;
};

// x [N, D] (any leading shape flattened to rows of D, contiguous) f32|bf16; weight [D]; out like x.
// out may alias x.
//
// CUDA: x, out (and residual) share one dtype D, bf16 or f32; weight f32|bf16|f16; rows may be any
// [A, B, D] view with a contiguous last dim (e.g. head slices of a fused projection). Rounds like
// transformers in D (qwen.md §3.1): plain y = D(w * D(n)), n = x * rsqrt(mean(x^2) + eps) in fp32;
// zero-centred y = D(n * (1 + w)), one rounding. The CPU computes in fp32 throughout (the reference).
METRALE_DECLARE_OP_IMPLS(rms_norm, (const Tensor& x, const Tensor& weight, const Tensor& out,
                                    const RmsNormParams& params))
// residual += x; out = rms_norm(residual). residual, x, out [N, D]. Saves a pass over the hidden
// state between sublayers. CPU: residual is f32. CUDA: residual has x's dtype and becomes
// D(residual + x), as transformers' `hidden = residual + hidden` in D; out must not alias residual.
METRALE_DECLARE_OP_IMPLS(add_rms_norm, (const Tensor& residual, const Tensor& x, const Tensor& weight,
                                        const Tensor& out, const RmsNormParams& params))

inline void rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, const RmsNormParams& params) {
  METRALE_KERNEL_DISPATCH(rms_norm, out.device(), x, weight, out, params);
}
inline void add_rms_norm(const Tensor& residual, const Tensor& x, const Tensor& weight, const Tensor& out,
                         const RmsNormParams& params) {
  METRALE_KERNEL_DISPATCH(add_rms_norm, out.device(), residual, x, weight, out, params);
}

}  // namespace metrale::kernels
