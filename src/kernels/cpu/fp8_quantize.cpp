#include "kernels/fp8_quantize.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {

void quantize_fp8_rows(const Tensor& x, const Tensor& codes, const Tensor& scales) {
  METRALE_CHECK(x.ndim() == 2 && codes.ndim() == 2 && scales.ndim() == 2, "quantize_fp8_rows ranks: {} {} {}",
                x.describe(), codes.describe(), scales.describe());
  const int64_t m = x.size(0), k = x.size(1), groups = fp8_scale_blocks(k);
  METRALE_CHECK(codes.size(0) == m && codes.size(1) == k && codes.dtype() == DType::kF8E4M3 && codes.is_contiguous(),
                "quantize_fp8_rows codes {} for x {}", codes.describe(), x.describe());
  METRALE_CHECK(scales.size(0) == groups && scales.size(1) == m && scales.dtype() == DType::kF32 &&
                    scales.stride(1) == 1 && (groups <= 1 || scales.stride(0) >= m),
                "quantize_fp8_rows scales {} for x {} (want [{}, {}] f32)", scales.describe(), x.describe(), groups, m);
  METRALE_CHECK(x.stride(1) == 1 && x.stride(0) >= k, "quantize_fp8_rows needs contiguous rows: x {}", x.describe());
  METRALE_CHECK(x.dtype() == DType::kBF16 || x.dtype() == DType::kF32, "quantize_fp8_rows: x {}", x.describe());
  auto* code_bytes = static_cast<uint8_t*>(codes.data());
  float* scale_values = scales.data_as<float>();
  std::vector<float> row(static_cast<size_t>(k));
  for (int64_t r = 0; r < m; ++r) {
    const float* values = as_f32(x.dtype(), row_ptr(x, r), row.data(), k);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t begin = g * kFp8Block, end = std::min(k, begin + kFp8Block);
      float amax = 0.0f;
      for (int64_t c = begin; c < end; ++c) amax = std::max(amax, std::fabs(values[c]));
      const float scale = amax > 0.0f ? amax / kE4M3Max : 1.0f;
      scale_values[g * scales.stride(0) + r] = scale;
      for (int64_t c = begin; c < end; ++c) code_bytes[r * k + c] = f32_to_f8e4m3_bits(values[c] / scale);
    }
  }
}

}  // namespace metrale::kernels::cpu
