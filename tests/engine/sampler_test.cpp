// Tests of the CPU sampler. Every expectation is derived by hand (or by an independent formula in
// double precision written out here), never recorded from a run of the sampler itself.
#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"

namespace metrale {
namespace {

constexpr float kMasked = -std::numeric_limits<float>::infinity();
constexpr int kDraws = 20000;

// Upper critical values of the chi-square distribution at p = 0.001, by degrees of freedom
// (standard statistical tables).
double chi_square_critical_p001(size_t degrees_of_freedom) {
  static constexpr double kTable[] = {0.0, 10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877};
  if (degrees_of_freedom == 0 || degrees_of_freedom >= std::size(kTable)) {
    ADD_FAILURE() << "no critical value for " << degrees_of_freedom << " degrees of freedom";
    return 0.0;
  }
  return kTable[degrees_of_freedom];
}

// Pearson's statistic of observed bin counts against expected bin probabilities (which sum to 1).
double chi_square(const std::vector<int64_t>& observed, const std::vector<double>& expected_probability) {
  EXPECT_EQ(observed.size(), expected_probability.size());
  const double total = static_cast<double>(std::accumulate(observed.begin(), observed.end(), int64_t{0}));
  double statistic = 0.0;
  for (size_t bin = 0; bin < observed.size(); ++bin) {
    const double expected = total * expected_probability[bin];
    EXPECT_GE(expected, 5.0) << "bin " << bin << " too small for a chi-square test";
    const double difference = static_cast<double>(observed[bin]) - expected;
    statistic += difference * difference / expected;
  }
  return statistic;
}

void expect_matches_distribution(const std::vector<int64_t>& observed, const std::vector<double>& expected_probability,
                                 const std::string& what) {
  const double statistic = chi_square(observed, expected_probability);
  const double critical = chi_square_critical_p001(observed.size() - 1);
  EXPECT_LT(statistic, critical) << what << ": chi-square " << statistic << " with " << observed.size() - 1
                                 << " degrees of freedom";
}

// Logits whose softmax at `temperature` is exactly `probabilities` (0 -> masked).
std::vector<float> logits_for(const std::vector<double>& probabilities, double temperature = 1.0) {
  std::vector<float> logits;
  for (double probability : probabilities) {
    logits.push_back(probability > 0.0 ? static_cast<float>(temperature * std::log(probability)) : kMasked);
  }
  return logits;
}

SampledToken draw(Sampler& sampler, std::vector<float> logits, const SamplingParams& params, uint64_t seed,
                  uint64_t step, std::span<const int32_t> prompt = {}, std::span<const int32_t> output = {}) {
  return sampler.sample(logits, params, prompt, output, seed, step);
}

// Counts of each token over kDraws steps of one seed.
std::vector<int64_t> token_counts(const std::vector<float>& logits, const SamplingParams& params, uint64_t seed,
                                  int num_draws = kDraws) {
  Sampler sampler;
  std::vector<int64_t> counts(logits.size(), 0);
  for (int step = 0; step < num_draws; ++step) {
    ++counts.at(static_cast<size_t>(draw(sampler, logits, params, seed, static_cast<uint64_t>(step)).token));
  }
  return counts;
}

// Keeps the counts of the listed tokens (in that order) and checks every other token was never drawn.
std::vector<int64_t> counts_of(const std::vector<int64_t>& counts, const std::vector<int32_t>& allowed) {
  std::vector<int64_t> kept;
  for (int32_t id : allowed) kept.push_back(counts[static_cast<size_t>(id)]);
  for (size_t id = 0; id < counts.size(); ++id) {
    if (std::find(allowed.begin(), allowed.end(), static_cast<int32_t>(id)) == allowed.end()) {
      EXPECT_EQ(counts[id], 0) << "token " << id << " was excluded but drawn";
    }
  }
  return kept;
}

std::vector<double> normalised(std::vector<double> weights) {
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  for (double& weight : weights) weight /= total;
  return weights;
}

// Reference log-softmax in double, independent of the sampler.
std::vector<double> reference_log_softmax(const std::vector<float>& logits) {
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float logit : logits) sum += std::exp(static_cast<double>(logit) - max_logit);
  std::vector<double> result;
  for (float logit : logits) result.push_back(static_cast<double>(logit) - max_logit - std::log(sum));
  return result;
}

void expect_error(const std::function<void()>& action, ErrorCode code, const std::string& fragment) {
  try {
    action();
    ADD_FAILURE() << "expected an error mentioning '" << fragment << "'";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), code) << error.what();
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Parameters

TEST(SamplerParamsTest, DefaultsAndBoundariesAreValid) {
  SamplingParams params;
  EXPECT_NO_THROW(params.validate());
  const std::vector<std::function<void(SamplingParams&)>> boundaries = {
      [](SamplingParams& p) { p.temperature = 0.0f; },
      [](SamplingParams& p) { p.temperature = 100.0f; },
      [](SamplingParams& p) { p.top_k = -1; },
      [](SamplingParams& p) { p.top_k = 1; },
      [](SamplingParams& p) { p.top_k = 1 << 30; },
      [](SamplingParams& p) { p.top_p = 1e-6f; },
      [](SamplingParams& p) { p.min_p = 1.0f; },
      [](SamplingParams& p) { p.repetition_penalty = 1e-3f; },
      [](SamplingParams& p) { p.repetition_penalty = 50.0f; },
      [](SamplingParams& p) { p.presence_penalty = -2.0f; },
      [](SamplingParams& p) { p.presence_penalty = 2.0f; },
      [](SamplingParams& p) { p.frequency_penalty = -2.0f; },
      [](SamplingParams& p) { p.frequency_penalty = 2.0f; },
      [](SamplingParams& p) { p.top_logprobs = 20; },
  };
  for (size_t i = 0; i < boundaries.size(); ++i) {
    SamplingParams boundary;
    boundaries[i](boundary);
    EXPECT_NO_THROW(boundary.validate()) << "boundary case " << i;
  }
}

TEST(SamplerParamsTest, RejectsEachOutOfRangeFieldByName) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    std::string field;
    std::function<void(SamplingParams&)> set;
  };
  const std::vector<Case> cases = {
      {"temperature", [](SamplingParams& p) { p.temperature = -0.1f; }},
      {"temperature", [&](SamplingParams& p) { p.temperature = nan; }},
      {"temperature", [&](SamplingParams& p) { p.temperature = inf; }},
      {"top_k", [](SamplingParams& p) { p.top_k = -2; }},
      {"top_p", [](SamplingParams& p) { p.top_p = 0.0f; }},
      {"top_p", [](SamplingParams& p) { p.top_p = -0.5f; }},
      {"top_p", [](SamplingParams& p) { p.top_p = 1.01f; }},
      {"top_p", [&](SamplingParams& p) { p.top_p = nan; }},
      {"min_p", [](SamplingParams& p) { p.min_p = -0.01f; }},
      {"min_p", [](SamplingParams& p) { p.min_p = 1.5f; }},
      {"min_p", [&](SamplingParams& p) { p.min_p = nan; }},
      {"repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = 0.0f; }},
      {"repetition_penalty", [](SamplingParams& p) { p.repetition_penalty = -1.0f; }},
      {"repetition_penalty", [&](SamplingParams& p) { p.repetition_penalty = nan; }},
      {"repetition_penalty", [&](SamplingParams& p) { p.repetition_penalty = inf; }},
      {"presence_penalty", [](SamplingParams& p) { p.presence_penalty = -2.01f; }},
      {"presence_penalty", [](SamplingParams& p) { p.presence_penalty = 2.5f; }},
      {"presence_penalty", [&](SamplingParams& p) { p.presence_penalty = nan; }},
      {"frequency_penalty", [](SamplingParams& p) { p.frequency_penalty = -3.0f; }},
      {"frequency_penalty", [](SamplingParams& p) { p.frequency_penalty = 2.01f; }},
      {"frequency_penalty", [&](SamplingParams& p) { p.frequency_penalty = nan; }},
      {"top_logprobs", [](SamplingParams& p) { p.top_logprobs = -1; }},
      {"top_logprobs", [](SamplingParams& p) { p.top_logprobs = 21; }},
  };
  for (const Case& test_case : cases) {
    SamplingParams params;
    test_case.set(params);
    SCOPED_TRACE(test_case.field);
    expect_error([&] { params.validate(); }, ErrorCode::kInvalidArgument, test_case.field);
  }
}

