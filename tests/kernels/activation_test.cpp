// kernels::silu_mul: out = silu(gate) * up against a double reference, with gate and up as the two
// halves of one fused projection (row stride 2I), in place over gate, and with bf16 inputs.
#include "kernels/activation.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using testing::Random;

std::vector<double> reference_silu_mul(const std::vector<double>& gate, const std::vector<double>& up) {
  std::vector<double> out(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) out[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
  return out;
}

TEST(SiluMul, HalvesOfAFusedProjection) {
  Random rng(501);
  const int64_t tokens = 23, width = 37;
  const OwnedTensor fused = random_tensor(DType::kF32, {tokens, 2 * width}, rng, -8.0f, 8.0f);
  const Tensor gate = fused->slice(1, 0, width);
  const Tensor up = fused->slice(1, width, 2 * width);
  OwnedTensor out(DType::kF32, {tokens, width});
  testing::poison(*out);
  kernels::silu_mul(gate, up, *out);
  EXPECT_TRUE(testing::close_rel_l2(*out, reference_silu_mul(testing::to_doubles(gate), testing::to_doubles(up)),
                                    testing::kF32Tolerance));
}

TEST(SiluMul, InPlaceOverGate) {
  Random rng(502);
  const OwnedTensor gate = random_tensor(DType::kF32, {9, 50}, rng, -6.0f, 6.0f);
  const OwnedTensor up = random_tensor(DType::kF32, {9, 50}, rng);
  const auto expected = reference_silu_mul(testing::to_doubles(*gate), testing::to_doubles(*up));
  kernels::silu_mul(*gate, *up, *gate);
  EXPECT_TRUE(testing::close_rel_l2(*gate, expected, testing::kF32Tolerance));
}

TEST(SiluMul, Bf16InputsAndOutput) {
  Random rng(503);
  const OwnedTensor gate = random_tensor(DType::kBF16, {6, 20}, rng, -5.0f, 5.0f);
  const OwnedTensor up = random_tensor(DType::kBF16, {6, 20}, rng);
  OwnedTensor out_f32(DType::kF32, {6, 20});
  OwnedTensor out_bf16(DType::kBF16, {6, 20});
  testing::poison(*out_f32);
  testing::poison(*out_bf16);
  kernels::silu_mul(*gate, *up, *out_f32);
  kernels::silu_mul(*gate, *up, *out_bf16);
  const auto expected = reference_silu_mul(testing::to_doubles(*gate), testing::to_doubles(*up));
  EXPECT_TRUE(testing::close_rel_l2(*out_f32, expected, testing::kF32Tolerance));
  EXPECT_TRUE(testing::close_rel_l2(*out_bf16, expected, testing::kBf16OutputTolerance));
}

TEST(SiluMul, LargeMagnitudesStayFinite) {
  // silu(-100) is a tiny negative number, silu(100) = 100: no overflow to inf or NaN.
  std::vector<float> gate = {-100.0f, -30.0f, 30.0f, 100.0f}, up = {1.5f, -2.0f, 0.5f, -1.0f}, out(4, std::nanf(""));
  kernels::silu_mul(Tensor(gate.data(), DType::kF32, {1, 4}), Tensor(up.data(), DType::kF32, {1, 4}),
                    Tensor(out.data(), DType::kF32, {1, 4}));
  std::vector<double> g(gate.begin(), gate.end()), u(up.begin(), up.end());
  const auto expected = reference_silu_mul(g, u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(out[i], expected[i], 1e-6 * std::fabs(expected[i]) + 1e-30) << i;
}

TEST(SiluMul, ShapeMismatchThrows) {
  Random rng(504);
  const OwnedTensor gate = random_tensor(DType::kF32, {3, 4}, rng);
  const OwnedTensor up = random_tensor(DType::kF32, {3, 5}, rng);
  OwnedTensor out(DType::kF32, {3, 4});
  EXPECT_THROW(kernels::silu_mul(*gate, *up, *out), Error);
}

}  // namespace
}  // namespace metrale
