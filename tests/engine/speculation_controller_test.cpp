// The adaptive choice of drafts per step (SpeculationController, engine/speculator.h) against
// simulated step costs: it must find the best fixed k where drafting pays, stay within a few per
// cent of plain decoding where it does not, and not lock drafting off on stale MTP acceptance; and
// the incremental n-gram index proposes exactly what the scan proposes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "engine/ngram_index.h"
#include "engine/speculation_cost.h"
#include "engine/speculator.h"

namespace metrale {
namespace {

SpeculativeConfig adaptive_config(SpeculativeMethod method, int32_t num_drafts) {
  SpeculativeConfig config;
  config.method = method;
  config.num_drafts = num_drafts;
  config.adaptive = true;
  return config;
}

// A decode-only workload: `batch` sequences, each draft accepted with probability `acceptance`,
// a step verifying k drafts costs verify_seconds(k) (k = 0: plain) plus `drafter_seconds` when the
// MTP head runs after it (MTP only: a verify needs the drafts of a step that ran the head).
struct Workload {
  SpeculativeMethod method = SpeculativeMethod::kNgram;
  int32_t num_drafts = 3;
  int64_t batch = 8;
  double acceptance = 0.8;
  std::function<double(int64_t)> acceptance_at;  // when set: the acceptance of step s, not `acceptance`
  std::function<double(int32_t)> verify_seconds;
  double drafter_seconds = 0.0;
};

struct Outcome {
  double tokens_per_second = 0.0;
  std::vector<int64_t> steps_by_drafts;  // [num_drafts + 1]
  int64_t drafter_steps = 0;             // steps that ran the MTP head
  std::vector<int32_t> drafts_by_step;   // k of each step
};

Outcome simulate(const Workload& work, int64_t steps, double prior = 0.5) {
  SpeculationController controller(adaptive_config(work.method, work.num_drafts), prior);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  Outcome outcome;
  outcome.steps_by_drafts.assign(static_cast<size_t>(work.num_drafts) + 1, 0);
  std::vector<double> ema(static_cast<size_t>(work.batch), -1.0);
  bool have_mtp_drafts = false;
  double tokens = 0.0, seconds = 0.0;
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<double> acceptance(ema.size());
    for (size_t i = 0; i < ema.size(); ++i) acceptance[i] = controller.acceptance(ema[i]);
    const bool mtp = work.method == SpeculativeMethod::kMtp;
    std::vector<int32_t> available(ema.size(), work.num_drafts);
    const SpeculationController::Choice choice = controller.choose(acceptance, available, 0);
    const int32_t proposed = mtp && !have_mtp_drafts ? 0 : choice.drafts;
    std::fill(available.begin(), available.end(), proposed);
    const int32_t k =
        choice.explored ? proposed : std::min(proposed, controller.refine(proposed, acceptance, available, 0));
    const bool drafter_ran =
        mtp && !(choice.explored && choice.drafts == 0) && (choice.probe || controller.planned_drafts(work.batch) > 0);
    have_mtp_drafts = drafter_ran;
    outcome.drafter_steps += drafter_ran ? 1 : 0;
    double step_tokens = 0.0;
    const double step_acceptance = work.acceptance_at ? work.acceptance_at(step) : work.acceptance;
    for (double& sequence_ema : ema) {
      int64_t accepted = 0;
      while (accepted < k && uniform(rng) < step_acceptance) ++accepted;
      step_tokens += static_cast<double>(accepted + 1);
      if (k > 0) sequence_ema = controller.record_verify(sequence_ema, k, accepted);
    }
    const double step_seconds = work.verify_seconds(k) + (drafter_ran ? work.drafter_seconds : 0.0);
    controller.record_step({work.batch, 0, k, drafter_ran, step_seconds});
    ++outcome.steps_by_drafts[static_cast<size_t>(k)];
    outcome.drafts_by_step.push_back(k);
    tokens += step_tokens;
    seconds += step_seconds;
  }
  outcome.tokens_per_second = tokens / seconds;
  return outcome;
}

// Tokens per second of the best fixed k (k = 0: plain, no drafter).
double best_fixed_rate(const Workload& work, int32_t* best_k = nullptr) {
  double best = 0.0;
  for (int32_t k = 0; k <= work.num_drafts; ++k) {
    const double drafter = k > 0 ? work.drafter_seconds : 0.0;
    const double rate =
        static_cast<double>(work.batch) * expected_tokens(work.acceptance, k) / (work.verify_seconds(k) + drafter);
    if (rate > best) {
      best = rate;
      if (best_k != nullptr) *best_k = k;
    }
  }
  return best;
}

double plain_rate(const Workload& work) {
  return static_cast<double>(work.batch) / work.verify_seconds(0);
}

TEST(SpeculationController, FindsTheBestDraftCountWhenRowsAreNearlyFree) {
  // Memory-bound small batch: each draft row adds 2% to the step.
  Workload work;
  work.batch = 1;
  work.acceptance = 0.85;
  work.verify_seconds = [](int32_t k) { return 1e-3 * (1.0 + 0.02 * k); };
  int32_t best_k = 0;
  const double best = best_fixed_rate(work, &best_k);
  EXPECT_EQ(best_k, 3);
  const Outcome outcome = simulate(work, 2000);
  EXPECT_GE(outcome.tokens_per_second, 0.97 * best);
  EXPECT_GT(outcome.steps_by_drafts[3], 1900);
}

TEST(SpeculationController, StaysWithinThreePercentOfPlainWhenVerifyCostsMore) {
  // A MoE at batch 8: one more row per sequence touches many more experts (1.6x the plain step),
  // more than the 1.5 tokens per sequence one draft of acceptance 0.5 gives.
  Workload moe;
  moe.batch = 8;
  moe.acceptance = 0.5;
  moe.verify_seconds = [](int32_t k) { return k == 0 ? 1e-2 : 1e-2 * (1.6 + 0.3 * (k - 1)); };
  int32_t best_k = -1;
  best_fixed_rate(moe, &best_k);
  EXPECT_EQ(best_k, 0);
  EXPECT_GE(simulate(moe, 4000, 0.6).tokens_per_second, 0.98 * plain_rate(moe));
  // Compute-bound batch 256: rows cost in proportion.
  Workload bound;
  bound.batch = 256;
  bound.acceptance = 0.65;
  bound.verify_seconds = [](int32_t k) { return 2e-2 * (1.0 + k); };
  EXPECT_GE(simulate(bound, 4000, 0.6).tokens_per_second, 0.98 * plain_rate(bound));
  // Nothing accepted (n-gram over random text): drafting stays off but for rare probes.
  Workload none;
  none.batch = 64;
  none.acceptance = 0.0;
  none.verify_seconds = [](int32_t k) { return 5e-3 * (1.0 + 0.3 * k); };
  const Outcome off = simulate(none, 4000, 0.4);
  EXPECT_GE(off.tokens_per_second, 0.98 * plain_rate(none));
  EXPECT_GT(off.steps_by_drafts[0], 3900);
}

TEST(SpeculationController, MeasuresPlainDecodingApartFromTheMtpHead) {
  // The MTP head costs 15% of a step: verifies that run it must beat plain steps that do not.
  Workload pays;
  pays.method = SpeculativeMethod::kMtp;
  pays.batch = 1;
  pays.acceptance = 0.85;
  pays.verify_seconds = [](int32_t k) { return 3e-4 * (1.0 + 0.05 * k); };
  pays.drafter_seconds = 0.45e-4;
  const Outcome on = simulate(pays, 2000, 0.6);
  EXPECT_GE(on.tokens_per_second, 0.97 * best_fixed_rate(pays));
  // Plain decoding is measured now and then (a step without the head, then one preparing drafts).
  EXPECT_GT(on.steps_by_drafts[0], 2);
  // At batch 256 neither one draft nor three pay once the head's cost is counted.
  Workload loses = pays;
  loses.batch = 256;
  loses.acceptance = 0.6;
  loses.verify_seconds = [](int32_t k) { return 1e-2 * (1.0 + 0.6 * k); };
  loses.drafter_seconds = 0.2e-2;
  int32_t best_k = -1;
  best_fixed_rate(loses, &best_k);
  EXPECT_EQ(best_k, 0);
  const Outcome lost = simulate(loses, 4000, 0.6);
  EXPECT_GE(lost.tokens_per_second, 0.98 * plain_rate(loses));
  // The head runs only before the rare verifies (probes and re-measurements), not on plain steps.
  EXPECT_LT(lost.drafter_steps, 100);
}

TEST(SpeculationController, RefineDropsTheDraftsOfAFewSequencesInALargeBatch) {
  SpeculationController controller(adaptive_config(SpeculativeMethod::kNgram, 3), 0.6);
  // Measured at batch 256: plain 10 ms, one draft 16 ms.
  for (int i = 0; i < 4; ++i) {
    controller.record_step({256, 0, 0, false, 1e-2});
    controller.record_step({256, 0, 1, false, 1.6e-2});
  }
  std::vector<double> acceptance(256, 0.6);
  std::vector<int32_t> available(256, 0);
  std::fill(available.begin(), available.begin() + 4, 1);  // 4 sequences found an n-gram draft
  EXPECT_EQ(controller.refine(1, acceptance, available, 0), 0);
  std::fill(available.begin(), available.end(), 1);  // everyone did: 1.6 tokens for 1.6x the time
  EXPECT_EQ(controller.refine(1, acceptance, available, 0), 0);
  std::fill(acceptance.begin(), acceptance.end(), 0.9);
  EXPECT_EQ(controller.refine(1, acceptance, available, 0), 1);
}

TEST(SpeculationController, DoesNotSlowDownTheSlowestTenth) {
  SpeculationController controller(adaptive_config(SpeculativeMethod::kMtp, 3), 0.6);
  // Measured at batch 20: plain 10 ms, one draft 13 ms.
  for (int i = 0; i < 4; ++i) {
    controller.record_step({20, 0, 0, false, 1e-2});
    controller.record_step({20, 0, 1, true, 1.3e-2});
  }
  const std::vector<int32_t> available(20, 1);
  // Most sequences accept nearly everything, a few almost nothing: one draft would raise the
  // throughput by a third but slow those few down to 1.1 / 1.3 of their plain pace.
  std::vector<double> acceptance(20, 0.95);
  std::fill(acceptance.begin(), acceptance.begin() + 4, 0.1);
  EXPECT_EQ(controller.refine(1, acceptance, available, 0), 0);
  // One slow sequence in twenty is not the slowest tenth: drafting pays.
  std::fill(acceptance.begin() + 1, acceptance.begin() + 4, 0.95);
  EXPECT_EQ(controller.refine(1, acceptance, available, 0), 1);
}

TEST(SpeculationController, TheSlowestTenthIsNotTheNoiseOfItsEstimates) {
  SpeculationController controller(adaptive_config(SpeculativeMethod::kMtp, 3), 0.55);
  // Batch 8: plain 0.345 ms, one draft with the MTP head 0.453 ms (1.31x).
  for (int i = 0; i < 4; ++i) {
    controller.record_step({8, 0, 0, false, 0.345e-3});
    controller.record_step({8, 0, 1, true, 0.453e-3});
  }
  const std::vector<int32_t> available(8, 1);
  // Every sequence accepts 0.55; their EMAs after a dozen verifies scatter about that much. The
  // lowest, 0.3, would not keep its plain pace (1.3 < 1.31), but it is noise: drafting pays.
  const std::vector<double> noisy = {0.3, 0.45, 0.5, 0.55, 0.6, 0.62, 0.7, 0.68};
  EXPECT_EQ(controller.refine(1, noisy, available, 0), 1);
  // A spread far beyond the noise is real: two sequences at 0.05 hold drafting back.
  const std::vector<double> spread = {0.05, 0.05, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9};
  EXPECT_EQ(controller.refine(1, spread, available, 0), 0);
}

TEST(SpeculationController, PreparingMtpDraftsIsNeitherPlainNorAVerify) {
  SpeculationController controller(adaptive_config(SpeculativeMethod::kMtp, 3), 0.6);
  controller.record_step({4, 0, 0, true, 5e-3});
  EXPECT_LT(controller.measured_seconds(4, 0), 0.0);
  controller.record_step({4, 0, 0, false, 2e-3});
  controller.record_step({3, 0, 2, true, 3e-3});
  EXPECT_DOUBLE_EQ(controller.measured_seconds(4, 0), 2e-3);
  EXPECT_DOUBLE_EQ(controller.measured_seconds(4, 2), 3e-3);  // 3 and 4 sequences share a bucket
  EXPECT_LT(controller.measured_seconds(5, 2), 0.0);
}

TEST(SpeculationController, ProbesBackOffWhileDraftingDoesNotPay) {
  Workload none;
  none.batch = 16;
  none.acceptance = 0.0;
  none.verify_seconds = [](int32_t k) { return 1e-3 * (1.0 + k); };
  const Outcome few = simulate(none, 1000, 0.0);
  const Outcome many = simulate(none, 8000, 0.0);
  EXPECT_GT(few.steps_by_drafts[1], 0);
  // Probes at 64, 128, 256, 512, 1024 and then every 1024 steps, not every 64.
  EXPECT_LT(many.steps_by_drafts[1], 8000 / 256);
}

TEST(SpeculationController, TurnsDraftingBackOnWhenAcceptanceRises) {
  // The demo's MTP head at batch 64: launch-bound steps (a draft row costs 4% of a step, the head
  // half a step); acceptance 0.1 early in the generations (drafting does not pay and the estimates
  // sink), 0.85 from step 100 on (three drafts give twice the plain throughput). One probe moves the
  // estimates a fraction of the way: drafting resumes only because a probe that pays calls the next.
  Workload work;
  work.method = SpeculativeMethod::kMtp;
  work.batch = 64;
  work.acceptance_at = [](int64_t step) { return step < 100 ? 0.1 : 0.85; };
  work.verify_seconds = [](int32_t k) { return 0.42e-3 + 0.015e-3 * k; };
  work.drafter_seconds = 0.2e-3;
  const Outcome outcome = simulate(work, 600, 0.6);
  const auto drafting_between = [&](int64_t begin, int64_t end) {
    return std::count_if(outcome.drafts_by_step.begin() + begin, outcome.drafts_by_step.begin() + end,
                         [](int32_t k) { return k > 0; });
  };
  EXPECT_LT(drafting_between(20, 100), 10);  // off while it does not pay (probes aside)
  // Back on from the first probe after the change (probes come 64, then 128 steps apart).
  EXPECT_GT(drafting_between(200, 600), 380);
  EXPECT_GT(std::count(outcome.drafts_by_step.begin() + 200, outcome.drafts_by_step.end(), 3), 300);
}

// ---- Per-sequence drafts in the ragged layout

// Expected tokens per second of every per-sequence allocation (k_i <= available_i), the best of them.
double best_allocation_rate(std::span<const double> acceptance, std::span<const int32_t> available,
                            const std::function<double(int64_t)>& seconds) {
  std::vector<int32_t> drafts(acceptance.size(), 0);
  double best = 0.0;
  for (;;) {
    double tokens = 0.0;
    int64_t rows = 0;
    for (size_t i = 0; i < drafts.size(); ++i) {
      tokens += expected_tokens(acceptance[i], drafts[i]);
      rows += drafts[i];
    }
    best = std::max(best, tokens / seconds(rows));
    size_t i = 0;
    while (i < drafts.size() && drafts[i] == available[i]) drafts[i++] = 0;
    if (i == drafts.size()) break;
    ++drafts[i];
  }
  return best;
}

TEST(SpeculationCost, AllocationIsTheBestOfEveryPerSequenceChoice) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> uniform(0.0, 0.95);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t n = 1 + static_cast<size_t>(rng() % 5);
    std::vector<double> acceptance(n);
    std::vector<int32_t> available(n);
    for (size_t i = 0; i < n; ++i) {
      acceptance[i] = uniform(rng);
      available[i] = static_cast<int32_t>(rng() % 4);
    }
    // Step time: a fixed part, a per-row part and an MoE-like part that saturates (experts).
    const double fixed = 1.0, per_row = 0.01 * static_cast<double>(rng() % 20);
    const double expert = 0.1 * static_cast<double>(rng() % 10);
    const auto seconds = [&](int64_t rows) {
      const double touched = 1.0 - std::pow(0.8, static_cast<double>(static_cast<int64_t>(n) + rows));
      return fixed + per_row * static_cast<double>(rows) + expert * touched;
    };
    // No slow-tenth limit (floor 0): the throughput alone.
    const DraftAllocation allocation = allocate_drafts(acceptance, available, seconds, 0.0, 0.0);
    EXPECT_NEAR(allocation.rate(), best_allocation_rate(acceptance, available, seconds), 1e-9) << "trial " << trial;
    int64_t rows = 0;
    for (size_t i = 0; i < n; ++i) {
      EXPECT_LE(allocation.drafts[i], available[i]);
      rows += allocation.drafts[i];
    }
    EXPECT_EQ(rows, allocation.draft_rows);
  }
}

