// Quantises activations to e4m3 per token and per 128-wide group along K (the "1x128" activation
// scaling of DeepSeek-style FP8 GEMMs): codes[m, k] = e4m3(x[m, k] / scale), with
// scale = amax(|x[m, g*128 .. g*128+127]|) / 448 for the group g holding k, and scale = 1 for a group
// of zeros (its codes are zero). x[m, k] ~= codes[m, k] * scale.
#pragma once

#include "kernels/dispatch.h"
#include "kernels/linear_fp8.h"

namespace metrale::kernels {

// The largest finite e4m3 value: a group's amax maps onto it.
constexpr float kE4M3Max = 448.0f;

// x [M, K] bf16|f32 (rows may be strided: stride(0) >= K, stride(1) == 1);
// codes [M, K] f8e4m3, contiguous; scales [ceil(K/128), M] f32, stride(1) == 1, stride(0) >= M: row g
// holds group g of every token, tokens adjacent. That is the layout cuBLASLt's
// CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F reads for an operand stored K-inner ([K, M] column-major)
// when stride(0) == round_up(M, 4) (16-byte rows; what Transformer Engine's "GEMM_READY" 1x128
// scales are). Padding entries of a row are left as they are.
// Division and rounding are IEEE (x / scale in fp32, round to nearest even, saturating to +-448), so
// the CPU and CUDA implementations give the same codes and scales bit for bit.
METRALE_DECLARE_OP_IMPLS(quantize_fp8_rows, (const Tensor& x, const Tensor& codes, const Tensor& scales))

inline void quantize_fp8_rows(const Tensor& x, const Tensor& codes, const Tensor& scales) {
  METRALE_KERNEL_DISPATCH(quantize_fp8_rows, codes.device(), x, codes, scales);
}

}  // namespace metrale::kernels
