// add_inplace and convert, on sizes large enough for the pool to split them.
#include "kernels/elementwise.h"

#include <gtest/gtest.h>

#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using testing::Random;

TEST(AddInplace, AddsF32AndBf16Sources) {
  Random rng(801);
  const int64_t n = 70001;  // several 16384-element ranges plus a tail
  for (const DType src_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    const OwnedTensor dst = random_tensor(DType::kF32, {n}, rng);
    const OwnedTensor src = random_tensor(src_dtype, {n}, rng);
    const std::vector<double> a = testing::to_doubles(*dst), b = testing::to_doubles(*src);
    kernels::add_inplace(*dst, *src);
    const std::vector<double> result = testing::to_doubles(*dst);
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(result[i], static_cast<float>(static_cast<float>(a[i]) + static_cast<float>(b[i]))) << i;
    }
  }
}

TEST(Convert, RoundTripsBetweenDtypes) {
  Random rng(802);
  const int64_t n = 40000;
  const OwnedTensor f32 = random_tensor(DType::kF32, {n}, rng, -100.0f, 100.0f);
  const std::vector<double> values = testing::to_doubles(*f32);
  OwnedTensor bf16(DType::kBF16, {n}), f16(DType::kF16, {n}), back(DType::kF32, {n});
  kernels::convert(*f32, *bf16);
  kernels::convert(*f32, *f16);
  const auto* bf16_bits = bf16->data_as<const uint16_t>();
  const auto* f16_bits = f16->data_as<const uint16_t>();
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(bf16_bits[i], f32_to_bf16_bits(static_cast<float>(values[i]))) << i;
    ASSERT_EQ(f16_bits[i], f32_to_f16_bits(static_cast<float>(values[i]))) << i;
  }
  testing::poison(*back);
  kernels::convert(*bf16, *back);
  for (size_t i = 0; i < values.size(); ++i) ASSERT_EQ(back->data_as<float>()[i], bf16_bits_to_f32(bf16_bits[i])) << i;
}

TEST(Elementwise, RejectsMismatchedArguments) {
  Random rng(803);
  const OwnedTensor a = random_tensor(DType::kF32, {10}, rng);
  const OwnedTensor b = random_tensor(DType::kF32, {11}, rng);
  const OwnedTensor c = random_tensor(DType::kBF16, {10}, rng);
  EXPECT_THROW(kernels::add_inplace(*a, *b), Error);
  EXPECT_THROW(kernels::add_inplace(*c, *a), Error);  // the destination must be f32
  EXPECT_THROW(kernels::convert(*a, *b), Error);
}

}  // namespace
}  // namespace metrale
