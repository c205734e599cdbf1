// kernels::rms_norm and add_rms_norm against a double reference, plain and zero-centred, on
// contiguous, 3-D and strided (row stride > width) tensors, in place, and with bf16 inputs/outputs.
#include "kernels/rms_norm.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using kernels::RmsNormKind;
using kernels::RmsNormParams;
using testing::Random;

// y[r, i] = x[r, i] / sqrt(mean_i(x[r, i]^2) + eps) * (w[i] | 1 + w[i]).
std::vector<double> reference_rms_norm(const std::vector<double>& x, const std::vector<double>& w, int64_t width,
                                       const RmsNormParams& params) {
  std::vector<double> y(x.size());
  const double offset = params.kind == RmsNormKind::kZeroCentered ? 1.0 : 0.0;
  for (size_t row = 0; row < x.size() / static_cast<size_t>(width); ++row) {
    double sum = 0.0;
    for (int64_t i = 0; i < width; ++i)
      sum += x[row * static_cast<size_t>(width) + static_cast<size_t>(i)] *
             x[row * static_cast<size_t>(width) + static_cast<size_t>(i)];
    const double inv = 1.0 / std::sqrt(sum / static_cast<double>(width) + static_cast<double>(params.eps));
    for (int64_t i = 0; i < width; ++i) {
      const size_t at = row * static_cast<size_t>(width) + static_cast<size_t>(i);
      y[at] = x[at] * inv * (offset + w[static_cast<size_t>(i)]);
    }
  }
  return y;
}

struct NormCase {
  RmsNormKind kind;
  DType x_dtype, weight_dtype, out_dtype;
};

class RmsNormTest : public ::testing::TestWithParam<NormCase> {};

TEST_P(RmsNormTest, MatchesReference) {
  const NormCase c = GetParam();
  Random rng(201);
  const int64_t rows = 19, width = 67;
  const RmsNormParams params{1e-5f, c.kind};
  // Weights near 1 for plain norms and near 0 for zero-centred ones, as checkpoints hold them.
  const float w_lo = c.kind == RmsNormKind::kPlain ? 0.5f : -0.5f;
  const OwnedTensor x = random_tensor(c.x_dtype, {rows, width}, rng, -2.0f, 2.0f);
  const OwnedTensor weight = random_tensor(c.weight_dtype, {width}, rng, w_lo, w_lo + 1.0f);
  OwnedTensor out(c.out_dtype, {rows, width});
  testing::poison(*out);
  kernels::rms_norm(*x, *weight, *out, params);
  const auto expected = reference_rms_norm(testing::to_doubles(*x), testing::to_doubles(*weight), width, params);
  const double tolerance = c.out_dtype == DType::kF32 ? testing::kF32Tolerance : testing::kBf16OutputTolerance;
  EXPECT_TRUE(testing::close_rel_l2(*out, expected, tolerance));
}

INSTANTIATE_TEST_SUITE_P(Variants, RmsNormTest,
                         ::testing::Values(NormCase{RmsNormKind::kPlain, DType::kF32, DType::kF32, DType::kF32},
                                           NormCase{RmsNormKind::kZeroCentered, DType::kF32, DType::kF32, DType::kF32},
                                           NormCase{RmsNormKind::kPlain, DType::kF32, DType::kBF16, DType::kF32},
                                           NormCase{RmsNormKind::kZeroCentered, DType::kF32, DType::kBF16, DType::kF32},
                                           NormCase{RmsNormKind::kPlain, DType::kBF16, DType::kBF16, DType::kF32},
                                           NormCase{RmsNormKind::kPlain, DType::kF32, DType::kF16, DType::kF32},
                                           NormCase{RmsNormKind::kPlain, DType::kBF16, DType::kBF16, DType::kBF16}));

