// moe_route (softmax, then top-k by descending probability with ties to the lower expert id,
// optional renormalisation), gather_rows and scatter_add_rows, against double references.
#include "kernels/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/test_support.h"
#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using testing::Random;

struct Route {
  std::vector<int32_t> ids;
  std::vector<double> weights;
};

// Softmax in double, then a stable selection: larger probability first, equal ones by lower id.
Route reference_route(const std::vector<double>& logits, int64_t tokens, int64_t experts, int k, bool normalize) {
  Route route;
  for (int64_t t = 0; t < tokens; ++t) {
    const double* row = logits.data() + t * experts;
    const double max_logit = *std::max_element(row, row + experts);
    std::vector<double> probs(static_cast<size_t>(experts));
    double sum = 0.0;
    for (int64_t e = 0; e < experts; ++e) sum += (probs[static_cast<size_t>(e)] = std::exp(row[e] - max_logit));
    for (auto& p : probs) p /= sum;
    std::vector<int32_t> order(static_cast<size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return probs[static_cast<size_t>(a)] > probs[static_cast<size_t>(b)];
    });
    double selected = 0.0;
    for (int j = 0; j < k; ++j) selected += probs[static_cast<size_t>(order[static_cast<size_t>(j)])];
    for (int j = 0; j < k; ++j) {
      const int32_t e = order[static_cast<size_t>(j)];
      route.ids.push_back(e);
      route.weights.push_back(normalize ? probs[static_cast<size_t>(e)] / selected : probs[static_cast<size_t>(e)]);
    }
  }
  return route;
}

Route run_route(const Tensor& logits, int k, bool normalize) {
  const int64_t tokens = logits.size(0);
  OwnedTensor ids(DType::kI32, {tokens, k});
  OwnedTensor weights(DType::kF32, {tokens, k});
  std::fill_n(ids->data_as<int32_t>(), tokens * k, -1);
  testing::poison(*weights);
  kernels::moe_route(logits, *ids, *weights, {k, normalize});
  return {std::vector<int32_t>(ids->data_as<int32_t>(), ids->data_as<int32_t>() + tokens * k),
          testing::to_doubles(*weights)};
}

struct RouteCase {
  int64_t experts;
  int k;
  bool normalize;
  DType dtype;
};

class MoeRouteTest : public ::testing::TestWithParam<RouteCase> {};

TEST_P(MoeRouteTest, MatchesReference) {
  const RouteCase c = GetParam();
  Random rng(701);
  const int64_t tokens = 37;  // > 16: the pool splits the tokens
  const OwnedTensor logits = random_tensor(c.dtype, {tokens, c.experts}, rng, -4.0f, 4.0f);
  const Route actual = run_route(*logits, c.k, c.normalize);
  const Route expected = reference_route(testing::to_doubles(*logits), tokens, c.experts, c.k, c.normalize);
  EXPECT_EQ(actual.ids, expected.ids);
  EXPECT_TRUE(testing::close_rel_l2(actual.weights, expected.weights, testing::kF32Tolerance));
  if (c.normalize) {
    for (int64_t t = 0; t < tokens; ++t) {
      const double sum = std::accumulate(actual.weights.begin() + t * c.k, actual.weights.begin() + (t + 1) * c.k, 0.0);
      EXPECT_NEAR(sum, 1.0, 1e-6) << "token " << t;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, MoeRouteTest,
                         ::testing::Values(RouteCase{8, 2, false, DType::kF32}, RouteCase{8, 2, true, DType::kF32},
                                           RouteCase{5, 1, false, DType::kF32}, RouteCase{5, 1, true, DType::kF32},
                                           RouteCase{16, 5, true, DType::kF32}, RouteCase{7, 7, false, DType::kF32},
                                           RouteCase{12, 3, true, DType::kBF16}));

TEST(MoeRoute, TiesGoToTheLowerExpertId) {
  // Equal logits give bit-identical probabilities, so the order among them is the tie rule alone.
  std::vector<float> logits = {
      0.5f,  2.0f,  2.0f, -1.0f, 2.0f,  0.0f,  // three-way tie for the top: 1, 2, 4
      1.0f,  1.0f,  1.0f, 1.0f,  1.0f,  1.0f,  // all equal: 0, 1, 2
      -3.0f, 0.25f, 3.0f, 0.25f, 0.25f, 3.0f,  // tie for first (2, 5), then tie for third (1, 3, 4)
  };
  const Tensor tensor(logits.data(), DType::kF32, {3, 6});
  EXPECT_EQ(run_route(tensor, 3, false).ids, (std::vector<int32_t>{1, 2, 4, 0, 1, 2, 2, 5, 1}));
  EXPECT_EQ(run_route(tensor, 2, true).ids, (std::vector<int32_t>{1, 2, 0, 1, 2, 5}));
  const Route one = run_route(tensor, 1, true);
  EXPECT_EQ(one.ids, (std::vector<int32_t>{1, 0, 2}));
  EXPECT_EQ(one.weights, (std::vector<double>{1.0, 1.0, 1.0}));
  const Route tied = run_route(tensor, 2, true);
  EXPECT_EQ(tied.weights[0], 0.5);  // two equal probabilities renormalise to exactly one half each
  EXPECT_EQ(tied.weights[1], 0.5);
}

TEST(MoeRoute, RejectsBadTopK) {
  Random rng(702);
  const OwnedTensor logits = random_tensor(DType::kF32, {2, 4}, rng);
  OwnedTensor ids(DType::kI32, {2, 5});
  OwnedTensor weights(DType::kF32, {2, 5});
  EXPECT_THROW(kernels::moe_route(*logits, *ids, *weights, {5, false}), Error);
  EXPECT_THROW(kernels::moe_route(*logits, *ids, *weights, {0, false}), Error);
}

TEST(GatherRows, CopiesIndexedRowsBitForBit) {
  Random rng(703);
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    const int64_t rows = 9, width = 13;
    const OwnedTensor src = random_tensor(dtype, {rows, width}, rng);
    std::vector<int32_t> index = {4, 0, 8, 4, 4, 2, 7};
    const auto n = static_cast<int64_t>(index.size());
    OwnedTensor out(dtype, {n, width});
    testing::poison(*out);
    kernels::gather_rows(*src, Tensor(index.data(), DType::kI32, {n}), *out);
    const std::vector<uint8_t> src_bytes = testing::element_bytes(*src), out_bytes = testing::element_bytes(*out);
    const size_t row_bytes = static_cast<size_t>(width) * dtype_size(dtype);
    for (size_t i = 0; i < index.size(); ++i) {
      EXPECT_TRUE(std::equal(out_bytes.begin() + static_cast<ptrdiff_t>(i * row_bytes),
                             out_bytes.begin() + static_cast<ptrdiff_t>((i + 1) * row_bytes),
                             src_bytes.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(index[i]) * row_bytes)))
          << "row " << i;
    }
    std::vector<int32_t> bad = {0, static_cast<int32_t>(rows)};
    OwnedTensor out2(dtype, {2, width});
    EXPECT_THROW(kernels::gather_rows(*src, Tensor(bad.data(), DType::kI32, {2}), *out2), Error);
  }
}

