// kernels::sample_tokens (CPU) against a double-precision reference of the documented decision
// (kernels/sampling.h, engine/sampler.h): greedy argmax (ties to the lower id); weights
// exp((x - max) / T); top-k; top-p measured on the top-k mass; min-p against the maximum; then the
// first kept token, in (logit desc, id asc) order, whose running mass exceeds u x the kept mass, with
// u = rng::uniform_for(seed, step). The logprob is the log-softmax of the raw logits.
#include "kernels/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/random.h"
#include "core/test_support.h"
#include "kernels/kernel_helpers.h"
#include "kernels/sampling_rows.h"

namespace metrale {
namespace {

using testing::Random;

using testing::RowSettings;

int32_t reference_token(const std::vector<float>& logits, const RowSettings& s) {
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)];
  });
  if (s.temperature <= 1e-5f) return order[0];
  const double max_logit = logits[static_cast<size_t>(order[0])];
  std::vector<double> weight(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) weight[i] = std::exp((logits[i] - max_logit) / s.temperature);
  size_t kept = order.size();
  if (s.top_k > 0 && static_cast<size_t>(s.top_k) < kept) kept = static_cast<size_t>(s.top_k);
  if (s.top_p < 1.0f) {
    double mass = 0.0;
    for (size_t i = 0; i < kept; ++i) mass += weight[static_cast<size_t>(order[i])];
    double running = 0.0;
    for (size_t i = 0; i < kept; ++i) {
      running += weight[static_cast<size_t>(order[i])];
      if (running >= static_cast<double>(s.top_p) * mass) {
        kept = i + 1;
        break;
      }
    }
  }
  std::vector<int32_t> candidates;
  for (size_t i = 0; i < kept; ++i)
    if (weight[static_cast<size_t>(order[i])] >= s.min_p) candidates.push_back(order[i]);
  double mass = 0.0;
  for (const int32_t id : candidates) mass += weight[static_cast<size_t>(id)];
  const double target = static_cast<double>(rng::uniform_for(s.seed, s.step)) * mass;
  double running = 0.0;
  for (const int32_t id : candidates) {
    running += weight[static_cast<size_t>(id)];
    if (running > target) return id;
  }
  return candidates.back();
}

double reference_logprob(const std::vector<float>& logits, int32_t token) {
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (const float x : logits) sum += std::exp(x - max_logit);
  return logits[static_cast<size_t>(token)] - max_logit - std::log(sum);
}

// Runs the kernel over rows (all with the same vocabulary) and returns tokens and logprobs.
struct Sampled {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
};
Sampled run(const Tensor& logits, const std::vector<RowSettings>& rows) {
  const auto r = static_cast<int64_t>(rows.size());
  std::vector<float> temperature, top_p, min_p;
  std::vector<int32_t> top_k;
  std::vector<int64_t> seed, step;
  for (const auto& s : rows) {
    temperature.push_back(s.temperature);
    top_k.push_back(s.top_k);
    top_p.push_back(s.top_p);
    min_p.push_back(s.min_p);
    seed.push_back(static_cast<int64_t>(s.seed));
    step.push_back(static_cast<int64_t>(s.step));
  }
  kernels::SamplingRowParams params;
  params.temperature = Tensor(temperature.data(), DType::kF32, {r});
  params.top_k = Tensor(top_k.data(), DType::kI32, {r});
  params.top_p = Tensor(top_p.data(), DType::kF32, {r});
  params.min_p = Tensor(min_p.data(), DType::kF32, {r});
  params.seed = Tensor(seed.data(), DType::kI64, {r});
  params.step = Tensor(step.data(), DType::kI64, {r});
  Sampled out{std::vector<int32_t>(rows.size(), -5), std::vector<float>(rows.size(), std::nanf(""))};
  kernels::sample_tokens(logits, params, Tensor(out.tokens.data(), DType::kI32, {r}),
                         Tensor(out.logprobs.data(), DType::kF32, {r}));
  return out;
}

std::vector<float> row_values(const Tensor& logits, int64_t r) {
  const std::vector<double> all = testing::to_doubles(logits.slice(0, r, r + 1));
  return {all.begin(), all.end()};
}