TEST(SamplerParamsTest, SampleValidatesItsParameters) {
  Sampler sampler;
  SamplingParams params;
  params.top_p = 0.0f;
  std::vector<float> logits = {0.0f, 1.0f};
  expect_error([&] { sampler.sample(logits, params, {}, {}, 1, 0); }, ErrorCode::kInvalidArgument, "top_p");
}

TEST(SamplerParamsTest, GreedyBelowTheTemperatureThreshold) {
  SamplingParams params;
  params.temperature = 0.0f;
  EXPECT_TRUE(params.is_greedy());
  params.temperature = 1e-5f;
  EXPECT_TRUE(params.is_greedy());
  params.temperature = 2e-5f;
  EXPECT_FALSE(params.is_greedy());
  params.temperature = 1.0f;
  EXPECT_FALSE(params.is_greedy());
}

// ---------------------------------------------------------------------------------------------
// The random stream

TEST(SamplerRandomTest, SplitMixMatchesPublishedReferenceOutputs) {
  // First outputs of Vigna's splitmix64.c seeded with 0, with 1234567 and with 2^64 - 1.
  EXPECT_EQ(splitmix64_at(0, 0), 0xe220a8397b1dcdafULL);
  EXPECT_EQ(splitmix64_at(0, 1), 0x6e789e6aa1b965f4ULL);
  EXPECT_EQ(splitmix64_at(0, 2), 0x06c45d188009454fULL);
  EXPECT_EQ(splitmix64_at(1234567, 0), 6457827717110365317ULL);
  EXPECT_EQ(splitmix64_at(1234567, 1), 3203168211198807973ULL);
  EXPECT_EQ(splitmix64_at(1234567, 2), 9817491932198370423ULL);
  EXPECT_EQ(splitmix64_at(~0ULL, 0), 0xe4d971771b652c20ULL);
}

TEST(SamplerRandomTest, UniformFollowsTheDocumentedFormula) {
  for (uint64_t seed : {0ULL, 1ULL, 42ULL, 0xdeadbeefULL, ~0ULL}) {
    for (uint64_t step : {0ULL, 1ULL, 7ULL, 1000ULL, 1ULL << 40}) {
      const uint64_t bits = splitmix64_at(splitmix64_at(seed, 0), step);
      EXPECT_EQ(uniform_for(seed, step), static_cast<float>(static_cast<double>(bits >> 40) / 16777216.0));
    }
  }
}

TEST(SamplerRandomTest, UniformIsInRangeOnA24BitGridAndUniform) {
  constexpr int kBins = 10;
  std::vector<int64_t> bins(kBins, 0);
  for (uint64_t step = 0; step < 100000; ++step) {
    const float u = uniform_for(7, step);
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    const float scaled = u * 16777216.0f;
    ASSERT_EQ(scaled, std::floor(scaled)) << "not a multiple of 2^-24";
    ++bins[static_cast<size_t>(u * kBins)];
  }
  expect_matches_distribution(bins, std::vector<double>(kBins, 1.0 / kBins), "uniform_for over steps");

  // Across seeds at a fixed step too: the engine draws a seed per request and samples step 0 first.
  std::fill(bins.begin(), bins.end(), 0);
  for (uint64_t seed = 0; seed < 100000; ++seed) ++bins[static_cast<size_t>(uniform_for(seed, 0) * kBins)];
  expect_matches_distribution(bins, std::vector<double>(kBins, 1.0 / kBins), "uniform_for over seeds");
}

// ---------------------------------------------------------------------------------------------
// Greedy and penalties

TEST(SamplerGreedyTest, ArgmaxWithTiesToTheLowestId) {
  Sampler sampler;
  SamplingParams params;
  params.temperature = 0.0f;
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 3.0f, kMasked, 3.0f};
  for (uint64_t seed = 0; seed < 50; ++seed) EXPECT_EQ(draw(sampler, logits, params, seed, seed).token, 1);
  params.temperature = 1e-5f;
  EXPECT_EQ(draw(sampler, logits, params, 3, 0).token, 1);
  // Top-k = 1 at a normal temperature keeps the same single token (its ties broken the same way).
  params.temperature = 1.0f;
  params.top_k = 1;
  for (uint64_t seed = 0; seed < 50; ++seed) EXPECT_EQ(draw(sampler, logits, params, seed, 0).token, 1);
  // All negative, with a masked first token.
  params = SamplingParams{};
  params.temperature = 0.0f;
  EXPECT_EQ(draw(sampler, {kMasked, -5.0f, -0.5f, -0.5f}, params, 0, 0).token, 2);
}

