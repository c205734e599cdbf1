// Gated activations.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// out[t, i] = silu(gate[t, i]) * up[t, i]. gate, up, out [T, I] (row strides may exceed I so that
// gate and up can be the two halves of one fused projection).
// limit L > 0 gives the clamped SwiGLU (swiglu_limit, glm_deepseek.md §1): gate <- min(gate, L) and
// up <- clamp(up, -L, L) first; 0 leaves them as they are.
// CUDA: gate, up and out share one dtype D (bf16 or f32); out = D(D(silu(gate)) * up), silu rounded to D
// before the product as transformers computes it (qwen.md §3.3).
METRALE_DECLARE_OP_IMPLS(silu_mul, (const Tensor& gate, const Tensor& up, const Tensor& out, float limit))

inline void silu_mul(const Tensor& gate, const Tensor& up, const Tensor& out, float limit = 0.0f) {
  METRALE_KERNEL_DISPATCH(silu_mul, out.device(), gate, up, out, limit);
}

}  // namespace metrale::kernels
