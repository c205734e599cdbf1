// Causal depthwise 1-D convolution over a ragged batch, with a per-sequence window of past inputs
// kept in a state slot: the short convolution in front of Gated DeltaNet (qwen.md §6.2 and §8,
// dilation 1) and PLE's dilated convolution (§7.2 g, dilation n_max, with its gated value G added).
//
// Batch layout as in attention.h: S sequences; sequence s owns rows [cu_q[s], cu_q[s+1]) and has
// ctx_s = kv_lens[s] - q_len_s tokens before this step. With K taps, dilation d and L = (K-1)*d
// history rows, its window of inputs is
//   W_s = (ctx_s == 0 ? L zero rows : conv_state[state_slots[s]]) ++ x[cu_q[s] : cu_q[s+1]]
// and output row i (of the sequence) is
//   out[c] = residual[c] + act( sum_{j<K} weight[c, j] * W_s[i + j*d][c] )   (residual when given)
// After the call conv_state[state_slots[s]] holds the last L rows of W_s (oldest first), also
// when q_len_s < L (unless params.write_state is false). A slot of -1 has no state: the sequence
// starts from L zero rows and its window is not kept (rows a speculative commit discards).
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

struct CausalConv1dParams {
  bool silu = true;       // act = silu (true) or identity
  int64_t max_q_len = 0;  // host upper bound of q_len over the batch (0: not given), for planning
  // false: the slots are read, never updated (a speculative verify keeps them for its commit).
  bool write_state = true;
  int dilation = 1;  // d >= 1: tap j of output row t reads input row t - (K-1-j)*d (CUDA: 1..4)
  // Optional [T, C] in the activation dtype (rows may be strided): out = D(residual + D(act(conv))).
  Tensor residual = {};
  // true: the fp32 sum is rounded to the activation dtype before the activation (Qwen's conv, whose
  // weights are in the activation dtype); false: the activation runs on the fp32 sum and only its
  // result is rounded (KDA's fp32 conv, glm_deepseek.md §2.5). No effect without silu.
  bool round_conv = true;
};

// x [T, C] activations (rows may be strided, channels contiguous); weight [C, K] (conv1d.weight
// [C, 1, K] viewed as [C, K]), any float dtype; conv_state [num_slots, (K-1)*dilation, C] activation dtype,
// contiguous; cu_q [S+1], kv_lens [S], state_slots [S] i32 on x's device; out [T, C] activation dtype,
// must not alias x.
// Rounding (qwen.md §6.2, §7.2 g-h): the convolution accumulates in fp32 and is rounded to the
// activation dtype once, then the activation is applied and rounded again (with round_conv false:
// rounded once, after the activation), then the residual is added and the sum rounded. The CPU
// (f32 activations) is the reference.
// CUDA: bf16 x/out/conv_state; metadata read on the device only (graph-capturable).
METRALE_DECLARE_OP_IMPLS(causal_conv1d, (const Tensor& x, const Tensor& weight, const Tensor& conv_state,
                                         const Tensor& cu_q, const Tensor& kv_lens, const Tensor& state_slots,
                                         const Tensor& out, const CausalConv1dParams& params))

inline void causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& conv_state, const Tensor& cu_q,
                          const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out,
                          const CausalConv1dParams& params) {
  METRALE_KERNEL_DISPATCH(causal_conv1d, out.device(), x, weight, conv_state, cu_q, kv_lens, state_slots, out,
                          params);
}

}  // namespace metrale::kernels