TEST(SamplerPenaltyTest, HandComputedRepetitionFrequencyPresence) {
  Sampler sampler;
  SamplingParams params;
  params.repetition_penalty = 2.0f;
  params.frequency_penalty = 0.5f;
  params.presence_penalty = 0.25f;
  std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 0.0f};
  const std::vector<int32_t> prompt = {0, 1};
  const std::vector<int32_t> output = {1, 2, 2, 4};
  sampler.apply_penalties(logits, params, prompt, output);
  // id 0: prompt only, positive        -> 2 / 2 = 1
  // id 1: prompt + output once, negative -> -1 * 2 - (0.5 * 1 + 0.25) = -2.75
  // id 2: output twice, positive       -> 0.5 / 2 - (0.5 * 2 + 0.25) = -1
  // id 3: untouched                    -> 3
  // id 4: output once, negative        -> -2 * 2 - 0.75 = -4.75
  // id 5: untouched                    -> 0
  const std::vector<float> expected = {1.0f, -2.75f, -1.0f, 3.0f, -4.75f, 0.0f};
  EXPECT_EQ(logits, expected);
}

TEST(SamplerPenaltyTest, EachPenaltyTouchesOnlyWhatItShould) {
  Sampler sampler;
  {
    // Repetition: a prompt id repeated counts once; zero stays zero; masked stays masked.
    SamplingParams params;
    params.repetition_penalty = 4.0f;
    std::vector<float> logits = {4.0f, -4.0f, 0.0f, kMasked, 8.0f};
    const std::vector<int32_t> prompt = {0, 0, 0, 1, 2, 3};
    sampler.apply_penalties(logits, params, prompt, {});
    EXPECT_EQ(logits, (std::vector<float>{1.0f, -16.0f, 0.0f, kMasked, 8.0f}));
  }
  {
    // Frequency and presence: only output ids; prompt ids are left alone.
    SamplingParams params;
    params.frequency_penalty = 1.0f;
    params.presence_penalty = 0.5f;
    std::vector<float> logits = {1.0f, 1.0f, 1.0f};
    const std::vector<int32_t> prompt = {0};
    const std::vector<int32_t> output = {2, 2, 2};
    sampler.apply_penalties(logits, params, prompt, output);
    EXPECT_EQ(logits, (std::vector<float>{1.0f, 1.0f, 1.0f - 3.0f - 0.5f}));
  }
  {
    // Negative penalties encourage.
    SamplingParams params;
    params.presence_penalty = -1.0f;
    params.frequency_penalty = -0.5f;
    std::vector<float> logits = {1.0f, 1.0f};
    const std::vector<int32_t> output = {1, 1};
    sampler.apply_penalties(logits, params, {}, output);
    EXPECT_EQ(logits, (std::vector<float>{1.0f, 1.0f + 1.0f + 1.0f}));
  }
  {
    // Penalties keep live tokens live: overflow clamps to the largest float instead of +-inf.
    SamplingParams params;
    params.repetition_penalty = 0.01f;
    std::vector<float> logits = {3e38f, -3e38f};
    const std::vector<int32_t> prompt = {0};
    sampler.apply_penalties(logits, params, prompt, {});
    EXPECT_EQ(logits[0], std::numeric_limits<float>::max());
    params.repetition_penalty = 100.0f;
    sampler.apply_penalties(logits, params, std::vector<int32_t>{1}, {});
    EXPECT_EQ(logits[1], -std::numeric_limits<float>::max());
  }
}

TEST(SamplerPenaltyTest, RejectsOutOfVocabularyIdsAndRecovers) {
  Sampler sampler;
  SamplingParams params;
  params.repetition_penalty = 2.0f;
  params.frequency_penalty = 1.0f;
  std::vector<float> logits = {2.0f, 2.0f, 2.0f};
  const std::vector<int32_t> good = {0, 1};
  const std::vector<int32_t> too_large = {1, 3};
  const std::vector<int32_t> negative = {-1};
  expect_error([&] { sampler.apply_penalties(logits, params, too_large, {}); }, ErrorCode::kInvalidArgument, "3");
  expect_error([&] { sampler.apply_penalties(logits, params, good, negative); }, ErrorCode::kInvalidArgument, "-1");
  expect_error([&] { sampler.sample(logits, params, {}, too_large, 0, 0); }, ErrorCode::kInvalidArgument, "vocabulary");
  EXPECT_EQ(logits, (std::vector<float>{2.0f, 2.0f, 2.0f})) << "a rejected call must not modify the row";
  // A failed call leaves no trace: token 1 is penalised once for the prompt, nothing counts twice.
  const std::vector<int32_t> output = {1};
  sampler.apply_penalties(logits, params, good, output);
  EXPECT_EQ(logits, (std::vector<float>{1.0f, 0.0f, 2.0f}));
}

TEST(SamplerPenaltyTest, PenaltiesDecideTheGreedyToken) {
  Sampler sampler;
  SamplingParams params;
  params.temperature = 0.0f;
  const std::vector<float> logits = {2.0f, 1.5f};
  const std::vector<int32_t> first = {0};
  EXPECT_EQ(draw(sampler, logits, params, 0, 0, first, first).token, 0);
  params.presence_penalty = 1.0f;  // 2 - 1 = 1 < 1.5
  EXPECT_EQ(draw(sampler, logits, params, 0, 0, {}, first).token, 1);
  EXPECT_EQ(draw(sampler, logits, params, 0, 0, first, {}).token, 0) << "presence ignores the prompt";
  params.presence_penalty = 0.0f;
  params.repetition_penalty = 1.5f;  // 2 / 1.5 = 1.33 < 1.5
  EXPECT_EQ(draw(sampler, logits, params, 0, 0, first, {}).token, 1);
  params.repetition_penalty = 1.2f;  // 2 / 1.2 = 1.67 > 1.5
  EXPECT_EQ(draw(sampler, logits, params, 0, 0, first, {}).token, 0);
}

TEST(SamplerPenaltyTest, PenalisedDistributionMatchesByChiSquare) {
  // probabilities {1/2, 1/4, 1/4}; a frequency penalty of ln 2 on the first token's one occurrence
  // halves its weight, giving {1/3, 1/3, 1/3}.
  SamplingParams params;
  params.frequency_penalty = static_cast<float>(std::log(2.0));
  const std::vector<float> logits = logits_for({0.5, 0.25, 0.25});
  const std::vector<int32_t> output = {0};
  Sampler sampler;
  std::vector<int64_t> counts(3, 0);
  for (int step = 0; step < kDraws; ++step) ++counts[draw(sampler, logits, params, 99, step, {}, output).token];
  expect_matches_distribution(counts, {1.0 / 3, 1.0 / 3, 1.0 / 3}, "frequency penalty");
}

// ---------------------------------------------------------------------------------------------
// Truncation: top-k, top-p, min-p

