#include "kernels/linear.h"

#include "kernels/cpu/linear_rows.h"

namespace metrale::kernels::cpu {

void linear(const Tensor& x, const Tensor& weight, const Tensor& out, bool accumulate) {
  METRALE_CHECK(x.ndim() == 2 && weight.ndim() == 2 && out.ndim() == 2, "linear ranks: {} {} {}", x.describe(),
                weight.describe(), out.describe());
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  METRALE_CHECK(weight.size(1) == k && out.size(0) == m && out.size(1) == n, "linear shapes: x {} w {} out {}",
                x.describe(), weight.describe(), out.describe());
  METRALE_CHECK(x.stride(1) == 1 && weight.stride(1) == 1 && weight.stride(0) == k && out.stride(1) == 1,
                "linear needs contiguous rows");
  if (m == 0 || n == 0) return;

  linear_rows(x, out, n, accumulate, [&](int64_t n0, int64_t rows, float* scratch) -> const float* {
    if (weight.dtype() == DType::kF32) return weight.data_as<const float>() + n0 * k;
    convert_to_f32(weight.dtype(), row_ptr(weight, n0), scratch, static_cast<size_t>(rows * k));
    return scratch;
  });
}

}  // namespace metrale::kernels::cpu