TEST(SpeculationCost, DraftsGoToTheSequencesThatAcceptAndNoneWhenNothingPays) {
  const std::vector<double> acceptance = {0.9, 0.05, 0.9, 0.05};
  const std::vector<int32_t> available(4, 3);
  // A draft row costs 4% of the step: the accepting sequences draft, the others do not.
  const auto cheap = [](int64_t rows) { return 1.0 + 0.04 * static_cast<double>(rows); };
  const DraftAllocation some = allocate_drafts(acceptance, available, cheap, 0.0, 0.0);
  EXPECT_GT(some.drafts[0], 0);
  EXPECT_GT(some.drafts[2], 0);
  EXPECT_EQ(some.drafts[1], 0);
  EXPECT_EQ(some.drafts[3], 0);
  // A draft row costs as much as the step: nothing pays.
  const auto dear = [](int64_t rows) { return 1.0 + static_cast<double>(rows); };
  EXPECT_EQ(allocate_drafts(acceptance, available, dear, 0.0, 0.0).draft_rows, 0);
  // The slowest tenth (acceptance 0.05, no drafts) must keep its plain pace: no draft row at all.
  EXPECT_EQ(allocate_drafts(acceptance, available, cheap, 0.05, 1.0).draft_rows, 0);
}

TEST(SpeculationCost, TheFitLearnsTheExpertTermFromRaggedSteps) {
  // Relative extra cost 0.1 + 0.02 D/n + 0.5 added: the fit, started from a prior that puts it all
  // on the rows, predicts it after a few dozen varied steps.
  RaggedVerifyFit fit;
  const RaggedVerifyFit::Vector prior{0.0, 0.3, 0.0};
  std::mt19937_64 rng(5);
  const auto truth = [](const RaggedVerifyFit::Vector& x) { return 0.1 * x[0] + 0.02 * x[1] + 0.5 * x[2]; };
  for (int i = 0; i < 60; ++i) {
    const double d = static_cast<double>(rng() % 8) / 2.0;
    // Within a bucket the batch size varies: the experts the drafts add are not a function of D.
    const double added = d > 0.0 ? 0.1 * static_cast<double>(1 + rng() % 10) : 0.0;
    const RaggedVerifyFit::Vector x{1.0, d, added};
    fit.add(x, truth(x));
  }
  for (const RaggedVerifyFit::Vector& x :
       {RaggedVerifyFit::Vector{1.0, 1.0, 0.6}, RaggedVerifyFit::Vector{1.0, 3.0, 0.9}})
    EXPECT_NEAR(fit.predict(x, prior), truth(x), 0.03 * (1.0 + truth(x)));
  // Unmeasured, it predicts the prior.
  const RaggedVerifyFit empty;
  EXPECT_NEAR(empty.predict({1.0, 2.0, 0.5}, prior), 0.6, 1e-12);
}