// Six live tokens scattered over ten ids (the rest masked), so that id order is not probability order.
// By probability: id 7 (0.4), 2 (0.25), 9 (0.15), 0 (0.1), 5 (0.06), 3 (0.04).
const std::vector<int32_t> kIdsByProbability = {7, 2, 9, 0, 5, 3};
const std::vector<double> kProbabilities = {0.4, 0.25, 0.15, 0.1, 0.06, 0.04};

std::vector<float> scattered_logits(double temperature = 1.0) {
  std::vector<double> probabilities(10, 0.0);
  for (size_t rank = 0; rank < kIdsByProbability.size(); ++rank) {
    probabilities[static_cast<size_t>(kIdsByProbability[rank])] = kProbabilities[rank];
  }
  return logits_for(probabilities, temperature);
}

std::vector<int32_t> most_likely(size_t count) {
  return {kIdsByProbability.begin(), kIdsByProbability.begin() + static_cast<std::ptrdiff_t>(count)};
}

TEST(SamplerTruncationTest, NeverDrawsAnExcludedTokenAndKeepsAtLeastOne) {
  struct Case {
    std::string name;
    SamplingParams params;
    std::vector<int32_t> allowed;
  };
  std::vector<Case> cases;
  auto add = [&](std::string name, size_t kept, std::function<void(SamplingParams&)> set) {
    SamplingParams params;
    set(params);
    cases.push_back({std::move(name), params, most_likely(kept)});
  };
  add("no truncation", 6, [](SamplingParams&) {});
  add("top_k 2", 2, [](SamplingParams& p) { p.top_k = 2; });
  add("top_k 1", 1, [](SamplingParams& p) { p.top_k = 1; });
  add("top_k 100 (larger than the vocabulary)", 6, [](SamplingParams& p) { p.top_k = 100; });
  add("top_p 0.75 (0.4 + 0.25 + 0.15 = 0.8 reaches it)", 3, [](SamplingParams& p) { p.top_p = 0.75f; });
  add("top_p 0.35 (the first token alone reaches it)", 1, [](SamplingParams& p) { p.top_p = 0.35f; });
  add("top_p 1e-6", 1, [](SamplingParams& p) { p.top_p = 1e-6f; });
  add("min_p 0.2 (drops below 0.08)", 4, [](SamplingParams& p) { p.min_p = 0.2f; });
  add("min_p 1", 1, [](SamplingParams& p) { p.min_p = 1.0f; });
  // Top-4 renormalised: {0.444, 0.278, 0.167, 0.111}; top-p 0.8 is reached by the third.
  add("top_k 4 then top_p 0.8", 3, [](SamplingParams& p) {
    p.top_k = 4;
    p.top_p = 0.8f;
  });
  // After top-p 0.95 keeps five tokens, min-p 0.3 drops those below 0.3 x 0.4 = 0.12.
  add("top_p 0.95 then min_p 0.3", 3, [](SamplingParams& p) {
    p.top_p = 0.95f;
    p.min_p = 0.3f;
  });
  add("all at their tightest", 1, [](SamplingParams& p) {
    p.top_k = 1;
    p.top_p = 1e-6f;
    p.min_p = 1.0f;
  });
  // A high temperature flattens the distribution but the same tokens stay excluded by top-k.
  add("top_k 3 at temperature 5", 3, [](SamplingParams& p) {
    p.top_k = 3;
    p.temperature = 5.0f;
  });

  const std::vector<float> logits = scattered_logits();
  Sampler sampler;
  for (const Case& test_case : cases) {
    SCOPED_TRACE(test_case.name);
    std::vector<int64_t> counts(logits.size(), 0);
    for (uint64_t i = 0; i < 3000; ++i) ++counts[draw(sampler, logits, test_case.params, i * 7919 + 1, i).token];
    const std::vector<int64_t> kept = counts_of(counts, test_case.allowed);
    for (size_t rank = 0; rank < kept.size(); ++rank) {
      EXPECT_GT(kept[rank], 0) << "allowed token " << test_case.allowed[rank] << " never drawn";
    }
  }
}

TEST(SamplerTruncationTest, TopKBreaksBoundaryTiesByLowerId) {
  // Four tokens tie for the second place; top-2 keeps the lowest id among them.
  const std::vector<float> logits = {1.0f, 1.0f, 5.0f, 1.0f, 1.0f};
  SamplingParams params;
  params.top_k = 2;
  params.temperature = 10.0f;
  const std::vector<int64_t> counts = token_counts(logits, params, 5, 2000);
  const std::vector<int64_t> kept = counts_of(counts, {2, 0});
  EXPECT_GT(kept[1], 0);
}

TEST(SamplerTruncationTest, MaskedAndHeavilyPenalisedTokens) {
  Sampler sampler;
  SamplingParams params;
  params.repetition_penalty = 100.0f;
  const std::vector<int32_t> prompt = {0, 1};
  // Token 0 is pushed to the lowest float by the penalty but stays live; token 1 stays masked.
  for (uint64_t step = 0; step < 200; ++step) {
    EXPECT_EQ(draw(sampler, {-3e38f, kMasked}, params, 11, step, prompt).token, 0);
  }
  // A one-token vocabulary, greedy or not.
  EXPECT_EQ(draw(sampler, {3.0f}, SamplingParams{}, 1, 0).token, 0);
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  EXPECT_EQ(draw(sampler, {3.0f}, greedy, 1, 0).logprob, 0.0f);
  // A single live token among masked ones is always drawn, whatever the truncation.
  params = SamplingParams{};
  params.top_p = 0.1f;
  params.min_p = 0.9f;
  params.top_k = 3;
  for (uint64_t step = 0; step < 200; ++step) {
    EXPECT_EQ(draw(sampler, {kMasked, kMasked, kMasked, -7.0f, kMasked}, params, step, step).token, 3);
  }
}

// ---------------------------------------------------------------------------------------------
// Distributions, by chi-square at p = 0.001

TEST(SamplerDistributionTest, TemperatureOnlyMatchesSoftmax) {
  // Logits T * ln(p) at temperature T give back p.
  SamplingParams params;
  params.temperature = 0.7f;
  const std::vector<int64_t> counts = token_counts(scattered_logits(0.7), params, 12345);
  expect_matches_distribution(counts_of(counts, most_likely(6)), kProbabilities, "temperature 0.7");
}

TEST(SamplerDistributionTest, TemperatureFlattens) {
  // Logits ln(p) at temperature 2 give probabilities proportional to sqrt(p).
  SamplingParams params;
  params.temperature = 2.0f;
  std::vector<double> expected;
  for (double probability : kProbabilities) expected.push_back(std::sqrt(probability));
  const std::vector<int64_t> counts = token_counts(scattered_logits(), params, 2024);
  expect_matches_distribution(counts_of(counts, most_likely(6)), normalised(expected), "temperature 2");
}

