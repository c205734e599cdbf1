// kernels::rope (rotate-half / NeoX) against a double reference: channel j pairs with
// j + rotary_dim/2, channels past rotary_dim pass through bit for bit, attention_scaling multiplies
// cos and sin, and rows may be strided (heads of a wider buffer).
#include "kernels/rope.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using testing::Random;

// The angle is p * inv_freq rounded to fp32 (transformers computes it in fp32, and so does the
// documented kernel); cos, sin and the rotation are exact in double.
std::vector<double> reference_rope(const std::vector<double>& x, const std::vector<int32_t>& positions,
                                   const std::vector<float>& inv_freq, int64_t heads, int64_t head_dim, int rotary_dim,
                                   double scaling) {
  std::vector<double> y = x;
  const int half = rotary_dim / 2;
  for (size_t t = 0; t < positions.size(); ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const size_t base = (t * static_cast<size_t>(heads) + static_cast<size_t>(h)) * static_cast<size_t>(head_dim);
      for (int i = 0; i < half; ++i) {
        const double angle = static_cast<float>(static_cast<float>(positions[t]) * inv_freq[static_cast<size_t>(i)]);
        const double c = std::cos(angle) * scaling, s = std::sin(angle) * scaling;
        const double a = x[base + static_cast<size_t>(i)], b = x[base + static_cast<size_t>(i + half)];
        y[base + static_cast<size_t>(i)] = a * c - b * s;  // [a; b] * cos + [-b; a] * sin
        y[base + static_cast<size_t>(i + half)] = b * c + a * s;
      }
    }
  }
  return y;
}

struct RopeCase {
  int64_t head_dim;
  int rotary_dim;
  float scaling;
};

class RopeTest : public ::testing::TestWithParam<RopeCase> {};