TEST(ScatterAddRows, AccumulatesWeightedRowsIncludingRepeats) {
  Random rng(704);
  for (const DType src_dtype : {DType::kF32, DType::kBF16}) {
    const int64_t rows = 7, width = 19;
    const OwnedTensor dst = random_tensor(DType::kF32, {rows, width}, rng);
    std::vector<int32_t> index = {3, 0, 3, 6, 3, 1, 0, 5};  // row 3 three times, row 0 twice, rows 2 and 4 never
    const auto n = static_cast<int64_t>(index.size());
    const OwnedTensor src = random_tensor(src_dtype, {n, width}, rng);
    std::vector<float> weights = rng.floats(index.size(), 0.05f, 1.0f);
    std::vector<double> expected = testing::to_doubles(*dst);
    const std::vector<double> src_values = testing::to_doubles(*src);
    for (size_t i = 0; i < index.size(); ++i)
      for (int64_t c = 0; c < width; ++c)
        expected[static_cast<size_t>(index[i] * width + c)] +=
            weights[i] * src_values[i * static_cast<size_t>(width) + static_cast<size_t>(c)];
    const std::vector<double> before = testing::to_doubles(*dst);
    kernels::scatter_add_rows(*dst, *src, Tensor(index.data(), DType::kI32, {n}),
                              Tensor(weights.data(), DType::kF32, {n}));
    EXPECT_TRUE(testing::close_rel_l2(*dst, expected, testing::kF32Tolerance));
    const std::vector<double> after = testing::to_doubles(*dst);
    for (const int64_t untouched : {2, 4})
      for (int64_t c = 0; c < width; ++c)
        EXPECT_EQ(after[static_cast<size_t>(untouched * width + c)],
                  before[static_cast<size_t>(untouched * width + c)]);
  }
}

// An index outside dst must be rejected like gather_rows rejects one outside src. The destination
// is a view into a larger buffer with guard rows around it, so that an unchecked write lands in
// memory the test owns (and is detected there) instead of corrupting the heap.
TEST(ScatterAddRows, RejectsIndicesOutsideTheDestination) {
  Random rng(705);
  const int64_t rows = 4, width = 8, guard = 2;
  const OwnedTensor buffer = random_tensor(DType::kF32, {rows + 2 * guard, width}, rng);
  const Tensor dst = buffer->slice(0, guard, guard + rows);
  const std::vector<uint8_t> guard_before = testing::element_bytes(buffer->slice(0, 0, guard));
  const std::vector<uint8_t> guard_after = testing::element_bytes(buffer->slice(0, guard + rows, rows + 2 * guard));
  const OwnedTensor src = random_tensor(DType::kF32, {1, width}, rng);
  std::vector<float> weight = {0.5f};
  for (const int32_t bad : {-1, static_cast<int32_t>(rows)}) {
    std::vector<int32_t> index = {bad};
    EXPECT_THROW(kernels::scatter_add_rows(dst, *src, Tensor(index.data(), DType::kI32, {1}),
                                           Tensor(weight.data(), DType::kF32, {1})),
                 Error)
        << "index " << bad;
  }
  EXPECT_EQ(testing::element_bytes(buffer->slice(0, 0, guard)), guard_before) << "wrote before the destination";
  EXPECT_EQ(testing::element_bytes(buffer->slice(0, guard + rows, rows + 2 * guard)), guard_after)
      << "wrote past the destination";
}

}  // namespace
}  // namespace metrale
