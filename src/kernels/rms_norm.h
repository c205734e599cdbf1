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
METRALE_DECLARE_OP_IMPLS(rms_norm, (const Tensor& x, const Tensor& weight, const Tensor& out,
                                    const RmsNormParams& params))
// residual += x; out = rms_norm(residual). residual, x, out [N, D]. Saves a pass over the hidden
// state between sublayers.
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