TEST(SamplerDistributionTest, TopKRenormalises) {
  SamplingParams params;
  params.top_k = 3;
  const std::vector<int64_t> counts = token_counts(scattered_logits(), params, 777);
  expect_matches_distribution(counts_of(counts, most_likely(3)), {0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8}, "top_k 3");
}

TEST(SamplerDistributionTest, TopPRenormalises) {
  // Cumulative 0.4, 0.65, 0.8, 0.9: top-p 0.85 keeps four tokens, renormalised by 0.9.
  SamplingParams params;
  params.top_p = 0.85f;
  const std::vector<int64_t> counts = token_counts(scattered_logits(), params, 31337);
  expect_matches_distribution(counts_of(counts, most_likely(4)), {0.4 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.1 / 0.9},
                              "top_p 0.85");
}

TEST(SamplerDistributionTest, TopPAfterTemperature) {
  // At temperature 2 the probabilities are sqrt(p) / 2.2809 = {0.277, 0.219, 0.170, 0.139, ...}; their
  // running sums 0.277, 0.497, 0.666 reach top-p 0.6 at the third token.
  SamplingParams params;
  params.temperature = 2.0f;
  params.top_p = 0.6f;
  const std::vector<int64_t> counts = token_counts(scattered_logits(), params, 4242);
  expect_matches_distribution(counts_of(counts, most_likely(3)),
                              normalised({std::sqrt(0.4), std::sqrt(0.25), std::sqrt(0.15)}), "top_p 0.6 at T = 2");
}

TEST(SamplerDistributionTest, MinPRenormalises) {
  // min-p 0.3 drops probabilities below 0.3 x 0.4 = 0.12: three tokens remain, renormalised by 0.8.
  SamplingParams params;
  params.min_p = 0.3f;
  const std::vector<int64_t> counts = token_counts(scattered_logits(), params, 8080);
  expect_matches_distribution(counts_of(counts, most_likely(3)), {0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8}, "min_p 0.3");
}

// A wider vocabulary whose mass lies mostly beyond the sampler's sorted prefix, so draws and cuts go
// deep into the row: ids [0, 500) have logit 0 (weight 1) and ids [500, 2048) logit -ln 4 (weight 1/4);
// total weight 500 + 1548 / 4 = 887. Within a tie the lower id ranks first. Tokens are counted in bins
// of 256 ids; kWideDraws keeps the test quick in sanitizer builds while every bin expects >= 140 draws.
constexpr size_t kWideVocab = 2048;
constexpr size_t kWideHeavy = 500;
constexpr size_t kWideBin = 256;
constexpr int kWideDraws = 3000;

std::vector<float> wide_logits() {
  std::vector<float> logits(kWideVocab, static_cast<float>(-std::log(4.0)));
  std::fill(logits.begin(), logits.begin() + kWideHeavy, 0.0f);
  return logits;
}

// Expected bin probabilities when exactly the ids [0, kept_end) survive truncation.
std::vector<double> wide_expected_bins(size_t kept_end) {
  std::vector<double> bins((kept_end + kWideBin - 1) / kWideBin, 0.0);
  for (size_t id = 0; id < kept_end; ++id) bins[id / kWideBin] += id < kWideHeavy ? 1.0 : 0.25;
  return normalised(bins);
}

std::vector<int64_t> wide_observed_bins(const std::vector<int64_t>& counts, size_t kept_end) {
  std::vector<int64_t> bins((kept_end + kWideBin - 1) / kWideBin, 0);
  for (size_t id = 0; id < counts.size(); ++id) {
    if (id >= kept_end) {
      EXPECT_EQ(counts[id], 0) << "token " << id << " was excluded but drawn";
    } else {
      bins[id / kWideBin] += counts[id];
    }
  }
  return bins;
}

TEST(SamplerDistributionTest, WideVocabularyUntruncated) {
  const std::vector<int64_t> counts = token_counts(wide_logits(), SamplingParams{}, 55, kWideDraws);
  expect_matches_distribution(wide_observed_bins(counts, kWideVocab), wide_expected_bins(kWideVocab), "wide");
}

TEST(SamplerDistributionTest, WideVocabularyTopP) {
  // top-p 0.9 needs 0.9 x 887 = 798.3: the 500 heavy tokens give 500, and 1194 light ones (ids up to
  // 1693) bring it to 798.5 (1193 would stop at 798.25).
  SamplingParams params;
  params.top_p = 0.9f;
  const std::vector<int64_t> counts = token_counts(wide_logits(), params, 56, kWideDraws);
  expect_matches_distribution(wide_observed_bins(counts, 1694), wide_expected_bins(1694), "wide top_p 0.9");
}

TEST(SamplerDistributionTest, WideVocabularyTopK) {
  // top-k 1200 keeps the 500 heavy tokens and the light ones with the lowest ids, [500, 1200).
  SamplingParams params;
  params.top_k = 1200;
  const std::vector<int64_t> counts = token_counts(wide_logits(), params, 57, kWideDraws);
  expect_matches_distribution(wide_observed_bins(counts, 1200), wide_expected_bins(1200), "wide top_k 1200");
}

TEST(SamplerDistributionTest, WideVocabularyMinP) {
  // min-p 0.3 drops every weight below 0.3: only the 500 heavy tokens remain.
  SamplingParams params;
  params.min_p = 0.3f;
  const std::vector<int64_t> counts = token_counts(wide_logits(), params, 58, kWideDraws);
  expect_matches_distribution(wide_observed_bins(counts, kWideHeavy), wide_expected_bins(kWideHeavy), "wide min_p");
}

// ---------------------------------------------------------------------------------------------
// Against a reference: a direct transcription of the pipeline (full sort, double precision, std::exp)
// that shares no code with the sampler. Draws whose target lands within 1e-6 (relative) of a boundary
// are skipped, since float weights may legitimately put them on either side.

struct ReferenceRow {
  std::vector<int32_t> kept_in_order;  // kept ids, most likely first
  std::vector<double> cumulative;      // running mass along kept_in_order
  bool ambiguous = false;              // a truncation boundary sits within rounding distance
};

