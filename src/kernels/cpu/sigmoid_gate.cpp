#include "kernels/sigmoid_gate.h"

#include <cmath>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

char* row_at(const Tensor& t, int64_t a, int64_t b) {
  return static_cast<char*>(t.data()) + (a * t.stride(0) + b * t.stride(1)) * static_cast<int64_t>(t.element_size());
}

}  // namespace

void sigmoid_gate(const Tensor& x, const Tensor& gate, const Tensor& out) {
  METRALE_CHECK(x.ndim() == 3 && gate.ndim() == 3 && out.ndim() == 3, "sigmoid_gate: x {} gate {} out {}", x.describe(),
                gate.describe(), out.describe());
  const int64_t outer = x.size(0), inner = x.size(1), width = x.size(2);
  for (const Tensor* t : {&gate, &out}) {
    METRALE_CHECK(t->size(0) == outer && t->size(1) == inner && t->size(2) == width && t->stride(2) == 1,
                  "sigmoid_gate: {} for x {}", t->describe(), x.describe());
  }
  METRALE_CHECK(x.stride(2) == 1, "sigmoid_gate: x {} needs a contiguous last dim", x.describe());
  cpu_pool().parallel_for(outer * inner, 16, [&](int64_t begin, int64_t end) {
    float* xs = scratch_a(2 * width);
    float* gs = xs + width;
    for (int64_t row = begin; row < end; ++row) {
      const int64_t a = row / inner, b = row % inner;
      convert_to_f32(x.dtype(), row_at(x, a, b), xs, static_cast<size_t>(width));
      convert_to_f32(gate.dtype(), row_at(gate, a, b), gs, static_cast<size_t>(width));
      for (int64_t i = 0; i < width; ++i) xs[i] *= 1.0f / (1.0f + std::exp(-gs[i]));
      store_f32(out.dtype(), xs, row_at(out, a, b), width);
    }
  });
}

}  // namespace metrale::kernels::cpu
