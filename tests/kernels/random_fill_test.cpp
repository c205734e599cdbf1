// kernels::random_fill: element i holds random_normal_at(seed, i) (the value every device must
// produce), rounded to the tensor's dtype; and the values are normally distributed with the
// requested mean and standard deviation.
#include "kernels/random_fill.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

kernels::RandomFillParams fill_params(uint64_t seed, float mean, float stddev) {
  kernels::RandomFillParams params;
  params.seed = seed;
  params.mean = mean;
  params.stddev = stddev;
  return params;
}

TEST(RandomFill, EveryElementIsItsCounterValue) {
  const int64_t n = 50000;  // several parallel ranges
  OwnedTensor f32(DType::kF32, {n / 100, 100});
  OwnedTensor bf16(DType::kBF16, {n});
  testing::poison(*f32);
  kernels::random_fill(*f32, fill_params(42, 0.5f, 2.0f));
  kernels::random_fill(*bf16, fill_params(42, 0.5f, 2.0f));
  const auto* f = f32->data_as<const float>();
  const auto* b = bf16->data_as<const uint16_t>();
  for (int64_t i = 0; i < n; ++i) {
    const float expected = kernels::random_normal_at(42, static_cast<uint64_t>(i), 0.5f, 2.0f);
    ASSERT_EQ(f[i], expected) << i;
    ASSERT_EQ(b[i], f32_to_bf16_bits(expected)) << i;
  }
}

TEST(RandomFill, SeedsGiveDifferentStreams) {
  OwnedTensor a(DType::kF32, {1000}), b(DType::kF32, {1000}), again(DType::kF32, {1000});
  kernels::random_fill(*a, fill_params(1, 0.0f, 1.0f));
  kernels::random_fill(*b, fill_params(2, 0.0f, 1.0f));
  kernels::random_fill(*again, fill_params(1, 0.0f, 1.0f));
  EXPECT_EQ(testing::element_bytes(*a), testing::element_bytes(*again));
  int equal = 0;
  for (int64_t i = 0; i < 1000; ++i) equal += a->data_as<float>()[i] == b->data_as<float>()[i];
  EXPECT_LT(equal, 5);
}

TEST(RandomFill, MomentsMatchTheRequestedNormal) {
  const int64_t n = 200000;
  OwnedTensor values(DType::kF32, {n});
  kernels::random_fill(*values, fill_params(7, -1.5f, 0.25f));
  double sum = 0.0, sum_sq = 0.0, fourth = 0.0;
  int64_t within_one_sigma = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = values->data_as<float>()[i];
    ASSERT_TRUE(std::isfinite(v));
    sum += v;
    sum_sq += v * v;
  }
  const double mean = sum / static_cast<double>(n);
  const double variance = sum_sq / static_cast<double>(n) - mean * mean;
  for (int64_t i = 0; i < n; ++i) {
    const double z = (values->data_as<float>()[i] - mean) / std::sqrt(variance);
    fourth += z * z * z * z;
    within_one_sigma += std::fabs(z) < 1.0;
  }
  // Standard errors at n = 2e5: mean 0.25/447 = 6e-4; std ~0.2 %; kurtosis ~0.011; the 1-sigma mass ~0.1 %.
  EXPECT_NEAR(mean, -1.5, 3e-3);
  EXPECT_NEAR(std::sqrt(variance), 0.25, 3e-3);
  EXPECT_NEAR(fourth / static_cast<double>(n), 3.0, 0.06);  // a normal's kurtosis
  EXPECT_NEAR(static_cast<double>(within_one_sigma) / static_cast<double>(n), 0.6827, 0.005);
}

TEST(RandomFill, RejectsNonContiguousTensors) {
  OwnedTensor t(DType::kF32, {4, 4});
  EXPECT_THROW(kernels::random_fill(t->slice(1, 0, 2), fill_params(1, 0.0f, 1.0f)), Error);
}

}  // namespace
}  // namespace metrale