TEST_P(RopeTest, MatchesReferenceAndLeavesTheTailUntouched) {
  const RopeCase c = GetParam();
  Random rng(301);
  const int64_t tokens = 11, heads = 3;
  std::vector<int32_t> positions(static_cast<size_t>(tokens));
  for (auto& p : positions) p = static_cast<int32_t>(rng.integer(0, 300));  // unsorted, repeats allowed
  positions[0] = 0;
  std::vector<float> inv_freq(static_cast<size_t>(c.rotary_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i)
    inv_freq[i] = static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / c.rotary_dim));
  const OwnedTensor x = random_tensor(DType::kF32, {tokens, heads, c.head_dim}, rng, -2.0f, 2.0f);
  const std::vector<double> before = testing::to_doubles(*x);
  const std::vector<uint8_t> bytes_before = testing::element_bytes(*x);

  kernels::rope(*x, Tensor(positions.data(), DType::kI32, {tokens}),
                Tensor(inv_freq.data(), DType::kF32, {c.rotary_dim / 2}), {c.rotary_dim, c.scaling});

  const auto expected = reference_rope(before, positions, inv_freq, heads, c.head_dim, c.rotary_dim, c.scaling);
  EXPECT_TRUE(testing::close_rel_l2(*x, expected, testing::kF32Tolerance));
  const std::vector<uint8_t> bytes_after = testing::element_bytes(*x);
  for (int64_t row = 0; row < tokens * heads; ++row) {
    for (int64_t ch = c.rotary_dim; ch < c.head_dim; ++ch) {
      const size_t at = static_cast<size_t>((row * c.head_dim + ch) * 4);
      ASSERT_EQ(std::memcmp(&bytes_after[at], &bytes_before[at], 4), 0) << "row " << row << " channel " << ch;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RopeTest,
                         ::testing::Values(RopeCase{16, 16, 1.0f},   // full rotary
                                           RopeCase{12, 12, 1.0f},   // half = 6: not a power of two
                                           RopeCase{32, 8, 1.0f},    // partial: quarter of the head
                                           RopeCase{20, 10, 1.0f},   // partial with odd half
                                           RopeCase{16, 16, 0.75f},  // YaRN-style scaling
                                           RopeCase{24, 6, 1.3f}));

TEST(Rope, PositionZeroIsTheIdentity) {
  Random rng(302);
  const OwnedTensor x = random_tensor(DType::kF32, {2, 2, 8}, rng);
  const std::vector<uint8_t> before = testing::element_bytes(*x);
  std::vector<int32_t> positions = {0, 0};
  std::vector<float> inv_freq = {1.0f, 0.5f, 0.25f, 0.125f};
  kernels::rope(*x, Tensor(positions.data(), DType::kI32, {2}), Tensor(inv_freq.data(), DType::kF32, {4}), {8, 1.0f});
  EXPECT_EQ(testing::element_bytes(*x), before);
}

TEST(Rope, StridedHeadsOfAWiderBuffer) {
  // q heads sliced out of a fused [T, q_heads + kv_heads, D] buffer: only the view is rotated.
  Random rng(303);
  const int64_t tokens = 6, q_heads = 4, extra = 2, head_dim = 16;
  const OwnedTensor fused = random_tensor(DType::kF32, {tokens, q_heads + extra, head_dim}, rng);
  const Tensor q = fused->slice(1, 0, q_heads);
  const Tensor others = fused->slice(1, q_heads, q_heads + extra);
  const std::vector<uint8_t> others_before = testing::element_bytes(others);
  const std::vector<double> q_before = testing::to_doubles(q);
  std::vector<int32_t> positions = {5, 1, 9, 2, 31, 7};
  std::vector<float> inv_freq(8);
  for (size_t i = 0; i < 8; ++i) inv_freq[i] = rng.uniform(0.01f, 1.0f);
  kernels::rope(q, Tensor(positions.data(), DType::kI32, {tokens}), Tensor(inv_freq.data(), DType::kF32, {8}),
                {16, 1.0f});
  EXPECT_TRUE(testing::close_rel_l2(q, reference_rope(q_before, positions, inv_freq, q_heads, head_dim, 16, 1.0),
                                    testing::kF32Tolerance));
  EXPECT_EQ(testing::element_bytes(others), others_before);
}

TEST(Rope, Bf16InPlace) {
  Random rng(304);
  const OwnedTensor x = random_tensor(DType::kBF16, {7, 2, 16}, rng);
  const std::vector<double> before = testing::to_doubles(*x);
  std::vector<int32_t> positions = {0, 1, 2, 3, 40, 41, 100};
  std::vector<float> inv_freq(8);
  for (size_t i = 0; i < 8; ++i) inv_freq[i] = static_cast<float>(1.0 / std::pow(1e6, 2.0 * i / 16));
  kernels::rope(*x, Tensor(positions.data(), DType::kI32, {7}), Tensor(inv_freq.data(), DType::kF32, {8}), {16, 1.0f});
  EXPECT_TRUE(testing::close_rel_l2(*x, reference_rope(before, positions, inv_freq, 2, 16, 16, 1.0),
                                    testing::kBf16OutputTolerance));
}

TEST(Rope, RejectsInconsistentParameters) {
  Random rng(305);
  const OwnedTensor x = random_tensor(DType::kF32, {2, 1, 8}, rng);
  std::vector<int32_t> positions = {1, 2};
  std::vector<float> inv_freq = {1.0f, 0.5f, 0.25f, 0.125f};
  const Tensor pos(positions.data(), DType::kI32, {2});
  EXPECT_THROW(kernels::rope(*x, pos, Tensor(inv_freq.data(), DType::kF32, {4}), {7, 1.0f}), Error);   // odd
  EXPECT_THROW(kernels::rope(*x, pos, Tensor(inv_freq.data(), DType::kF32, {4}), {10, 1.0f}), Error);  // > head_dim
  EXPECT_THROW(kernels::rope(*x, pos, Tensor(inv_freq.data(), DType::kF32, {3}), {8, 1.0f}), Error);   // freq count
  EXPECT_THROW(kernels::rope(*x, Tensor(positions.data(), DType::kI32, {1}), Tensor(inv_freq.data(), DType::kF32, {4}),
                             {8, 1.0f}),
               Error);
}

}  // namespace
}  // namespace metrale