// A decode-only MoE workload with per-sequence acceptance and drafts: sequence i accepts each
// draft with probability acceptance[i] and finds drafts only when has_drafts[i] (n-gram lookup).
// A fixed-layout step pads every sequence to 1 + k rows; a ragged one has 1 + k_i rows per sequence
// and costs `eager` more (no graph). Step time: base + expert_seconds * distinct experts / E +
// row_seconds * rows, the experts of `rows` rows choosing top_k of E each.
struct MoeWorkload {
  std::vector<double> acceptance;
  std::vector<bool> has_drafts;
  int32_t num_drafts = 3;
  double experts = 64, top_k = 8;
  double base = 0.3e-3, expert_seconds = 0.7e-3, row_seconds = 0.002e-3, eager = 0.02e-3;
  double distinct(int64_t rows) const {
    return experts * (1.0 - std::pow(1.0 - top_k / experts, static_cast<double>(rows)));
  }
  double seconds(int64_t rows) const {
    return base + expert_seconds * distinct(rows) / experts + row_seconds * static_cast<double>(rows);
  }
};

struct MoeOutcome {
  double tokens_per_second = 0.0;
  int64_t ragged_steps = 0;
};

MoeOutcome simulate_moe(const MoeWorkload& work, int64_t steps) {
  const auto n = static_cast<int64_t>(work.acceptance.size());
  SpeculationController controller(adaptive_config(SpeculativeMethod::kNgram, work.num_drafts), 0.4,
                                   [&work](int64_t rows) { return work.distinct(rows) * 1e6; });
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<double> ema(static_cast<size_t>(n), -1.0);
  MoeOutcome outcome;
  double tokens = 0.0, seconds = 0.0;
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<double> acceptance(ema.size());
    for (size_t i = 0; i < ema.size(); ++i) acceptance[i] = controller.acceptance(ema[i]);
    std::vector<int32_t> available(ema.size(), work.num_drafts);
    const SpeculationController::Choice choice = controller.choose(acceptance, available, 0);
    for (size_t i = 0; i < ema.size(); ++i) available[i] = work.has_drafts[i] ? choice.drafts : 0;
    const SpeculationController::Layout layout = controller.layout(choice, acceptance, available, 0);
    int32_t longest = 0;
    int64_t draft_rows = 0;
    for (size_t i = 0; i < ema.size(); ++i) {
      const int32_t k = layout.drafts[i];
      longest = std::max(longest, k);
      draft_rows += k;
      int64_t accepted = 0;
      while (accepted < k && uniform(rng) < work.acceptance[i]) ++accepted;
      tokens += static_cast<double>(accepted + 1);
      if (k > 0) ema[i] = controller.record_verify(ema[i], k, accepted);
    }
    const bool ragged = layout.ragged && draft_rows > 0;
    const double step_seconds = ragged ? work.seconds(n + draft_rows) + work.eager : work.seconds(n * (1 + longest));
    SpeculativeStepRecord record;
    record.num_decoding = n;
    record.drafts = longest;
    record.seconds = step_seconds;
    record.draft_rows = draft_rows;
    record.ragged = ragged;
    controller.record_step(record);
    outcome.ragged_steps += ragged ? 1 : 0;
    seconds += step_seconds;
  }
  outcome.tokens_per_second = tokens / seconds;
  return outcome;
}

