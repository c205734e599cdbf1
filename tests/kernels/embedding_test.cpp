// kernels::embedding: out[t] = table[ids[t]] for every table/output dtype pair, and ids outside
// the vocabulary rejected with kInvalidArgument.
#include "kernels/embedding.h"

#include <gtest/gtest.h>

#include "core/test_support.h"
#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using testing::Random;

struct EmbeddingCase {
  DType table_dtype, out_dtype;
};

class EmbeddingTest : public ::testing::TestWithParam<EmbeddingCase> {};

TEST_P(EmbeddingTest, GathersRowsExactly) {
  const auto [table_dtype, out_dtype] = GetParam();
  Random rng(101);
  const int64_t vocab = 29, hidden = 37, tokens = 40;  // more tokens than 16 so that the pool splits them
  const OwnedTensor table = random_tensor(table_dtype, {vocab, hidden}, rng);
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (auto& id : ids) id = static_cast<int32_t>(rng.integer(0, vocab - 1));
  ids[0] = 0;
  ids[1] = static_cast<int32_t>(vocab - 1);
  ids[2] = ids[3];  // a repeated id
  const Tensor ids_tensor(ids.data(), DType::kI32, {tokens});
  OwnedTensor out(out_dtype, {tokens, hidden});
  testing::poison(*out);
  kernels::embedding(ids_tensor, *table, *out);

  const std::vector<double> table_values = testing::to_doubles(*table);
  const std::vector<double> out_values = testing::to_doubles(*out);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < hidden; ++c) {
      const double source = table_values[static_cast<size_t>(ids[static_cast<size_t>(t)] * hidden + c)];
      // Widening is exact; narrowing f32 -> bf16 rounds to nearest.
      const double expected = out_dtype == DType::kBF16 ? round_to_bf16(static_cast<float>(source)) : source;
      ASSERT_EQ(out_values[static_cast<size_t>(t * hidden + c)], expected) << "token " << t << " channel " << c;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EmbeddingTest,
                         ::testing::Values(EmbeddingCase{DType::kF32, DType::kF32},
                                           EmbeddingCase{DType::kBF16, DType::kF32},
                                           EmbeddingCase{DType::kF16, DType::kF32},
                                           EmbeddingCase{DType::kBF16, DType::kBF16},
                                           EmbeddingCase{DType::kF32, DType::kBF16}));

TEST(Embedding, WritesIntoStridedRows) {
  Random rng(102);
  const int64_t vocab = 11, hidden = 6, tokens = 5;
  const OwnedTensor table = random_tensor(DType::kF32, {vocab, hidden}, rng);
  std::vector<int32_t> ids = {3, 10, 0, 3, 7};
  OwnedTensor wide(DType::kF32, {tokens, hidden + 3});
  testing::fill_random(*wide, rng);
  const std::vector<uint8_t> padding_before = testing::element_bytes(wide->slice(1, hidden, hidden + 3));
  const Tensor out = wide->slice(1, 0, hidden);
  kernels::embedding(Tensor(ids.data(), DType::kI32, {tokens}), *table, out);
  const std::vector<double> table_values = testing::to_doubles(*table), out_values = testing::to_doubles(out);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < hidden; ++c)
      EXPECT_EQ(out_values[static_cast<size_t>(t * hidden + c)],
                table_values[static_cast<size_t>(ids[static_cast<size_t>(t)] * hidden + c)]);
  EXPECT_EQ(testing::element_bytes(wide->slice(1, hidden, hidden + 3)), padding_before) << "padding was written";
}

TEST(Embedding, RejectsIdsOutsideTheVocabulary) {
  Random rng(103);
  const OwnedTensor table = random_tensor(DType::kBF16, {8, 4}, rng);
  OwnedTensor out(DType::kF32, {3, 4});
  for (const int32_t bad : {-1, 8, 1000}) {
    std::vector<int32_t> ids = {1, bad, 2};
    EXPECT_TRUE(testing::throws_error([&] { kernels::embedding(Tensor(ids.data(), DType::kI32, {3}), *table, *out); },
                                      ErrorCode::kInvalidArgument, {std::to_string(bad), "[0, 8)"}))
        << bad;
  }
}

TEST(EmbeddingShard, LooksUpItsRowsAndZerosEveryOtherId) {
  // A rank holding ids [10, 20) of a vocabulary of 30: the shards' lookups sum to the whole one.
  Random rng(103);
  const int64_t vocab = 30, hidden = 8;
  const OwnedTensor table = random_tensor(DType::kF32, {vocab, hidden}, rng);
  std::vector<int32_t> ids = {12, 3, 19, 20, 10, 29};
  const Tensor ids_tensor(ids.data(), DType::kI32, {6});
  OwnedTensor whole(DType::kF32, {6, hidden}), sum(DType::kF32, {6, hidden});
  kernels::embedding(ids_tensor, *table, *whole);
  std::vector<double> total(static_cast<size_t>(6 * hidden), 0.0);
  for (const int64_t first : {0, 10, 20}) {
    OwnedTensor part(DType::kF32, {6, hidden});
    testing::poison(*part);
    kernels::embedding_shard(ids_tensor, table->slice(0, first, first + 10), first, *part);
    const std::vector<double> values = testing::to_doubles(*part);
    for (size_t t = 0; t < ids.size(); ++t) {
      const bool own = ids[t] >= first && ids[t] < first + 10;
      for (int64_t c = 0; c < hidden; ++c) {
        const double v = values[t * static_cast<size_t>(hidden) + static_cast<size_t>(c)];
        if (!own) {
          EXPECT_EQ(v, 0.0) << "id " << ids[t] << " in the shard from " << first;
        }
        total[t * static_cast<size_t>(hidden) + static_cast<size_t>(c)] += v;
      }
    }
  }
  EXPECT_EQ(total, testing::to_doubles(*whole));
}

}  // namespace
}  // namespace metrale
