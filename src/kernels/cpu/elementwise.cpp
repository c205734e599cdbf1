#include "kernels/elementwise.h"

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {

void add_inplace(const Tensor& dst, const Tensor& src) {
  METRALE_CHECK(dst.numel() == src.numel() && dst.is_contiguous() && src.is_contiguous() &&
                    dst.dtype() == DType::kF32,
                "add_inplace {} {}", dst.describe(), src.describe());
  auto* d = dst.data_as<float>();
  const int64_t n = dst.numel();
  cpu_pool().parallel_for(n, 1 << 14, [&](int64_t begin, int64_t end) {
    float* tmp = scratch_a(end - begin);
    const float* s = as_f32(src.dtype(), static_cast<const char*>(src.data()) + begin * static_cast<int64_t>(src.element_size()), tmp, end - begin);
    for (int64_t i = begin; i < end; ++i) d[i] += s[i - begin];
  });
}

void convert(const Tensor& src, const Tensor& dst) {
  METRALE_CHECK(dst.numel() == src.numel() && dst.is_contiguous() && src.is_contiguous(), "convert {} {}",
                src.describe(), dst.describe());
  const int64_t n = dst.numel();
  cpu_pool().parallel_for(n, 1 << 14, [&](int64_t begin, int64_t end) {
    float* tmp = scratch_a(end - begin);
    const float* s = as_f32(src.dtype(), static_cast<const char*>(src.data()) + begin * static_cast<int64_t>(src.element_size()), tmp, end - begin);
    store_f32(dst.dtype(), s, static_cast<char*>(dst.data()) + begin * static_cast<int64_t>(dst.element_size()), end - begin);
  });
}

}  // namespace metrale::kernels::cpu
