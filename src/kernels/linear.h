// Linear layer without bias: out = x @ weight^T.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// x [M, K] f32|bf16 (rows may be strided: stride(0) >= K, stride(1) == 1);
// weight [N, K] f32|bf16|f16, contiguous rows; out [M, N] (row stride >= N).
// Accumulates in fp32. With `accumulate`, adds into out instead of overwriting it.
METRALE_DECLARE_OP_IMPLS(linear, (const Tensor& x, const Tensor& weight, const Tensor& out, bool accumulate))

inline void linear(const Tensor& x, const Tensor& weight, const Tensor& out, bool accumulate = false) {
  METRALE_KERNEL_DISPATCH(linear, out.device(), x, weight, out, accumulate);
}

}  // namespace metrale::kernels