// The best fixed k of the MoE workload (padded layout), as tokens per second.
double best_fixed_moe_rate(const MoeWorkload& work) {
  const auto n = static_cast<int64_t>(work.acceptance.size());
  double best = 0.0;
  for (int32_t k = 0; k <= work.num_drafts; ++k) {
    double tokens = 0.0;
    for (size_t i = 0; i < work.acceptance.size(); ++i)
      tokens += expected_tokens(work.acceptance[i], work.has_drafts[i] ? k : 0);
    best = std::max(best, tokens / work.seconds(n * (1 + k)));
  }
  return best;
}

TEST(SpeculationController, DraftsPerSequenceInTheRaggedLayoutOnAMoe) {
  // Batch 8 of a MoE: two sequences repeat themselves (n-gram drafts, acceptance 0.9), six find
  // nothing. Padding every sequence to 1 + k rows routes those rows to experts too.
  MoeWorkload work;
  work.acceptance = {0.9, 0.1, 0.1, 0.9, 0.1, 0.1, 0.1, 0.1};
  work.has_drafts = {true, false, false, true, false, false, false, false};
  std::vector<int32_t> available(8, 0);
  for (size_t i = 0; i < 8; ++i) available[i] = work.has_drafts[i] ? work.num_drafts : 0;
  const auto n = static_cast<int64_t>(work.acceptance.size());
  const double oracle = best_allocation_rate(
      work.acceptance, available, [&](int64_t rows) { return work.seconds(n + rows) + (rows > 0 ? work.eager : 0.0); });
  const double fixed = best_fixed_moe_rate(work);
  ASSERT_GT(oracle, 1.1 * fixed);  // the workload is one where per-sequence drafts pay
  const MoeOutcome outcome = simulate_moe(work, 4000);
  EXPECT_GE(outcome.tokens_per_second, 0.95 * oracle);
  EXPECT_GT(outcome.ragged_steps, 3000);
}

