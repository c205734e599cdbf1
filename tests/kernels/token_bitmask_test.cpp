// kernels::apply_token_bitmask (CPU twin) against the per-token definition (kernels/token_bitmask.h):
// masked tokens of listed rows become -inf, every other value (allowed tokens, unlisted rows, the
// padding between rows, NaN and signed zeros included) keeps its bits; -1 entries skip their mask;
// bits past the vocabulary are ignored; bad shapes and rows are errors. Also the row function the
// engine's host path uses, and token_bitmask_allows_any.
#include "kernels/token_bitmask.h"

#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "core/error.h"
#include "kernels/kernel_helpers.h"
#include "kernels/token_bitmask_cases.h"

namespace metrale {
namespace {

using testing::BitmaskCase;
using testing::Random;

void run_cpu(BitmaskCase& c) {
  const Tensor logits(c.logits.data(), DType::kF32, {c.num_rows, c.vocab}, {c.stride, 1}, Device::cpu());
  const Tensor masks(c.masks.data(), DType::kI32, {c.num_masks(), c.words}, Device::cpu());
  const Tensor rows(c.rows.data(), DType::kI32, {c.num_masks()}, Device::cpu());
  kernels::apply_token_bitmask(logits, masks, rows);
}

TEST(TokenBitmaskKernel, MatchesThePerTokenDefinition) {
  Random rng(9301);
  for (const int64_t vocab : {1, 5, 31, 32, 33, 100, 1023, 4097, 151936}) {
    for (const int64_t pad : {0, 3}) {
      SCOPED_TRACE(::testing::Message() << "vocab " << vocab << " pad " << pad);
      const int64_t num_rows = vocab > 10000 ? 6 : 9;
      BitmaskCase c = testing::make_bitmask_case(rng, num_rows, vocab, /*num_masks=*/num_rows - 2, pad,
                                                 /*extra_words=*/pad);
      const std::vector<float> expected = testing::expected_masked(c);
      run_cpu(c);
      EXPECT_EQ(testing::first_bit_difference(c.logits, expected), -1);
    }
  }
}

TEST(TokenBitmaskKernel, PaddingEntriesAndNoMasksChangeNothing) {
  Random rng(9302);
  BitmaskCase c = testing::make_bitmask_case(rng, 4, 77, 3);
  c.rows.assign(3, -1);
  const std::vector<float> before = c.logits;
  run_cpu(c);
  EXPECT_EQ(testing::first_bit_difference(c.logits, before), -1);
  // Zero masks: a step without constrained rows.
  BitmaskCase none = testing::make_bitmask_case(rng, 4, 77, 0);
  const std::vector<float> unchanged = none.logits;
  run_cpu(none);
  EXPECT_EQ(testing::first_bit_difference(none.logits, unchanged), -1);
}

TEST(TokenBitmaskKernel, AMaskThatAllowsNothingMasksTheWholeRow) {
  std::vector<float> logits(2 * 40, 1.0f);
  std::vector<uint32_t> masks = {0u, 0xffffff00u};  // only bits past V = 40
  std::vector<int32_t> rows = {1};
  kernels::apply_token_bitmask(Tensor(logits.data(), DType::kF32, {2, 40}, Device::cpu()),
                               Tensor(masks.data(), DType::kI32, {1, 2}, Device::cpu()),
                               Tensor(rows.data(), DType::kI32, {1}, Device::cpu()));
  for (int64_t t = 0; t < 40; ++t) {
    EXPECT_EQ(logits[static_cast<size_t>(t)], 1.0f);
    EXPECT_EQ(logits[static_cast<size_t>(40 + t)], -std::numeric_limits<float>::infinity()) << t;
  }
  EXPECT_FALSE(kernels::token_bitmask_allows_any(std::span<const uint32_t>(masks), 40));
  EXPECT_TRUE(kernels::token_bitmask_allows_any(std::span<const uint32_t>(masks), 41));
}

TEST(TokenBitmaskKernel, RejectsBadShapesAndRows) {
  std::vector<float> logits(3 * 64, 0.0f);
  std::vector<uint32_t> masks(2 * 2, ~0u);
  std::vector<int32_t> rows = {0, 3};
  const Tensor logits_t(logits.data(), DType::kF32, {3, 64}, Device::cpu());
  EXPECT_THROW(kernels::apply_token_bitmask(logits_t, Tensor(masks.data(), DType::kI32, {2, 2}, Device::cpu()),
                                            Tensor(rows.data(), DType::kI32, {2}, Device::cpu())),
               Error);  // row 3 of 3
  rows = {0, 1};
  EXPECT_THROW(kernels::apply_token_bitmask(logits_t, Tensor(masks.data(), DType::kI32, {4, 1}, Device::cpu()),
                                            Tensor(rows.data(), DType::kI32, {2}, Device::cpu())),
               Error);  // 1 word for 64 tokens (and 4 masks for 2 rows)
  EXPECT_THROW(kernels::apply_token_bitmask(logits_t, Tensor(masks.data(), DType::kI32, {2, 2}, Device::cpu()),
                                            Tensor(rows.data(), DType::kI32, {1}, Device::cpu())),
               Error);  // 2 masks, 1 row id
  EXPECT_NO_THROW(kernels::apply_token_bitmask(logits_t, Tensor(masks.data(), DType::kI32, {2, 2}, Device::cpu()),
                                               Tensor(rows.data(), DType::kI32, {2}, Device::cpu())));
}

TEST(TokenBitmaskKernel, RowFunctionIsTheTensorOpOfOneRow) {
  Random rng(9303);
  for (const int64_t vocab : {7, 64, 151936}) {
    BitmaskCase c = testing::make_bitmask_case(rng, 1, vocab, 1);
    c.rows = {0};
    std::vector<float> row = c.logits;
    kernels::cpu::apply_token_bitmask_row(row, std::span<const uint32_t>(c.masks));
    run_cpu(c);
    EXPECT_EQ(testing::first_bit_difference(row, c.logits), -1) << vocab;
  }
}

}  // namespace
}  // namespace metrale