TEST(RmsNorm, ThreeDimensionalInputNormalisesEachHead) {
  // [T, heads, head_dim], as the per-head q/k norms use it.
  Random rng(202);
  const RmsNormParams params{1e-6f, RmsNormKind::kPlain};
  const OwnedTensor x = random_tensor(DType::kF32, {5, 3, 16}, rng, -3.0f, 3.0f);
  const OwnedTensor weight = random_tensor(DType::kBF16, {16}, rng, 0.5f, 1.5f);
  OwnedTensor out(DType::kF32, {5, 3, 16});
  testing::poison(*out);
  kernels::rms_norm(*x, *weight, *out, params);
  const auto expected = reference_rms_norm(testing::to_doubles(*x), testing::to_doubles(*weight), 16, params);
  EXPECT_TRUE(testing::close_rel_l2(*out, expected, testing::kF32Tolerance));
}

TEST(RmsNorm, StridedRowsReadAndWriteOnlyTheirWidth) {
  Random rng(203);
  const int64_t rows = 9, width = 24, pad = 7;
  for (const RmsNormKind kind : {RmsNormKind::kPlain, RmsNormKind::kZeroCentered}) {
    const RmsNormParams params{1e-6f, kind};
    const OwnedTensor x_wide = random_tensor(DType::kF32, {rows, width + pad}, rng);
    const OwnedTensor out_wide = random_tensor(DType::kF32, {rows, width + 2 * pad}, rng);
    const Tensor x = x_wide->slice(1, pad, pad + width);  // row stride width + pad, offset start
    const Tensor out = out_wide->slice(1, 0, width);      // row stride width + 2 pad
    const Tensor out_padding = out_wide->slice(1, width, width + 2 * pad);
    const std::vector<uint8_t> padding_before = testing::element_bytes(out_padding);
    testing::poison(out);
    const OwnedTensor weight = random_tensor(DType::kF32, {width}, rng, -0.5f, 1.5f);
    kernels::rms_norm(x, *weight, out, params);
    const auto expected = reference_rms_norm(testing::to_doubles(x), testing::to_doubles(*weight), width, params);
    EXPECT_TRUE(testing::close_rel_l2(out, expected, testing::kF32Tolerance));
    EXPECT_EQ(testing::element_bytes(out_padding), padding_before) << "wrote outside the view";
  }
}

TEST(RmsNorm, InPlace) {
  Random rng(204);
  const RmsNormParams params{1e-6f, RmsNormKind::kZeroCentered};
  const OwnedTensor x = random_tensor(DType::kF32, {6, 33}, rng);
  const OwnedTensor weight = random_tensor(DType::kF32, {33}, rng, -0.5f, 0.5f);
  const auto expected = reference_rms_norm(testing::to_doubles(*x), testing::to_doubles(*weight), 33, params);
  kernels::rms_norm(*x, *weight, *x, params);
  EXPECT_TRUE(testing::close_rel_l2(*x, expected, testing::kF32Tolerance));
}

TEST(RmsNorm, EpsilonMatters) {
  // Tiny inputs make eps dominate: a kernel that ignored or misplaced eps would be far off.
  Random rng(205);
  const RmsNormParams params{1e-2f, RmsNormKind::kPlain};
  const OwnedTensor x = random_tensor(DType::kF32, {3, 20}, rng, -0.05f, 0.05f);
  const OwnedTensor weight = random_tensor(DType::kF32, {20}, rng, 0.5f, 1.5f);
  OwnedTensor out(DType::kF32, {3, 20});
  kernels::rms_norm(*x, *weight, *out, params);
  const auto expected = reference_rms_norm(testing::to_doubles(*x), testing::to_doubles(*weight), 20, params);
  EXPECT_TRUE(testing::close_rel_l2(*out, expected, testing::kF32Tolerance));
}

class AddRmsNormTest : public ::testing::TestWithParam<RmsNormKind> {};

