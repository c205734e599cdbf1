// Rotary position embedding, rotate-half (NeoX) layout: channel j pairs with j + rotary_dim/2 for
// j < rotary_dim/2; channels >= rotary_dim pass through.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

struct RopeParams {
  int rotary_dim = 0;              // even, <= head_dim
  float attention_scaling = 1.0f;  // multiplies cos and sin (YaRN); 1 for default RoPE
};

// x [T, n_heads, head_dim] f32|bf16, rotated in place; positions [T] i32;
// inv_freq [rotary_dim / 2] f32 (angle of channel i at position p is p * inv_freq[i]).
// x may be a strided view (last dim contiguous; e.g. the query half of gated attention's q_proj).
// CUDA: rounds like transformers in x's dtype D (qwen.md §3.2): cos, sin = D(cos(p * inv_freq) * s),
// D(sin(...) * s), then D(D(x * cos) + D(rotate_half(x) * sin)); accurate sincosf (positions reach
// 100k+). The CPU computes in fp32 without the intermediate roundings.
METRALE_DECLARE_OP_IMPLS(rope, (const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                                const RopeParams& params))

inline void rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, const RopeParams& params) {
  METRALE_KERNEL_DISPATCH(rope, x.device(), x, positions, inv_freq, params);
}

}  // namespace metrale::kernels
