// kernels::rejection_sample_rows on the CPU: the emitted token of a drafted row follows the target
// distribution p whatever the draft distribution q (chi-square against p over many draws, for a
// general q, a one-hot q, a q that misses tokens of p and q == p), the acceptance rate is
// sum_i min(p_i, q_i), and bad drafts are refused. The CUDA twin is checked against this one in
// tests/cuda/rejection_sampling_test.cpp.
#include "kernels/rejection_sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <random>
#include <vector>

#include "runtime/tensor.h"

namespace metrale {
namespace {

float uniform01(std::mt19937_64& rng) {
  return static_cast<float>(rng() >> 40) * 0x1p-24f;
}

std::vector<float> random_distribution(std::mt19937_64& rng, size_t vocab, size_t zeros) {
  std::vector<float> p(vocab);
  double total = 0.0;
  for (size_t i = 0; i < vocab; ++i) {
    p[i] = i < zeros ? 0.0f : 0.05f + uniform01(rng);
    total += p[i];
  }
  for (float& x : p) x = static_cast<float>(x / total);
  std::shuffle(p.begin(), p.end(), rng);
  return p;
}

struct Draws {
  std::vector<int64_t> counts;  // [V] emitted tokens
  int64_t accepted = 0;
};

// `trials` rows of p (and q, empty: one-hot), each with a draft drawn from q (one-hot: `fixed_draft`).
Draws draw(const std::vector<float>& p, const std::vector<float>& q, int32_t fixed_draft, int64_t trials,
           uint64_t seed) {
  const auto vocab = static_cast<int64_t>(p.size());
  std::mt19937_64 rng(seed);
  OwnedTensor target(DType::kF32, {trials, vocab}), draft_probs, drafts(DType::kI32, {trials}),
      accept_uniform(DType::kF32, {trials}), residual_uniform(DType::kF32, {trials}), tokens(DType::kI32, {trials}),
      accepted(DType::kI32, {trials});
  if (!q.empty()) draft_probs = OwnedTensor(DType::kF32, {trials, vocab});
  for (int64_t t = 0; t < trials; ++t) {
    std::copy(p.begin(), p.end(), target.tensor.data_as<float>() + t * vocab);
    int32_t d = fixed_draft;
    if (!q.empty()) {
      std::copy(q.begin(), q.end(), draft_probs.tensor.data_as<float>() + t * vocab);
      const float u = uniform01(rng);
      double running = 0.0;
      d = -1;
      for (int64_t i = 0; i < vocab; ++i) {
        if (q[static_cast<size_t>(i)] <= 0.0f) continue;
        d = static_cast<int32_t>(i);
        running += q[static_cast<size_t>(i)];
        if (running > u) break;
      }
    }
    drafts.tensor.data_as<int32_t>()[t] = d;
    accept_uniform.tensor.data_as<float>()[t] = uniform01(rng);
    residual_uniform.tensor.data_as<float>()[t] = uniform01(rng);
  }
  kernels::rejection_sample_rows({target.tensor, q.empty() ? Tensor() : draft_probs.tensor, drafts.tensor,
                                  accept_uniform.tensor, residual_uniform.tensor},
                                 tokens.tensor, accepted.tensor);
  Draws out;
  out.counts.assign(p.size(), 0);
  for (int64_t t = 0; t < trials; ++t) {
    const int32_t token = tokens.tensor.data_as<const int32_t>()[t];
    EXPECT_TRUE(token >= 0 && token < vocab) << "trial " << t;
    if (token < 0 || token >= vocab) continue;
    ++out.counts[static_cast<size_t>(token)];
    out.accepted += accepted.tensor.data_as<const int32_t>()[t];
  }
  return out;
}

// Pearson's chi-square of the counts against `trials` x p; tokens of p = 0 must never appear.
double chi_square(const Draws& draws, const std::vector<float>& p, int64_t trials) {
  double statistic = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double expected = static_cast<double>(trials) * p[i];
    if (expected == 0.0) {
      EXPECT_EQ(draws.counts[i], 0) << "token " << i << " has no target mass";
      continue;
    }
    const double diff = static_cast<double>(draws.counts[i]) - expected;
    statistic += diff * diff / expected;
  }
  return statistic;
}

// The chi-square quantile for a p-value of 1e-6 at `df` degrees of freedom (Wilson-Hilferty): a
// correct sampler fails it once in a million runs.
double chi_square_bound(int df) {
  const double z = 4.753;  // the standard normal's 1 - 1e-6 quantile
  const double k = static_cast<double>(df);
  const double c = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * c * c * c;
}

int degrees_of_freedom(const std::vector<float>& p) {
  return static_cast<int>(std::count_if(p.begin(), p.end(), [](float x) { return x > 0.0f; })) - 1;
}

// The acceptance rate of `draws` is `expected` within five binomial standard deviations.
void expect_acceptance_near(const Draws& draws, double expected, int64_t trials, const std::string& label) {
  const double sd = std::sqrt(expected * (1.0 - expected) / static_cast<double>(trials));
  EXPECT_NEAR(static_cast<double>(draws.accepted) / static_cast<double>(trials), expected, 5.0 * sd + 1e-9) << label;
}

TEST(RejectionSampling, EmittedTokensFollowTheTargetForAnyDraftDistribution) {
  constexpr int64_t kTrials = 60000;
  std::mt19937_64 rng(21);
  for (int c = 0; c < 6; ++c) {
    const size_t vocab = 3 + static_cast<size_t>(c) * 2;
    const std::vector<float> p = random_distribution(rng, vocab, c % 2 == 0 ? 0 : 1);
    // q misses some tokens of p, and has mass where p has none.
    const std::vector<float> q = random_distribution(rng, vocab, static_cast<size_t>(c % 3));
    const Draws draws = draw(p, q, -1, kTrials, 100 + static_cast<uint64_t>(c));
    EXPECT_LT(chi_square(draws, p, kTrials), chi_square_bound(degrees_of_freedom(p))) << "case " << c;
    // Acceptance: sum_i min(p_i, q_i).
    double overlap = 0.0;
    for (size_t i = 0; i < vocab; ++i) overlap += std::min(p[i], q[i]);
    expect_acceptance_near(draws, overlap, kTrials, "case " + std::to_string(c));
  }
}

TEST(RejectionSampling, DeterministicDraftsAreKeptWithTheirTargetProbability) {
  constexpr int64_t kTrials = 60000;
  std::mt19937_64 rng(5);
  const std::vector<float> p = random_distribution(rng, 7, 2);
  for (int32_t d = 0; d < 7; ++d) {
    const Draws draws = draw(p, {}, d, kTrials, 300 + static_cast<uint64_t>(d));
    EXPECT_LT(chi_square(draws, p, kTrials), chi_square_bound(degrees_of_freedom(p))) << "draft " << d;
    expect_acceptance_near(draws, p[static_cast<size_t>(d)], kTrials, "draft " + std::to_string(d));
  }
}

TEST(RejectionSampling, AWrongSamplerFailsTheTest) {
  // The statistic separates: draws that always keep the draft (no rejection) are far off p.
  constexpr int64_t kTrials = 60000;
  std::mt19937_64 rng(8);
  const std::vector<float> p = random_distribution(rng, 5, 0);
  const std::vector<float> q = random_distribution(rng, 5, 0);
  Draws biased = draw(q, q, -1, kTrials, 9);  // q == target: every draft kept, tokens follow q
  EXPECT_EQ(biased.accepted, kTrials);
  EXPECT_GT(chi_square(biased, p, kTrials), chi_square_bound(degrees_of_freedom(p)));
}

TEST(RejectionSampling, RefusesDraftsOutsideTheVocabulary) {
  OwnedTensor target(DType::kF32, {1, 4}), drafts(DType::kI32, {1}), u(DType::kF32, {1}), tokens(DType::kI32, {1}),
      accepted(DType::kI32, {1});
  std::fill_n(target.tensor.data_as<float>(), 4, 0.25f);
  drafts.tensor.data_as<int32_t>()[0] = 4;
  u.tensor.data_as<float>()[0] = 0.5f;
  EXPECT_THROW(kernels::rejection_sample_rows({target.tensor, Tensor(), drafts.tensor, u.tensor, u.tensor},
                                              tokens.tensor, accepted.tensor),
               Error);
}

}  // namespace
}  // namespace metrale
