#include "kernels/linear_fp8.h"

#include <array>

#include "kernels/cpu/linear_rows.h"

namespace metrale::kernels::cpu {
namespace {

// Every E4M3 code's value (NaN codes decode to NaN).
const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (size_t code = 0; code < values.size(); ++code) values[code] = f8e4m3_bits_to_f32(static_cast<uint8_t>(code));
    return values;
  }();
  return table;
}

}  // namespace

void linear_fp8(const Tensor& x, const Tensor& weight, const Tensor& scale_inv, const Tensor& out, bool accumulate) {
  METRALE_CHECK(x.ndim() == 2 && weight.ndim() == 2 && out.ndim() == 2 && scale_inv.ndim() == 2,
                "linear_fp8 ranks: {} {} {} {}", x.describe(), weight.describe(), scale_inv.describe(), out.describe());
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  METRALE_CHECK(weight.size(1) == k && out.size(0) == m && out.size(1) == n, "linear_fp8 shapes: x {} w {} out {}",
                x.describe(), weight.describe(), out.describe());
  METRALE_CHECK(weight.dtype() == DType::kF8E4M3 && scale_inv.dtype() == DType::kF32,
                "linear_fp8 dtypes: w {} scales {}", weight.describe(), scale_inv.describe());
  METRALE_CHECK(
      scale_inv.size(0) == fp8_scale_blocks(n) && scale_inv.size(1) == fp8_scale_blocks(k) && scale_inv.is_contiguous(),
      "linear_fp8 scales {} for weight {} (block {})", scale_inv.describe(), weight.describe(), kFp8Block);
  METRALE_CHECK(x.stride(1) == 1 && weight.stride(1) == 1 && weight.stride(0) == k && out.stride(1) == 1,
                "linear_fp8 needs contiguous rows");
  if (m == 0 || n == 0) return;

  const std::array<float, 256>& values = e4m3_values();
  const auto* codes = static_cast<const uint8_t*>(weight.data());
  const float* scales = scale_inv.data_as<const float>();
  const int64_t scale_cols = scale_inv.size(1);
  linear_rows(x, out, n, accumulate, [&](int64_t n0, int64_t rows, float* scratch) -> const float* {
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = codes + (n0 + r) * k;
      const float* row_scales = scales + ((n0 + r) / kFp8Block) * scale_cols;
      float* dst = scratch + r * k;
      for (int64_t c = 0; c < k; ++c) dst[c] = values[row[c]] * row_scales[c / kFp8Block];
    }
    return scratch;
  });
}

}  // namespace metrale::kernels::cpu
