#include "kernels/activation.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {

void silu_mul(const Tensor& gate, const Tensor& up, const Tensor& out, float limit) {
  METRALE_CHECK(gate.ndim() == 2 && up.ndim() == 2 && out.ndim() == 2, "silu_mul ranks");
  const int64_t rows = out.size(0), width = out.size(1);
  METRALE_CHECK(gate.size(0) == rows && gate.size(1) == width && up.size(0) == rows && up.size(1) == width,
                "silu_mul shapes {} {} {}", gate.describe(), up.describe(), out.describe());
  cpu_pool().parallel_for(rows, 4, [&](int64_t begin, int64_t end) {
    float* g = scratch_a(2 * width);
    float* u = g + width;
    float* o = scratch_b(width);
    for (int64_t r = begin; r < end; ++r) {
      const float* gv = as_f32(gate.dtype(), row_ptr(gate, r), g, width);
      const float* uv = as_f32(up.dtype(), row_ptr(up, r), u, width);
      for (int64_t i = 0; i < width; ++i) {
        const float gc = limit > 0.0f ? std::min(gv[i], limit) : gv[i];
        const float uc = limit > 0.0f ? std::clamp(uv[i], -limit, limit) : uv[i];
        o[i] = gc / (1.0f + std::exp(-gc)) * uc;
      }
      store_f32(out.dtype(), o, row_ptr_mut(out, r), width);
    }
  });
}

}  // namespace metrale::kernels::cpu
