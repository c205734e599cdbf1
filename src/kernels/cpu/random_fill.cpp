#include "kernels/random_fill.h"

#include <cmath>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {


void random_fill(const Tensor& out, const RandomFillParams& params) {
  METRALE_CHECK(out.is_contiguous(), "random_fill needs a contiguous tensor");
  const int64_t n = out.numel();
  cpu_pool().parallel_for(n, 1 << 14, [&](int64_t begin, int64_t end) {
    float* values = scratch_a(end - begin);
    for (int64_t i = begin; i < end; ++i) {
      values[i - begin] = random_normal_at(params.seed, static_cast<uint64_t>(i), params.mean, params.stddev);
    }
    store_f32(out.dtype(), values, static_cast<char*>(out.data()) + begin * static_cast<int64_t>(out.element_size()),
              end - begin);
  });
}

}  // namespace metrale::kernels::cpu