TEST(SampleTokens, MatchesReferenceAcrossSettingsSeedsAndSteps) {
  Random rng(1701);
  const int64_t vocab = 37;
  const std::vector<RowSettings> settings = {
      {1.0f, 0, 1.0f, 0.0f},  {0.7f, 0, 1.0f, 0.0f},   {1.3f, 5, 1.0f, 0.0f},  {1.0f, 0, 0.8f, 0.0f},
      {1.0f, 0, 1.0f, 0.05f}, {0.9f, 10, 0.9f, 0.02f}, {2.0f, -1, 0.5f, 0.0f}, {1.0f, 36, 1.0f, 0.0f},
  };
  std::vector<RowSettings> rows;
  for (uint64_t draw = 0; draw < 40; ++draw) {
    for (const auto& base : settings) {
      RowSettings s = base;
      s.seed = 1000 + draw * 7919;
      s.step = draw % 5;
      rows.push_back(s);
    }
  }
  const auto r = static_cast<int64_t>(rows.size());
  // Logits as the first V columns of a wider buffer (row stride > V).
  const OwnedTensor wide = random_tensor(DType::kF32, {r, vocab + 3}, rng, -4.0f, 4.0f);
  const Tensor logits = wide->slice(1, 0, vocab);
  const Sampled sampled = run(logits, rows);
  int mismatches = 0;
  for (int64_t i = 0; i < r; ++i) {
    const std::vector<float> values = row_values(logits, i);
    const int32_t expected = reference_token(values, rows[static_cast<size_t>(i)]);
    if (sampled.tokens[static_cast<size_t>(i)] != expected) {
      ++mismatches;
      ADD_FAILURE() << "row " << i << ": token " << sampled.tokens[static_cast<size_t>(i)] << ", expected " << expected;
    }
    EXPECT_NEAR(sampled.logprobs[static_cast<size_t>(i)],
                reference_logprob(values, sampled.tokens[static_cast<size_t>(i)]), 1e-5);
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(SampleTokens, GreedyIsArgmaxWithTiesToTheLowerId) {
  std::vector<float> logits = {0.5f,  2.0f,  -1.0f, 2.0f,  1.0f,    // tie between ids 1 and 3
                               -3.0f, -0.0f, 0.0f,  -2.0f, -1.0f};  // -0 and +0 tie: id 6
  const Tensor tensor(logits.data(), DType::kF32, {2, 5});
  RowSettings greedy;
  greedy.temperature = 0.0f;
  RowSettings tiny = greedy;
  tiny.temperature = 1e-6f;
  const Sampled a = run(tensor, {greedy, tiny});
  EXPECT_EQ(a.tokens, (std::vector<int32_t>{1, 1}));
  EXPECT_NEAR(a.logprobs[0], reference_logprob({logits.begin(), logits.begin() + 5}, 1), 1e-6);
  const Sampled b = run(Tensor(logits.data() + 5, DType::kF32, {1, 5}), {greedy});
  EXPECT_EQ(b.tokens[0], 1);  // ids are per row: -0 at 1 and +0 at 2 compare equal, the lower id wins
}

TEST(SampleTokens, TopKOneIsGreedyAndMaskedTokensAreNeverDrawn) {
  Random rng(1702);
  const int64_t vocab = 50;
  std::vector<float> logits = rng.floats(static_cast<size_t>(vocab), -2.0f, 2.0f);
  const float inf = std::numeric_limits<float>::infinity();
  for (const size_t masked : {3u, 17u, 40u}) logits[masked] = -inf;
  logits[17] = -inf;
  const int32_t argmax = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<RowSettings> rows;
  for (uint64_t step = 0; step < 300; ++step) rows.push_back({1.5f, step % 2 == 0 ? 1 : 0, 1.0f, 0.0f, 99, step});
  std::vector<float> repeated;
  for (size_t i = 0; i < rows.size(); ++i) repeated.insert(repeated.end(), logits.begin(), logits.end());
  const Sampled sampled = run(Tensor(repeated.data(), DType::kF32, {static_cast<int64_t>(rows.size()), vocab}), rows);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i].top_k == 1) {
      EXPECT_EQ(sampled.tokens[i], argmax);
    }
    EXPECT_NE(sampled.tokens[i], 3);
    EXPECT_NE(sampled.tokens[i], 17);
    EXPECT_NE(sampled.tokens[i], 40);
    EXPECT_TRUE(std::isfinite(sampled.logprobs[i]));
  }
}

TEST(SampleTokens, SameSeedAndStepGiveTheSameToken) {
  Random rng(1703);
  const OwnedTensor logits = random_tensor(DType::kF32, {1, 64}, rng, -1.0f, 1.0f);
  RowSettings s{1.0f, 0, 1.0f, 0.0f, 12345, 6};
  const int32_t first = run(*logits, {s}).tokens[0];
  for (int i = 0; i < 5; ++i) EXPECT_EQ(run(*logits, {s}).tokens[0], first);
}

TEST(SampleTokens, BadRowsAndParametersAreRejected) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> nan_row = {0.0f, std::nanf(""), 1.0f};
  std::vector<float> masked_row = {-inf, -inf, -inf};
  std::vector<float> plus_inf_row = {0.0f, inf, 1.0f};
  std::vector<float> good = {0.0f, 0.5f, 1.0f};
  for (auto* row : {&nan_row, &masked_row, &plus_inf_row}) {
    EXPECT_TRUE(testing::throws_error(
        [&] {
          run(Tensor(row->data(), DType::kF32, {1, 3}), {RowSettings{}});
        },
        ErrorCode::kInternal));
  }
  const Tensor good_tensor(good.data(), DType::kF32, {1, 3});
  for (const RowSettings bad : {RowSettings{-1.0f}, RowSettings{1.0f, -2}, RowSettings{1.0f, 0, 0.0f},
                                RowSettings{1.0f, 0, 1.5f}, RowSettings{1.0f, 0, 1.0f, 2.0f}}) {
    EXPECT_TRUE(testing::throws_error([&] { run(good_tensor, {bad}); }, ErrorCode::kInvalidArgument));
  }
}

}  // namespace
}  // namespace metrale