ReferenceRow reference_truncation(std::vector<float> logits, const SamplingParams& params,
                                  const std::vector<int32_t>& prompt, const std::vector<int32_t>& output) {
  // Penalties, exactly as specified (float arithmetic is the specification here).
  std::vector<int32_t> output_count(logits.size(), 0);
  for (int32_t id : output) ++output_count[id];
  std::vector<bool> seen(logits.size(), false);
  for (int32_t id : prompt) seen[id] = true;
  for (int32_t id : output) seen[id] = true;
  for (size_t id = 0; id < logits.size(); ++id) {
    if (!seen[id] || std::isinf(logits[id])) continue;
    float x = logits[id];
    x = x > 0.0f ? x / params.repetition_penalty : x * params.repetition_penalty;
    if (output_count[id] > 0) {
      x -= params.frequency_penalty * static_cast<float>(output_count[id]) + params.presence_penalty;
    }
    logits[id] = x;
  }
  std::vector<int32_t> order;
  for (size_t id = 0; id < logits.size(); ++id) {
    if (logits[id] > kMasked) order.push_back(static_cast<int32_t>(id));
  }
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  ReferenceRow result;
  if (order.empty()) {
    ADD_FAILURE() << "reference: no live token";
    return result;
  }
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  auto weight = [&](int32_t id) { return std::exp((logits[id] - max_logit) / params.temperature); };
  if (params.top_k > 0 && static_cast<size_t>(params.top_k) < order.size()) order.resize(params.top_k);
  if (params.top_p < 1.0f) {
    double total = 0.0;
    for (int32_t id : order) total += weight(id);
    const double threshold = static_cast<double>(params.top_p) * total;
    double running = 0.0;
    size_t kept = 0;
    while (kept < order.size()) {
      const double before = running;
      running += weight(order[kept++]);
      if (std::abs(running - threshold) < 1e-6 * total || std::abs(before - threshold) < 1e-6 * total) {
        result.ambiguous = true;
      }
      if (running >= threshold) break;
    }
    order.resize(kept);
  }
  if (params.min_p > 0.0f) {
    std::vector<int32_t> kept;
    for (int32_t id : order) {
      if (std::abs(weight(id) - params.min_p) < 1e-6) result.ambiguous = true;
      if (weight(id) >= params.min_p) kept.push_back(id);
    }
    order = kept;
  }
  double running = 0.0;
  for (int32_t id : order) {
    running += weight(id);
    result.cumulative.push_back(running);
  }
  result.kept_in_order = order;
  return result;
}

struct ReferenceTally {
  int compared = 0;
  int skipped = 0;
};

// Draws `steps` tokens of one row with the sampler and checks each against the reference.
void compare_with_reference(Sampler& sampler, const std::vector<float>& logits, const SamplingParams& params,
                            const std::vector<int32_t>& prompt, const std::vector<int32_t>& output, uint64_t seed,
                            uint64_t steps, ReferenceTally& tally) {
  const ReferenceRow reference = reference_truncation(logits, params, prompt, output);
  if (reference.ambiguous || reference.kept_in_order.empty()) {
    tally.skipped += static_cast<int>(steps);
    return;
  }
  const std::vector<double> log_softmax = reference_log_softmax(logits);
  const double mass = reference.cumulative.back();
  for (uint64_t step = 0; step < steps; ++step) {
    const double target = static_cast<double>(uniform_for(seed, step)) * mass;
    const size_t crossing =
        static_cast<size_t>(std::upper_bound(reference.cumulative.begin(), reference.cumulative.end(), target) -
                            reference.cumulative.begin());
    ASSERT_LT(crossing, reference.kept_in_order.size());
    const double before = crossing == 0 ? 0.0 : reference.cumulative[crossing - 1];
    if (std::abs(reference.cumulative[crossing] - target) < 1e-6 * mass || std::abs(before - target) < 1e-6 * mass) {
      ++tally.skipped;
      continue;
    }
    const SampledToken token = draw(sampler, logits, params, seed, step, prompt, output);
    EXPECT_EQ(token.token, reference.kept_in_order[crossing]) << "step " << step;
    EXPECT_NEAR(token.logprob, log_softmax[static_cast<size_t>(token.token)], 1e-4);
    ++tally.compared;
  }
}

TEST(SamplerReferenceTest, MatchesADirectTranscriptionOfThePipeline) {
  std::mt19937 generator(2718);
  Sampler sampler;
  ReferenceTally tally;
  for (int row_case = 0; row_case < 48; ++row_case) {
    const size_t vocab = std::vector<size_t>{40, 3000, 10000}[row_case % 3];
    const float spread = std::vector<float>{0.3f, 2.0f, 6.0f}[(row_case / 3) % 3];
    std::normal_distribution<float> normal(0.0f, spread);
    std::vector<float> logits(vocab);
    for (float& logit : logits) logit = normal(generator);
    for (size_t i = 0; i < vocab; i += 19) logits[i] = kMasked;            // masked tokens
    for (size_t i = 3; i + 7 < vocab; i += 23) logits[i + 7] = logits[i];  // exact ties
    SamplingParams params;
    params.temperature = std::vector<float>{0.3f, 1.0f, 1.7f}[row_case % 3 == 0 ? 1 : (row_case / 2) % 3];
    params.top_k = std::vector<int32_t>{0, 1, 7, 100, 5000, -1}[(row_case / 2) % 6];
    params.top_p = std::vector<float>{1.0f, 0.5f, 0.9f, 0.99f}[(row_case / 4) % 4];
    params.min_p = std::vector<float>{0.0f, 0.0f, 0.02f, 0.3f}[(row_case / 5) % 4];
    std::vector<int32_t> prompt;
    std::vector<int32_t> output;
    if (row_case % 2 == 1) {
      params.repetition_penalty = 1.3f;
      params.frequency_penalty = 0.4f;
      params.presence_penalty = -0.3f;
      std::uniform_int_distribution<int32_t> any_id(0, static_cast<int32_t>(vocab) - 1);
      for (int i = 0; i < 30; ++i) prompt.push_back(any_id(generator));
      for (int i = 0; i < 10; ++i) output.push_back(any_id(generator));
    }
    SCOPED_TRACE(::testing::Message() << "case " << row_case << " V=" << vocab << " spread=" << spread
                                      << " T=" << params.temperature << " top_k=" << params.top_k
                                      << " top_p=" << params.top_p << " min_p=" << params.min_p);
    compare_with_reference(sampler, logits, params, prompt, output, 1000 + static_cast<uint64_t>(row_case), 40, tally);
  }
  EXPECT_GT(tally.compared, 1500);
  EXPECT_LT(tally.skipped, tally.compared / 20);
}