TEST_P(AddRmsNormTest, UpdatesResidualAndNormalisesIt) {
  Random rng(206);
  const int64_t rows = 13, width = 40, pad = 5;
  const RmsNormParams params{1e-6f, GetParam()};
  const OwnedTensor residual_wide = random_tensor(DType::kF32, {rows, width + pad}, rng, -2.0f, 2.0f);
  const OwnedTensor x_wide = random_tensor(DType::kF32, {rows, width + 2 * pad}, rng);
  const OwnedTensor out_wide = random_tensor(DType::kF32, {rows, width + pad}, rng);
  const Tensor residual = residual_wide->slice(1, 0, width);
  const Tensor x = x_wide->slice(1, pad, pad + width);
  const Tensor out = out_wide->slice(1, pad, pad + width);
  const OwnedTensor weight = random_tensor(DType::kBF16, {width}, rng, -0.5f, 1.5f);
  const std::vector<double> residual_before = testing::to_doubles(residual), x_values = testing::to_doubles(x);
  const std::vector<uint8_t> residual_padding = testing::element_bytes(residual_wide->slice(1, width, width + pad));
  const std::vector<uint8_t> out_padding = testing::element_bytes(out_wide->slice(1, 0, pad));
  testing::poison(out);

  kernels::add_rms_norm(residual, x, *weight, out, params);

  // The residual is the fp32 sum (one IEEE rounding per element).
  std::vector<double> expected_residual(residual_before.size());
  for (size_t i = 0; i < expected_residual.size(); ++i) {
    expected_residual[i] = static_cast<float>(static_cast<float>(residual_before[i]) + static_cast<float>(x_values[i]));
  }
  EXPECT_EQ(testing::to_doubles(residual), expected_residual);
  const auto expected = reference_rms_norm(expected_residual, testing::to_doubles(*weight), width, params);
  EXPECT_TRUE(testing::close_rel_l2(out, expected, testing::kF32Tolerance));
  EXPECT_EQ(testing::element_bytes(residual_wide->slice(1, width, width + pad)), residual_padding);
  EXPECT_EQ(testing::element_bytes(out_wide->slice(1, 0, pad)), out_padding);
}

INSTANTIATE_TEST_SUITE_P(Kinds, AddRmsNormTest, ::testing::Values(RmsNormKind::kPlain, RmsNormKind::kZeroCentered));

TEST(AddRmsNorm, Bf16InputAndOutputInPlaceOverTheInput) {
  Random rng(207);
  const RmsNormParams params{1e-6f, RmsNormKind::kPlain};
  const OwnedTensor residual = random_tensor(DType::kF32, {4, 32}, rng);
  const OwnedTensor x = random_tensor(DType::kBF16, {4, 32}, rng);
  const OwnedTensor weight = random_tensor(DType::kF32, {32}, rng, 0.5f, 1.5f);
  std::vector<double> sum = testing::to_doubles(*residual);
  const std::vector<double> x_values = testing::to_doubles(*x);
  for (size_t i = 0; i < sum.size(); ++i)
    sum[i] = static_cast<float>(static_cast<float>(sum[i]) + static_cast<float>(x_values[i]));
  kernels::add_rms_norm(*residual, *x, *weight, *x, params);
  EXPECT_EQ(testing::to_doubles(*residual), sum);
  EXPECT_TRUE(testing::close_rel_l2(*x, reference_rms_norm(sum, testing::to_doubles(*weight), 32, params),
                                    testing::kBf16OutputTolerance));
}

TEST(AddRmsNorm, RejectsANonF32Residual) {
  Random rng(208);
  const OwnedTensor residual = random_tensor(DType::kBF16, {2, 8}, rng);
  const OwnedTensor x = random_tensor(DType::kF32, {2, 8}, rng);
  const OwnedTensor weight = random_tensor(DType::kF32, {8}, rng);
  OwnedTensor out(DType::kF32, {2, 8});
  EXPECT_THROW(kernels::add_rms_norm(*residual, *x, *weight, *out, {}), Error);
  const OwnedTensor short_weight = random_tensor(DType::kF32, {7}, rng);
  EXPECT_THROW(kernels::rms_norm(*x, *short_weight, *out, {}), Error);
}

}  // namespace
}  // namespace metrale
