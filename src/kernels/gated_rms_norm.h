// Gated RMSNorm (the GDN output norm, qwen.md §3.1), per row of D (= one value head of dv):
//   n = x * rsqrt(mean(x^2) + eps);  t = D(w * D(n));  y = D(t * silu(z))
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// x, z, out [T, Hv, D] activations (any strides with the last dim contiguous; z is usually a column
// slice of a projection); weight [D] any float dtype. out may alias x. The CPU computes in fp32.
METRALE_DECLARE_OP_IMPLS(gated_rms_norm, (const Tensor& x, const Tensor& z, const Tensor& weight, const Tensor& out,
                                          float eps))

inline void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, const Tensor& out, float eps) {
  METRALE_KERNEL_DISPATCH(gated_rms_norm, out.device(), x, z, weight, out, eps);
}

}  // namespace metrale::kernels