TEST(SamplerReferenceTest, SignedZerosTieByIdDeepInTheRow) {
  // -0 and +0 compare equal, so they rank by id. 300 likely tokens (more than the sorted prefix takes)
  // come first; then 1700 zeros of alternating sign, which hold two thirds of the mass, so most draws land
  // among them, past the sorted prefix.
  std::vector<float> logits(2000);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = i % 2 == 0 ? -0.0f : 0.0f;
  for (size_t i = 0; i < 300; ++i) logits[i * 6 + 1] = 1.0f;
  Sampler sampler;
  ReferenceTally tally;
  compare_with_reference(sampler, logits, SamplingParams{}, {}, {}, 77, 300, tally);
  SamplingParams top_p;
  top_p.top_p = 0.7f;
  compare_with_reference(sampler, logits, top_p, {}, {}, 78, 300, tally);
  EXPECT_GT(tally.compared, 500);
}

// ---------------------------------------------------------------------------------------------
// Determinism

TEST(SamplerDeterminismTest, SameSeedAndStepSameToken) {
  std::vector<float> logits(64);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
  SamplingParams params;
  params.top_p = 0.95f;
  Sampler first;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    Sampler fresh;
    const uint64_t step = seed * 3;
    EXPECT_EQ(draw(first, logits, params, seed, step).token, draw(fresh, logits, params, seed, step).token);
    EXPECT_EQ(draw(first, logits, params, seed, step).token, draw(first, logits, params, seed, step).token);
  }
}

TEST(SamplerDeterminismTest, DifferentSeedsGiveDifferentStreams) {
  // Uniform over 64 tokens: two independent streams agree at a step with probability 1/64, so over 200
  // steps about 3 agreements are expected; 20 is far out of reach for independent streams.
  const std::vector<float> logits(64, 0.0f);
  Sampler sampler;
  const SamplingParams params;
  int agreements = 0;
  std::set<int32_t> seen;
  for (uint64_t step = 0; step < 200; ++step) {
    const int32_t a = draw(sampler, logits, params, 1, step).token;
    const int32_t b = draw(sampler, logits, params, 2, step).token;
    agreements += a == b;
    seen.insert(a);
  }
  EXPECT_LT(agreements, 20);
  EXPECT_GT(seen.size(), 40u) << "one stream should visit most of 64 equally likely tokens in 200 steps";
}

TEST(SamplerDeterminismTest, IndependentOfOtherRequestsAndCallOrder) {
  // Request A alone, then the same request with two other requests (other vocabularies, penalties and
  // truncations) sampled between its steps by the same Sampler, in both orders.
  struct Request {
    std::vector<float> logits;
    SamplingParams params;
    std::vector<int32_t> prompt;
    uint64_t seed;
  };
  auto make_logits = [](size_t vocab, double frequency) {
    std::vector<float> logits(vocab);
    for (size_t i = 0; i < vocab; ++i)
      logits[i] = static_cast<float>(2.0 * std::cos(frequency * static_cast<double>(i)));
    return logits;
  };
  Request a{make_logits(300, 0.11), {}, {1, 2, 3}, 1001};
  a.params.repetition_penalty = 1.3f;
  a.params.frequency_penalty = 0.4f;
  a.params.top_p = 0.9f;
  a.params.top_logprobs = 5;
  Request b{make_logits(5000, 0.013), {}, {7, 7, 4999}, 2002};
  b.params.top_k = 40;
  b.params.min_p = 0.05f;
  b.params.temperature = 0.6f;
  Request c{make_logits(50, 0.7), {}, {}, 3003};
  c.params.temperature = 0.0f;
  c.params.presence_penalty = 1.5f;

  auto run = [](std::vector<Request*> order, int steps) {
    Sampler sampler;
    std::vector<std::vector<int32_t>> outputs(order.size());
    std::vector<std::vector<float>> logprobs(order.size());
    for (int step = 0; step < steps; ++step) {
      for (size_t r = 0; r < order.size(); ++r) {
        const Request& request = *order[r];
        const SampledToken token = draw(sampler, request.logits, request.params, request.seed,
                                        static_cast<uint64_t>(step), request.prompt, outputs[r]);
        outputs[r].push_back(token.token);
        logprobs[r].push_back(token.logprob);
      }
    }
    return std::make_pair(outputs, logprobs);
  };
  constexpr int kSteps = 100;
  const auto alone = run({&a}, kSteps);
  const auto b_alone = run({&b}, kSteps);
  const auto mixed = run({&b, &a, &c}, kSteps);
  const auto reversed = run({&c, &a, &b}, kSteps);
  EXPECT_EQ(alone.first[0], mixed.first[1]);
  EXPECT_EQ(alone.first[0], reversed.first[1]);
  EXPECT_EQ(alone.second[0], mixed.second[1]);
  EXPECT_EQ(b_alone.first[0], mixed.first[0]);
  EXPECT_EQ(b_alone.first[0], reversed.first[2]);
}

// ---------------------------------------------------------------------------------------------
// Logprobs

TEST(SamplerLogprobTest, FullRowSumsToOneOrderedAndMatchesReference) {
  std::vector<float> logits(20);
  for (size_t i = 0; i < logits.size(); ++i)
    logits[i] = static_cast<float>(3.0 * std::sin(1.3 * static_cast<double>(i)));
  const std::vector<double> reference = reference_log_softmax(logits);
  SamplingParams params;
  params.top_logprobs = 20;
  Sampler sampler;
  for (uint64_t step = 0; step < 50; ++step) {
    const SampledToken token = draw(sampler, logits, params, 4, step);
    ASSERT_EQ(token.top_logprobs.size(), 20u);
    double total = 0.0;
    for (size_t i = 0; i < token.top_logprobs.size(); ++i) {
      const auto [id, logprob] = token.top_logprobs[i];
      total += std::exp(static_cast<double>(logprob));
      EXPECT_NEAR(logprob, reference[static_cast<size_t>(id)], 1e-5);
      if (i > 0) {
        EXPECT_GE(token.top_logprobs[i - 1].second, logprob);
      }
    }
    EXPECT_NEAR(total, 1.0, 1e-5);
    EXPECT_NEAR(token.logprob, reference[static_cast<size_t>(token.token)], 1e-5);
  }
}

