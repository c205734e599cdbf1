// Linear layer without bias: out = x @ weight^T.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// x [M, K] f32|bf16 (rows may be strided: stride(0) >= K, stride(1) == 1);
// weight [N, K] f32|bf16|f16, contiguous rows; out [M, N] (row stride >= N).
// Accumulates in fp32. With `accumulate`, adds into out instead of overwriting it.
//
// CUDA: the fast paths take bf16 x and bf16 weights, with out bf16 or f32:
//   M <= gemv_max_rows() (default 2): a hand-written GEMV that streams each weight row once;
//   larger M: cuBLASLt (fp32 accumulation), plans cached per shape; the heuristic is asked once per
//   M bucket (powers of two up to 64K rows, then multiples of 16K) and each exact shape takes its
//   bucket's algorithm when cublasLtMatmulAlgoCheck accepts it.
// f32 x, weight and out (f32 runs) take cuBLASLt at every M with CUBLAS_COMPUTE_32F (no TF32).
// Other dtypes, K not a multiple of 8 or misaligned pointers take a simple, slower kernel.
METRALE_DECLARE_OP_IMPLS(linear, (const Tensor& x, const Tensor& weight, const Tensor& out, bool accumulate))

inline void linear(const Tensor& x, const Tensor& weight, const Tensor& out, bool accumulate = false) {
  METRALE_KERNEL_DISPATCH(linear, out.device(), x, weight, out, accumulate);
}

#if METRALE_WITH_CUDA
namespace cuda {
// Creates the device's cuBLASLt handle and its 32 MiB workspace. Call once per device before
// capturing CUDA graphs (a first cuBLASLt call made during a capture raises kInternal instead of
// allocating). Idempotent and thread-safe.
void linear_prepare(int device_index);
// The crossover between the GEMV and cuBLASLt: M <= this runs the GEMV (at most 16). The default
// is 2 (the GEMV crossover table in docs/perf.md); the environment variable METRALE_GEMV_MAX_ROWS
// sets it at start-up, and benchmarks and tests may change it (not while other threads run linear).
int gemv_max_rows();
void set_gemv_max_rows(int rows);
// cuBLASLt plans of the device since start-up (bf16/f32 linear): exact-shape plans built, heuristic
// queries (one per M bucket, plus the shapes whose bucket algorithm failed its check), and plans
// that took their bucket's algorithm.
struct LinearPlanStats {
  int64_t plans = 0;
  int64_t heuristic_queries = 0;
  int64_t bucket_algorithms_taken = 0;
};
LinearPlanStats linear_plan_stats(int device_index);
}  // namespace cuda
#endif

// Prepares the device for linear (see cuda::linear_prepare); a no-op on the CPU.
inline void linear_prepare(Device device) {
#if METRALE_WITH_CUDA
  if (device.is_cuda()) cuda::linear_prepare(device.index);
#else
  (void)device;
#endif
}

}  // namespace metrale::kernels
