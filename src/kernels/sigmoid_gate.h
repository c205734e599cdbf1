// The output gate of gated attention (qwen.md §3.5): out = x * sigmoid(gate), elementwise.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// x, gate, out [A, B, D] with any strides in the two leading dims and a contiguous last dim (gate is
// usually the gate half of gated attention's q_proj output, [T, heads, head_dim] with a head stride of
// 2 * head_dim); out may alias x. All three share one dtype D on CUDA (bf16 or f32).
// Rounding as transformers' `attn_output * torch.sigmoid(gate)` in D: out = D(x * D(sigmoid(gate))).
// The CPU computes in fp32.
METRALE_DECLARE_OP_IMPLS(sigmoid_gate, (const Tensor& x, const Tensor& gate, const Tensor& out))

inline void sigmoid_gate(const Tensor& x, const Tensor& gate, const Tensor& out) {
  METRALE_KERNEL_DISPATCH(sigmoid_gate, out.device(), x, gate, out);
}

}  // namespace metrale::kernels