TEST(SamplerLogprobTest, TiesByLowerIdAndClampedToTheVocabulary) {
  Sampler sampler;
  SamplingParams params;
  params.top_logprobs = 3;
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, 2.0f, 3.0f};
  SampledToken token = draw(sampler, logits, params, 0, 0);
  ASSERT_EQ(token.top_logprobs.size(), 3u);
  EXPECT_EQ(token.top_logprobs[0].first, 1);
  EXPECT_EQ(token.top_logprobs[1].first, 2);
  EXPECT_EQ(token.top_logprobs[2].first, 4);
  EXPECT_EQ(token.top_logprobs[0].second, token.top_logprobs[2].second);
  params.top_logprobs = 4;
  token = draw(sampler, logits, params, 0, 0);
  ASSERT_EQ(token.top_logprobs.size(), 4u);
  EXPECT_EQ(token.top_logprobs[3].first, 3);

  // More requested than the vocabulary holds; a masked token is reported last, as -inf.
  params.top_logprobs = 5;
  token = draw(sampler, {0.0f, kMasked, 0.0f}, params, 0, 0);
  ASSERT_EQ(token.top_logprobs.size(), 3u);
  EXPECT_EQ(token.top_logprobs[0], (std::pair<int32_t, float>{0, static_cast<float>(-std::log(2.0))}));
  EXPECT_EQ(token.top_logprobs[1].first, 2);
  EXPECT_EQ(token.top_logprobs[2], (std::pair<int32_t, float>{1, kMasked}));
  EXPECT_NE(token.token, 1);

  params.top_logprobs = 0;
  EXPECT_TRUE(draw(sampler, logits, params, 0, 0).top_logprobs.empty());
}

TEST(SamplerLogprobTest, ReportsTheRawDistributionDespitePenaltiesAndTemperature) {
  Sampler sampler;
  SamplingParams params;
  params.temperature = 0.0f;
  params.presence_penalty = 1.0f;
  params.top_logprobs = 2;
  const std::vector<float> logits = {2.0f, 1.5f};
  const std::vector<int32_t> output = {0};
  const SampledToken token = draw(sampler, logits, params, 0, 0, {}, output);
  // The penalty makes token 1 win, but the reported numbers are those of the raw logits.
  const double log_normalizer = 2.0 + std::log(1.0 + std::exp(-0.5));
  EXPECT_EQ(token.token, 1);
  EXPECT_NEAR(token.logprob, 1.5 - log_normalizer, 1e-6);
  ASSERT_EQ(token.top_logprobs.size(), 2u);
  EXPECT_EQ(token.top_logprobs[0].first, 0);
  EXPECT_NEAR(token.top_logprobs[0].second, 2.0 - log_normalizer, 1e-6);

  // Same when sampling at a temperature with repetition penalty on a penalised token.
  params = SamplingParams{};
  params.temperature = 0.5f;
  params.repetition_penalty = 1.7f;
  const std::vector<double> reference = reference_log_softmax(scattered_logits());
  const std::vector<int32_t> prompt = {7, 2, 9};
  for (uint64_t step = 0; step < 100; ++step) {
    const SampledToken sampled = draw(sampler, scattered_logits(), params, 8, step, prompt);
    EXPECT_NEAR(sampled.logprob, reference[static_cast<size_t>(sampled.token)], 1e-6);
  }
}

TEST(SamplerLogprobTest, LargeVocabularyMatchesReference) {
  // A Qwen-sized row of pseudo-random logits, sampled with every stage enabled.
  constexpr size_t kVocab = 151936;
  std::mt19937 generator(17);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(kVocab);
  for (float& logit : logits) logit = normal(generator);
  for (size_t i = kVocab - 200; i < kVocab; ++i) logits[i] = kMasked;  // padded vocabulary
  const std::vector<double> reference = reference_log_softmax(logits);
  std::vector<int32_t> by_rank(kVocab);
  std::iota(by_rank.begin(), by_rank.end(), 0);
  std::stable_sort(by_rank.begin(), by_rank.end(), [&](int32_t x, int32_t y) { return logits[x] > logits[y]; });

  const std::vector<int32_t> prompt = {5, 6, 7, by_rank[0]};
  const std::vector<int32_t> output = {by_rank[1], by_rank[1], 9};
  Sampler sampler;
  for (int variant = 0; variant < 4; ++variant) {
    SamplingParams params;
    params.top_logprobs = 20;
    params.repetition_penalty = 1.1f;
    params.frequency_penalty = 0.2f;
    if (variant == 1) params.top_k = 50;
    if (variant == 2) params.top_p = 0.9f;
    if (variant == 3) {
      params.min_p = 0.05f;
      params.temperature = 0.0f;
    }
    SCOPED_TRACE(variant);
    const SampledToken token = draw(sampler, logits, params, 123, static_cast<uint64_t>(variant), prompt, output);
    ASSERT_GE(token.token, 0);
    ASSERT_LT(static_cast<size_t>(token.token), kVocab - 200);
    EXPECT_NEAR(token.logprob, reference[static_cast<size_t>(token.token)], 1e-4);
    ASSERT_EQ(token.top_logprobs.size(), 20u);
    for (size_t rank = 0; rank < 20; ++rank) {
      EXPECT_EQ(token.top_logprobs[rank].first, by_rank[rank]);
      EXPECT_NEAR(token.top_logprobs[rank].second, reference[static_cast<size_t>(by_rank[rank])], 1e-4);
    }
    if (variant == 1) {
      // The drawn token must be among the 50 best after penalties: recompute them independently.
      std::vector<double> penalised(logits.begin(), logits.end());
      for (int32_t id : prompt) penalised[id] = penalised[id] > 0 ? penalised[id] / 1.1 : penalised[id] * 1.1;
      penalised[by_rank[1]] =
          (penalised[by_rank[1]] > 0 ? penalised[by_rank[1]] / 1.1 : penalised[by_rank[1]] * 1.1) - 0.4;
      penalised[9] = (penalised[9] > 0 ? penalised[9] / 1.1 : penalised[9] * 1.1) - 0.2;
      const double drawn = penalised[static_cast<size_t>(token.token)];
      const auto better = std::count_if(penalised.begin(), penalised.end(), [&](double x) { return x > drawn; });
      EXPECT_LT(better, 50);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Broken rows

TEST(SamplerErrorTest, NanInfAndFullyMaskedRowsAreInternalErrors) {
  Sampler sampler;
  const SamplingParams params;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  expect_error([&] { draw(sampler, {0.0f, 1.0f, nan, 2.0f}, params, 0, 0); }, ErrorCode::kInternal, "NaN at token 2");
  expect_error([&] { draw(sampler, {0.0f, -nan, 1.0f}, params, 0, 0); }, ErrorCode::kInternal, "NaN at token 1");
  expect_error([&] { draw(sampler, {0.0f, inf}, params, 0, 0); }, ErrorCode::kInternal, "+inf at token 1");
  expect_error([&] { draw(sampler, {kMasked, kMasked}, params, 0, 0); }, ErrorCode::kInternal, "-inf");
  expect_error([&] { draw(sampler, {}, params, 0, 0); }, ErrorCode::kInternal, "empty");
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  expect_error([&] { draw(sampler, {nan}, greedy, 0, 0); }, ErrorCode::kInternal, "NaN");
}

}  // namespace
}  // namespace metrale
