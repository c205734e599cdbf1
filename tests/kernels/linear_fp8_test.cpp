// kernels::linear_fp8 (out = x @ dequant(W)^T with 128x128 block scales) against a double-precision
// reference that dequantises every weight itself: shapes whose N and K are not multiples of the
// block (partial scale blocks at both edges), f32 and bf16 inputs and outputs, accumulate, strided rows.
#include "kernels/linear_fp8.h"

#include <gtest/gtest.h>

#include "kernels/kernel_helpers.h"
#include "kernels/linear_weight.h"

namespace metrale {
namespace {

using kernels::kFp8Block;
using testing::Random;

struct Fp8Weight {
  OwnedTensor codes;                // [N, K] f8e4m3
  OwnedTensor scales;               // [ceil(N/128), ceil(K/128)] f32
  std::vector<double> dequantised;  // [N, K]
};

// Random finite E4M3 codes (every exponent, both signs) and a different scale for each block.
Fp8Weight random_fp8_weight(int64_t n, int64_t k, Random& rng) {
  Fp8Weight w{OwnedTensor(DType::kF8E4M3, {n, k}),
              OwnedTensor(DType::kF32, {kernels::fp8_scale_blocks(n), kernels::fp8_scale_blocks(k)}),
              {}};
  auto* codes = static_cast<uint8_t*>(w.codes->data());
  for (int64_t i = 0; i < n * k; ++i) {
    uint8_t code;
    do {
      code = static_cast<uint8_t>(rng.integer(0, 255));
    } while ((code & 0x7fu) == 0x7fu);  // NaN
    codes[i] = code;
  }
  testing::fill_random(*w.scales, rng, 1e-3f, 4e-3f);
  const float* scales = w.scales->data_as<const float>();
  w.dequantised.resize(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const double scale = scales[(r / kFp8Block) * w.scales->size(1) + c / kFp8Block];
      w.dequantised[static_cast<size_t>(r * k + c)] = static_cast<double>(f8e4m3_bits_to_f32(codes[r * k + c])) * scale;
    }
  }
  return w;
}

std::vector<double> reference(const std::vector<double>& x, const std::vector<double>& w, int64_t m, int64_t k,
                              int64_t n, const std::vector<double>* previous) {
  std::vector<double> out(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      double sum = previous ? (*previous)[static_cast<size_t>(r * n + c)] : 0.0;
      for (int64_t i = 0; i < k; ++i) sum += x[static_cast<size_t>(r * k + i)] * w[static_cast<size_t>(c * k + i)];
      out[static_cast<size_t>(r * n + c)] = sum;
    }
  }
  return out;
}

struct Shape3 {
  int64_t m, k, n;
};
constexpr Shape3 kShapes[] = {{1, 1, 1}, {3, 130, 200}, {2, 256, 128}, {5, 300, 129}, {1, 127, 257}};

TEST(LinearFp8, MatchesDequantisedReference) {
  Random rng(811);
  for (const DType x_dtype : {DType::kF32, DType::kBF16}) {
    for (const bool accumulate : {false, true}) {
      for (const auto [m, k, n] : kShapes) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(x_dtype) << " accumulate " << accumulate << " m " << m << " k " << k << " n " << n);
        const Fp8Weight w = random_fp8_weight(n, k, rng);
        const OwnedTensor x = testing::random_tensor(x_dtype, {m, k}, rng);
        OwnedTensor out(DType::kF32, {m, n});
        std::vector<double> previous;
        if (accumulate) {
          testing::fill_random(*out, rng, -3.0f, 3.0f);
          previous = testing::to_doubles(*out);
        } else {
          testing::poison(*out);
        }
        kernels::linear_fp8(*x, *w.codes, *w.scales, *out, accumulate);
        const auto expected =
            reference(testing::to_doubles(*x), w.dequantised, m, k, n, accumulate ? &previous : nullptr);
        EXPECT_TRUE(testing::close_rel_l2(*out, expected, testing::kF32Tolerance));
      }
    }
  }
}

TEST(LinearFp8, Bf16OutputAndStridedRowsThroughLinearWeight) {
  Random rng(812);
  const int64_t m = 4, k = 150, n = 140;
  const Fp8Weight w = random_fp8_weight(n, k, rng);
  const OwnedTensor x_wide = testing::random_tensor(DType::kBF16, {m, k + 6}, rng);
  const Tensor x = x_wide->slice(1, 2, 2 + k);
  const OwnedTensor out_wide(DType::kBF16, {m, n + 3});
  testing::poison(*out_wide);
  const Tensor out = out_wide->slice(1, 1, 1 + n);
  const std::vector<uint8_t> left = testing::element_bytes(out_wide->slice(1, 0, 1));
  const kernels::LinearWeight weight(*w.codes, *w.scales);
  ASSERT_TRUE(weight.is_fp8());
  kernels::linear(x, weight, out);
  EXPECT_TRUE(testing::close_rel_l2(out, reference(testing::to_doubles(x), w.dequantised, m, k, n, nullptr), 1e-2));
  EXPECT_EQ(testing::element_bytes(out_wide->slice(1, 0, 1)), left);
}

TEST(LinearFp8, RejectsMisShapedScales) {
  Random rng(813);
  const Fp8Weight w = random_fp8_weight(130, 20, rng);
  const OwnedTensor x = testing::random_tensor(DType::kF32, {1, 20}, rng);
  OwnedTensor out(DType::kF32, {1, 130});
  const OwnedTensor short_scales(DType::kF32, {1, 1});  // 130 rows need 2 row blocks
  EXPECT_ANY_THROW(kernels::linear_fp8(*x, *w.codes, *short_scales, *out));
}

}  // namespace
}  // namespace metrale
