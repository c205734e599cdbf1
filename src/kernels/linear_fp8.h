// Linear layer with FP8 block-scaled weights, without bias: out = x @ dequant(weight)^T, where
// dequant(weight)[n, k] = e4m3(weight[n, k]) * scale_inv[n / kFp8Block, k / kFp8Block] (the layout of
// the Hugging Face "fp8" quantization with weight_block_size [128, 128]: DeepSeek-V3, Qwen3-*-FP8).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/dispatch.h"

namespace metrale::kernels {

// Rows and columns of the weight that share one scale.
constexpr int64_t kFp8Block = 128;
constexpr int64_t fp8_scale_blocks(int64_t extent) { return (extent + kFp8Block - 1) / kFp8Block; }

// x [M, K] f32|bf16 (rows may be strided: stride(0) >= K, stride(1) == 1);
// weight [N, K] f8e4m3, contiguous rows; scale_inv [ceil(N/128), ceil(K/128)] f32, contiguous;
// out [M, N] f32|bf16 (row stride >= N). Accumulates in fp32. With `accumulate`, adds into out.
//
// CUDA: M <= cuda::fp8_gemv_max_rows() (decode; default 2) runs a GEMV that streams each weight row
// once and dequantises it in registers. Larger M with bf16 x (prefill, decode batches) quantises x to e4m3 per token
// and 128-wide K group (fp8_quantize.h) and runs one cuBLASLt FP8 GEMM with block scaling (fp32
// accumulation, out bf16 or f32); the result then carries the activation quantisation error
// (~2-4e-2 relative L2 on random data). f32 x, K or N not multiples of 16, misaligned operands, or a
// shape cuBLASLt refuses take the GEMV, 8 rows a pass.
METRALE_DECLARE_OP_IMPLS(linear_fp8, (const Tensor& x, const Tensor& weight, const Tensor& scale_inv,
                                      const Tensor& out, bool accumulate))

inline void linear_fp8(const Tensor& x, const Tensor& weight, const Tensor& scale_inv, const Tensor& out,
                       bool accumulate = false) {
  METRALE_KERNEL_DISPATCH(linear_fp8, out.device(), x, weight, scale_inv, out, accumulate);
}

#if METRALE_WITH_CUDA
namespace cuda {
// The crossover between the FP8 GEMV and the FP8 GEMM: M <= this runs the GEMV. The default is 2
// (measured: the GEMM wins from M = 4); the environment variable METRALE_FP8_GEMV_MAX_ROWS sets it at start-up, and
// benchmarks and tests may change it (not while other threads run linear_fp8).
int fp8_gemv_max_rows();
void set_fp8_gemv_max_rows(int rows);

// How many linear_fp8 calls took each CUDA path since the process started (tests and benchmarks
// read them to know what they measured).
struct LinearFp8PathCounts {
  uint64_t gemv_calls = 0;           // the GEMV alone
  uint64_t gemm_calls = 0;           // the cuBLASLt FP8 GEMM alone
  uint64_t gemm_with_gemv_tail = 0;  // the GEMM for the first M / 16 * 16 rows, the GEMV for the rest
  uint64_t refused_plans = 0;        // shapes cuBLASLt had no FP8 block-scaled algorithm for
  std::string last_refusal;          // the last refused shape and cuBLASLt's status
};
LinearFp8PathCounts linear_fp8_path_counts();
}  // namespace cuda
#endif

}  // namespace metrale::kernels
