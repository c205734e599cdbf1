#include "kernels/rope.h"

#include <cmath>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {

void rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, const RopeParams& params) {
  METRALE_CHECK(x.ndim() == 3 && x.stride(2) == 1, "rope x {}", x.describe());
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const int half = params.rotary_dim / 2;
  METRALE_CHECK(params.rotary_dim % 2 == 0 && params.rotary_dim <= head_dim, "rope rotary_dim {}", params.rotary_dim);
  METRALE_CHECK(inv_freq.numel() == half && inv_freq.dtype() == DType::kF32, "rope inv_freq {}", inv_freq.describe());
  METRALE_CHECK(positions.numel() == tokens, "rope positions");
  const auto* freq = inv_freq.data_as<const float>();
  const auto* pos = positions.data_as<const int32_t>();
  cpu_pool().parallel_for(tokens, 4, [&](int64_t begin, int64_t end) {
    float* cos_v = scratch_a(2 * half + head_dim);
    float* sin_v = cos_v + half;
    float* row = sin_v + half;
    for (int64_t t = begin; t < end; ++t) {
      // Same order of operations as the reference: angle = p * inv_freq in fp32, then cos/sin, then scale.
      for (int i = 0; i < half; ++i) {
        const float angle = static_cast<float>(pos[t]) * freq[i];
        cos_v[i] = std::cos(angle) * params.attention_scaling;
        sin_v[i] = std::sin(angle) * params.attention_scaling;
      }
      for (int64_t h = 0; h < heads; ++h) {
        void* ptr = static_cast<char*>(x.data()) +
                    (t * x.stride(0) + h * x.stride(1)) * static_cast<int64_t>(x.element_size());
        convert_to_f32(x.dtype(), ptr, row, static_cast<size_t>(head_dim));
        for (int i = 0; i < half; ++i) {
          const float a = row[i], b = row[i + half];
          row[i] = a * cos_v[i] - b * sin_v[i];
          row[i + half] = b * cos_v[i] + a * sin_v[i];
        }
        store_f32(x.dtype(), row, ptr, head_dim);
      }
    }
  });
}

}  // namespace metrale::kernels::cpu
