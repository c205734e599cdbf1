// Linear layer with FP8 block-scaled weights, without bias: out = x @ dequant(weight)^T, where
// dequant(weight)[n, k] = e4m3(weight[n, k]) * scale_inv[n / kFp8Block, k / kFp8Block] (the layout of
// the Hugging Face "fp8" quantization with weight_block_size [128, 128]: DeepSeek-V3, Qwen3-*-FP8).
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// Rows and columns of the weight that share one scale.
constexpr int64_t kFp8Block = 128;
constexpr int64_t fp8_scale_blocks(int64_t extent) { return (extent + kFp8Block - 1) / kFp8Block; }

// x [M, K] f32|bf16 (rows may be strided: stride(0) >= K, stride(1) == 1);
// weight [N, K] f8e4m3, contiguous rows; scale_inv [ceil(N/128), ceil(K/128)] f32, contiguous;
// out [M, N] f32|bf16 (row stride >= N). Accumulates in fp32. With `accumulate`, adds into out.
//
// CUDA: a GEMV that streams each weight row once and dequantises it in registers, 8 input rows
// per pass (larger M takes more passes: correct, but no FP8 GEMM for prefill yet).
METRALE_DECLARE_OP_IMPLS(linear_fp8, (const Tensor& x, const Tensor& weight, const Tensor& scale_inv,
                                      const Tensor& out, bool accumulate))

inline void linear_fp8(const Tensor& x, const Tensor& weight, const Tensor& scale_inv, const Tensor& out,
                       bool accumulate = false) {
  METRALE_KERNEL_DISPATCH(linear_fp8, out.device(), x, weight, scale_inv, out, accumulate);
}

}  // namespace metrale::kernels
