// kernels::quantize_fp8_rows on the CPU: the scale of every (token, 128-wide group) is its amax / 448
// in the [groups, M] layout (rows padded to round_up(M, 4)), a group of zeros gets scale 1 and zero codes, the amax
// element maps to
// +-448, and every value round-trips within half an e4m3 step (relative 2^-4, or 2^-10 * scale
// among the subnormals); strided rows and a partial last group included.
#include "kernels/fp8_quantize.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using kernels::kFp8Block;
using testing::Random;

TEST(Fp8Quantize, ScalesLayoutAndRoundTrip) {
  Random rng(7301);
  for (const DType dtype : {DType::kBF16, DType::kF32}) {
    for (const auto& [m, k] : {std::pair<int64_t, int64_t>{1, 128}, {5, 200}, {9, 1000}, {3, 4104}}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " m " << m << " k " << k);
      const int64_t groups = kernels::fp8_scale_blocks(k);
      const OwnedTensor wide = testing::random_tensor(dtype, {m, k + 5}, rng, -3.0f, 3.0f);
      const Tensor x = wide->slice(1, 0, k);
      // Row 0's second group (when there is one) all zero; row m-1's first group spans 1e-6 .. 1e3.
      if (groups > 1) {
        for (int64_t c = kFp8Block; c < std::min(k, 2 * kFp8Block); ++c)
          testing::store_element(dtype, x.data(), c, 0.0f);
      }
      for (int64_t c = 0; c < std::min(k, kFp8Block); ++c) {
        const float magnitude = std::pow(10.0f, -6.0f + 9.0f * static_cast<float>(c) / kFp8Block);
        testing::store_element(dtype, x.data(), (m - 1) * x.stride(0) + c, c % 2 ? -magnitude : magnitude);
      }
      OwnedTensor codes(DType::kF8E4M3, {m, k});
      // Rows of round_up(M, 4) floats, as cuBLASLt reads them; the padding must stay untouched.
      const int64_t pitch = (m + 3) / 4 * 4;
      OwnedTensor scale_rows(DType::kF32, {groups, pitch});
      testing::poison(*scale_rows);
      const Tensor scales = scale_rows->slice(1, 0, m);
      kernels::quantize_fp8_rows(x, *codes, scales);
      const std::vector<double> values = testing::to_doubles(x);
      const auto* code_bytes = static_cast<const uint8_t*>(codes->data());
      const float* scale_values = scale_rows->data_as<const float>();
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t c = m; c < pitch; ++c) ASSERT_TRUE(std::isnan(scale_values[g * pitch + c])) << "padding written";
      }
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t begin = g * kFp8Block, end = std::min(k, begin + kFp8Block);
          float amax = 0.0f;
          for (int64_t c = begin; c < end; ++c) amax = std::max(amax, static_cast<float>(std::fabs(values[r * k + c])));
          const float scale = scale_values[g * pitch + r];
          ASSERT_EQ(scale, amax > 0.0f ? amax / kernels::kE4M3Max : 1.0f) << "row " << r << " group " << g;
          for (int64_t c = begin; c < end; ++c) {
            const double value = values[r * k + c];
            const double decoded = static_cast<double>(f8e4m3_bits_to_f32(code_bytes[r * k + c])) * scale;
            const double bound = std::max(std::fabs(value) * 0x1p-4, static_cast<double>(scale) * 0x1p-10) * 1.0001;
            ASSERT_LE(std::fabs(decoded - value), bound) << "row " << r << " column " << c << ": " << value;
            if (std::fabs(value) == amax && amax > 0.0f) {
              ASSERT_EQ(code_bytes[r * k + c] & 0x7fu, 0x7eu) << "the amax element must map to 448";
            }
          }
        }
      }
    }
  }
}

TEST(Fp8Quantize, RejectsMisshapedScales) {
  OwnedTensor x(DType::kBF16, {4, 256});
  OwnedTensor codes(DType::kF8E4M3, {4, 256});
  OwnedTensor row_major_scales(DType::kF32, {4, 2});  // [M, groups]: not the layout cuBLASLt reads
  EXPECT_THROW(kernels::quantize_fp8_rows(*x, *codes, *row_major_scales), Error);
}

}  // namespace
}  // namespace metrale
