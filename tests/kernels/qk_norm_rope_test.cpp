// kernels::qk_norm_rope_kv_write: q <- rope(norm(q)) in place, k_cache[slot] <- rope(norm(k)),
// v_cache[slot] <- v, k and v untouched, slot -1 writes nothing. q, k and v are head slices of one
// fused projection buffer. Checked against a double reference of per-head RMSNorm and rotate-half RoPE.
#include "kernels/qk_norm_rope.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using kernels::RmsNormKind;
using testing::Random;

// Per-head RMSNorm (optional) then rotate-half RoPE over the first rotary_dim channels, for rows of
// `heads` heads of width d at the given positions. The angle is the fp32 product p * inv_freq.
std::vector<double> reference(std::vector<double> x, int64_t heads, int64_t d, const std::vector<double>* weight,
                              RmsNormKind kind, double eps, const std::vector<int32_t>& positions,
                              const std::vector<float>& inv_freq, int rotary_dim, double scaling) {
  const size_t width = static_cast<size_t>(d);
  for (size_t t = 0; t < positions.size(); ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      double* head = x.data() + (t * static_cast<size_t>(heads) + static_cast<size_t>(h)) * width;
      if (weight != nullptr) {
        double sum = 0.0;
        for (size_t i = 0; i < width; ++i) sum += head[i] * head[i];
        const double inv = 1.0 / std::sqrt(sum / static_cast<double>(width) + eps);
        const double offset = kind == RmsNormKind::kZeroCentered ? 1.0 : 0.0;
        for (size_t i = 0; i < width; ++i) head[i] *= inv * (offset + (*weight)[i]);
      }
      const int half = rotary_dim / 2;
      for (int i = 0; i < half; ++i) {
        const double angle = static_cast<float>(static_cast<float>(positions[t]) * inv_freq[static_cast<size_t>(i)]);
        const double c = std::cos(angle) * scaling, s = std::sin(angle) * scaling;
        const double a = head[i], b = head[i + half];
        head[i] = a * c - b * s;
        head[i + half] = b * c + a * s;
      }
    }
  }
  return x;
}

struct QkCase {
  bool q_norm, k_norm;
  RmsNormKind kind;
  int rotary_dim;
  float scaling;
};

class QkNormRopeTest : public ::testing::TestWithParam<QkCase> {};

TEST_P(QkNormRopeTest, MatchesNormThenRopeThenCacheWrite) {
  const QkCase c = GetParam();
  Random rng(1901);
  const int64_t tokens = 7, heads = 4, kv_heads = 2, d = 16, block_size = 4, num_blocks = 6;
  const OwnedTensor fused = random_tensor(DType::kF32, {tokens, heads + 2 * kv_heads, d}, rng, -2.0f, 2.0f);
  const Tensor q = fused->slice(1, 0, heads);
  const Tensor k = fused->slice(1, heads, heads + kv_heads);
  const Tensor v = fused->slice(1, heads + kv_heads, heads + 2 * kv_heads);
  const float w_lo = c.kind == RmsNormKind::kPlain ? 0.5f : -0.5f;
  const OwnedTensor q_weight = random_tensor(DType::kBF16, {d}, rng, w_lo, w_lo + 1.0f);
  const OwnedTensor k_weight = random_tensor(DType::kBF16, {d}, rng, w_lo, w_lo + 1.0f);
  std::vector<int32_t> positions = {3, 0, 17, 4, 9, 30, 2};
  std::vector<int32_t> slots = {5, 0, -1, 23, 12, 7, 18};  // token 2 is not cached
  std::vector<float> inv_freq(static_cast<size_t>(c.rotary_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i)
    inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * static_cast<double>(i) / c.rotary_dim));
  OwnedTensor k_cache(DType::kF32, {num_blocks, block_size, kv_heads, d}),
      v_cache(DType::kF32, {num_blocks, block_size, kv_heads, d});
  testing::fill_random(*k_cache, rng);
  testing::fill_random(*v_cache, rng);
  const std::vector<double> k_cache_before = testing::to_doubles(*k_cache),
                            v_cache_before = testing::to_doubles(*v_cache);
  const std::vector<double> q_before = testing::to_doubles(q), k_values = testing::to_doubles(k),
                            v_values = testing::to_doubles(v);
  const std::vector<uint8_t> k_bytes = testing::element_bytes(k), v_bytes = testing::element_bytes(v);

  kernels::QkNormRopeParams params;
  params.q_norm = c.q_norm;
  params.k_norm = c.k_norm;
  params.norm.eps = 1e-6f;
  params.norm.kind = c.kind;
  params.rope.rotary_dim = c.rotary_dim;
  params.rope.attention_scaling = c.scaling;
  kernels::qk_norm_rope_kv_write(q, k, v, c.q_norm ? *q_weight : Tensor(), c.k_norm ? *k_weight : Tensor(),
                                 Tensor(positions.data(), DType::kI32, {tokens}),
                                 Tensor(inv_freq.data(), DType::kF32, {c.rotary_dim / 2}),
                                 Tensor(slots.data(), DType::kI32, {tokens}), *k_cache, *v_cache, params);

  const std::vector<double> qw = testing::to_doubles(*q_weight), kw = testing::to_doubles(*k_weight);
  EXPECT_TRUE(testing::close_rel_l2(q,
                                    reference(q_before, heads, d, c.q_norm ? &qw : nullptr, c.kind, 1e-6, positions,
                                              inv_freq, c.rotary_dim, c.scaling),
                                    testing::kF32Tolerance));
  EXPECT_EQ(testing::element_bytes(k), k_bytes) << "k must not be modified";
  EXPECT_EQ(testing::element_bytes(v), v_bytes) << "v must not be modified";
  const std::vector<double> k_rotated = reference(k_values, kv_heads, d, c.k_norm ? &kw : nullptr, c.kind, 1e-6,
                                                  positions, inv_freq, c.rotary_dim, c.scaling);
  std::vector<double> expected_k = k_cache_before, expected_v = v_cache_before;
  const size_t row = static_cast<size_t>(kv_heads * d);
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] < 0) continue;
    std::copy_n(k_rotated.begin() + static_cast<ptrdiff_t>(t * row), row,
                expected_k.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(slots[t]) * row));
    std::copy_n(v_values.begin() + static_cast<ptrdiff_t>(t * row), row,
                expected_v.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(slots[t]) * row));
  }
  EXPECT_TRUE(testing::close_rel_l2(*k_cache, expected_k, testing::kF32Tolerance));
  EXPECT_EQ(testing::to_doubles(*v_cache), expected_v);
}

INSTANTIATE_TEST_SUITE_P(Variants, QkNormRopeTest,
                         ::testing::Values(QkCase{true, true, RmsNormKind::kPlain, 16, 1.0f},
                                           QkCase{true, true, RmsNormKind::kZeroCentered, 8, 1.0f},
                                           QkCase{false, true, RmsNormKind::kPlain, 16, 0.8f},
                                           QkCase{false, false, RmsNormKind::kPlain, 6, 1.0f}));

}  // namespace
}  // namespace metrale
