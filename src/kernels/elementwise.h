// Small elementwise ops.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// dst += src (same shape [N, D], contiguous). CPU: dst f32. CUDA: dst and src any of f32|bf16|f16,
// dst = D(dst + src) with one rounding to dst's dtype.
METRALE_DECLARE_OP_IMPLS(add_inplace, (const Tensor& dst, const Tensor& src))
// Copies rows: out[i] = src[rows[i]] is gather_rows; this converts a whole tensor between dtypes
// (f32|bf16|f16 to f32|bf16|f16, contiguous, round to nearest even on both devices).
METRALE_DECLARE_OP_IMPLS(convert, (const Tensor& src, const Tensor& dst))

inline void add_inplace(const Tensor& dst, const Tensor& src) {
  METRALE_KERNEL_DISPATCH(add_inplace, dst.device(), dst, src);
}
inline void convert(const Tensor& src, const Tensor& dst) { METRALE_KERNEL_DISPATCH(convert, dst.device(), src, dst); }

}  // namespace metrale::kernels
