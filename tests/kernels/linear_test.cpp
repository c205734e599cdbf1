// kernels::linear (out = x @ W^T) against a double reference: f32 / bf16 / f16 weights, f32 and
// bf16 inputs, sizes that are not multiples of the kernel's 4/8/16 blocking, strided input and
// output rows, and the accumulate flag.
#include "kernels/linear.h"

#include <gtest/gtest.h>

#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using testing::Random;

// out[m, n] = (accumulate ? previous[m, n] : 0) + sum_k x[m, k] w[n, k]
std::vector<double> reference_linear(const std::vector<double>& x, const std::vector<double>& w, int64_t m, int64_t k,
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

struct LinearShape {
  int64_t m, k, n;
};
const LinearShape kShapes[] = {{1, 1, 1},  {3, 5, 7},    {5, 17, 9},   {2, 33, 13},
                               {4, 64, 8}, {7, 100, 31}, {1, 129, 67}, {9, 48, 4}};

struct LinearCase {
  DType x_dtype, weight_dtype;
  bool accumulate;
};

class LinearTest : public ::testing::TestWithParam<LinearCase> {};

TEST_P(LinearTest, MatchesReferenceOnAwkwardSizes) {
  const LinearCase c = GetParam();
  Random rng(401);
  for (const auto [m, k, n] : kShapes) {
    SCOPED_TRACE(::testing::Message() << "m " << m << " k " << k << " n " << n);
    const OwnedTensor x = random_tensor(c.x_dtype, {m, k}, rng);
    const OwnedTensor w = random_tensor(c.weight_dtype, {n, k}, rng);
    OwnedTensor out(DType::kF32, {m, n});
    std::vector<double> previous;
    if (c.accumulate) {
      testing::fill_random(*out, rng, -3.0f, 3.0f);
      previous = testing::to_doubles(*out);
    } else {
      testing::poison(*out);
    }
    kernels::linear(*x, *w, *out, c.accumulate);
    const auto expected =
        reference_linear(testing::to_doubles(*x), testing::to_doubles(*w), m, k, n, c.accumulate ? &previous : nullptr);
    EXPECT_TRUE(testing::close_rel_l2(*out, expected, testing::kF32Tolerance));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Dtypes, LinearTest,
    ::testing::Values(LinearCase{DType::kF32, DType::kF32, false}, LinearCase{DType::kF32, DType::kBF16, false},
                      LinearCase{DType::kF32, DType::kF16, false}, LinearCase{DType::kBF16, DType::kBF16, false},
                      LinearCase{DType::kF32, DType::kF32, true}, LinearCase{DType::kF32, DType::kBF16, true},
                      LinearCase{DType::kF32, DType::kF16, true}));

TEST(Linear, StridedInputAndOutputRows) {
  Random rng(402);
  for (const DType weight_dtype : {DType::kF32, DType::kBF16}) {
    for (const bool accumulate : {false, true}) {
      const int64_t m = 6, k = 27, n = 19;
      const OwnedTensor x_wide = random_tensor(DType::kF32, {m, k + 5}, rng);
      const Tensor x = x_wide->slice(1, 3, 3 + k);  // row stride k + 5, offset start
      const OwnedTensor w = random_tensor(weight_dtype, {n, k}, rng);
      const OwnedTensor out_wide = random_tensor(DType::kF32, {m, n + 4}, rng);
      const Tensor out = out_wide->slice(1, 2, 2 + n);
      const std::vector<uint8_t> left = testing::element_bytes(out_wide->slice(1, 0, 2));
      const std::vector<uint8_t> right = testing::element_bytes(out_wide->slice(1, 2 + n, n + 4));
      const std::vector<double> previous = testing::to_doubles(out);
      if (!accumulate) testing::poison(out);
      kernels::linear(x, *w, out, accumulate);
      const auto expected =
          reference_linear(testing::to_doubles(x), testing::to_doubles(*w), m, k, n, accumulate ? &previous : nullptr);
      EXPECT_TRUE(testing::close_rel_l2(out, expected, testing::kF32Tolerance)) << "accumulate " << accumulate;
      EXPECT_EQ(testing::element_bytes(out_wide->slice(1, 0, 2)), left);
      EXPECT_EQ(testing::element_bytes(out_wide->slice(1, 2 + n, n + 4)), right);
    }
  }
}

TEST(Linear, WeightRowsSlicedFromAFusedTensor) {
  // The MoE block feeds gate and up halves of a fused [2I, H] expert: row slices of a contiguous tensor.
  Random rng(403);
  const int64_t m = 5, k = 24, i = 11;
  const OwnedTensor x = random_tensor(DType::kF32, {m, k}, rng);
  const OwnedTensor fused = random_tensor(DType::kBF16, {2 * i, k}, rng);
  const Tensor up = fused->slice(0, i, 2 * i);
  OwnedTensor out(DType::kF32, {m, i});
  testing::poison(*out);
  kernels::linear(*x, up, *out);
  EXPECT_TRUE(
      testing::close_rel_l2(*out, reference_linear(testing::to_doubles(*x), testing::to_doubles(up), m, k, i, nullptr),
                            testing::kF32Tolerance));
}

TEST(Linear, Bf16Output) {
  Random rng(404);
  const int64_t m = 4, k = 40, n = 21;
  const OwnedTensor x = random_tensor(DType::kF32, {m, k}, rng);
  const OwnedTensor w = random_tensor(DType::kBF16, {n, k}, rng);
  for (const bool accumulate : {false, true}) {
    OwnedTensor out = random_tensor(DType::kBF16, {m, n}, rng);
    const std::vector<double> previous = testing::to_doubles(*out);
    if (!accumulate) testing::poison(*out);
    kernels::linear(*x, *w, *out, accumulate);
    EXPECT_TRUE(testing::close_rel_l2(
        *out,
        reference_linear(testing::to_doubles(*x), testing::to_doubles(*w), m, k, n, accumulate ? &previous : nullptr),
        testing::kBf16OutputTolerance));
  }
}

TEST(Linear, EmptyBatchAndShapeErrors) {
  Random rng(405);
  const OwnedTensor w = random_tensor(DType::kF32, {3, 4}, rng);
  OwnedTensor x_empty(DType::kF32, {0, 4});
  OwnedTensor out_empty(DType::kF32, {0, 3});
  EXPECT_NO_THROW(kernels::linear(*x_empty, *w, *out_empty));
  const OwnedTensor x = random_tensor(DType::kF32, {2, 5}, rng);
  OwnedTensor out(DType::kF32, {2, 3});
  EXPECT_THROW(kernels::linear(*x, *w, *out), Error);  // k mismatch
  const OwnedTensor w_wide = random_tensor(DType::kF32, {3, 8}, rng);
  const OwnedTensor x4 = random_tensor(DType::kF32, {2, 4}, rng);
  EXPECT_THROW(kernels::linear(*x4, w_wide->slice(1, 0, 4), *out), Error);  // weight rows not contiguous
}

}  // namespace
}  // namespace metrale