TEST(SpeculationController, StaysNearPlainOnAMoeWhereNoDraftPays) {
  // Every sequence accepts little: neither layout pays; probes (ragged) cost almost nothing.
  MoeWorkload work;
  work.acceptance.assign(8, 0.15);
  work.has_drafts.assign(8, true);
  const auto n = static_cast<int64_t>(work.acceptance.size());
  const double plain = static_cast<double>(n) / work.seconds(n);
  EXPECT_GE(simulate_moe(work, 4000).tokens_per_second, 0.98 * plain);
}

// ---- N-gram index

TEST(NgramIndex, ProposesExactlyWhatTheScanProposes) {
  std::mt19937 rng(3);
  for (const int32_t vocab : {3, 8, 50}) {
    for (const auto& [ngram_min, ngram_max] : {std::pair{1, 1}, std::pair{1, 4}, std::pair{2, 3}}) {
      NgramIndex index;
      std::vector<int32_t> tokens;
      for (int i = 0; i < 300; ++i) {
        tokens.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab)));
        // Some calls are skipped (no drafts wanted): the index catches up on the next one, some
        // times through update() first.
        const int32_t max_drafts = i % 7 == 3 ? 0 : 1 + i % 5;
        if (i % 11 == 5) {
          index.update(tokens, ngram_min, ngram_max);
          EXPECT_EQ(index.pending(tokens), 0);
        }
        EXPECT_EQ(index.propose(tokens, ngram_min, ngram_max, max_drafts),
                  propose_ngram_drafts(tokens, ngram_min, ngram_max, max_drafts))
            << "vocab " << vocab << " n " << ngram_min << ".." << ngram_max << " length " << tokens.size();
      }
      // A shorter sequence (another request reusing the index) rebuilds it.
      tokens.resize(40);
      EXPECT_EQ(index.propose(tokens, ngram_min, ngram_max, 3), propose_ngram_drafts(tokens, ngram_min, ngram_max, 3));
    }
  }
}

}  // namespace
}  // namespace metrale
