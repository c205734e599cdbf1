// The CUDA FP8 linear is not written yet: Weights::get_linear refuses FP8 weights on a GPU at load,
// so this entry point is reached only by a direct call.
#include "kernels/linear_fp8.h"

#include "core/error.h"

namespace metrale::kernels::cuda {

void linear_fp8(const Tensor& x, const Tensor& weight, const Tensor& scale_inv, const Tensor& out, bool accumulate) {
  (void)x;
  (void)scale_inv;
  (void)out;
  (void)accumulate;
  raise(ErrorCode::kUnsupported, "kernel linear_fp8: no CUDA implementation yet (weight {})", weight.describe());
}

}  // namespace metrale::kernels::cuda
