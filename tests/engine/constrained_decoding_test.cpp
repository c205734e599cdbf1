// Constrained decoding through the engine (engine/token_constraint.h, engine/constrained_rows.h):
// every emitted token is one the request's constraint allowed, with and without speculative drafts,
// greedy and sampled; the constraint's own history ends equal to the output (drafts it accepted
// while masking were rolled back); rows a constraint leaves free sample unmasked; logit_bias moves
// the choice.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>
#include <memory>

#include "engine/constrained_rows.h"
#include "engine/engine.h"
#include "engine/request_helpers.h"
#include "model/registry.h"
#include "test_models_helpers.h"

namespace metrale {
namespace {

using testing::make_request;

// Allows at output position k the tokens t with t % 3 == k % 3 (several choices per row, so drafts
// are sometimes refused); the first `free_rows` positions are unconstrained.
class ResidueConstraint : public TokenConstraint {
 public:
  ResidueConstraint(int64_t vocab, int32_t free_rows) : vocab_(vocab), free_rows_(free_rows) {}

  static bool allowed_at(int64_t position, int32_t token) { return token % 3 == position % 3; }

  bool fill_next_mask(std::span<uint32_t> bitmask) override {
    ++masks_filled;
    const auto position = static_cast<int64_t>(history.size());
    if (position < free_rows_) return false;
    for (int64_t t = 0; t < vocab_; ++t) {
      if (allowed_at(position, static_cast<int32_t>(t))) bitmask[static_cast<size_t>(t / 32)] |= 1u << (t % 32);
    }
    return true;
  }
  bool accept(int32_t token) override {
    const auto position = static_cast<int64_t>(history.size());
    if (position >= free_rows_ && !allowed_at(position, token)) return false;
    history.push_back(token);
    return true;
  }
  void rollback(int32_t num_tokens) override {
    ASSERT_LE(num_tokens, static_cast<int32_t>(history.size()));
    history.resize(history.size() - static_cast<size_t>(num_tokens));
    rolled_back += num_tokens;
  }

  std::vector<int32_t> history;
  int64_t masks_filled = 0;
  int64_t rolled_back = 0;

 private:
  int64_t vocab_;
  int32_t free_rows_;
};

struct ConstrainedRun {
  std::map<int64_t, testing::Generated> outputs;
  std::vector<std::shared_ptr<ResidueConstraint>> constraints;
  int64_t drafted = 0;
};

ConstrainedRun generate(const std::filesystem::path& model_dir, SpeculativeConfig speculative, float temperature,
                        int32_t free_rows = 0) {
  EngineConfig config;
  config.block_size = 4;
  config.max_model_len = 256;
  config.speculative = speculative;
  Engine engine(load_model(model_dir, Device::cpu()), config);
  ConstrainedRun run;
  // Prompts with repeats, so that n-gram lookup finds drafts.
  const std::vector<std::vector<int32_t>> prompts = {
      {5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8}, {9, 12, 15, 9, 12, 15, 9, 12}, {20, 21, 22, 23, 24}};
  for (size_t i = 0; i < prompts.size(); ++i) {
    Request request = make_request(prompts[i], 24, temperature, 11 + i);
    auto constraint = std::make_shared<ResidueConstraint>(96, free_rows);
    request.constraint = constraint;
    run.constraints.push_back(constraint);
    engine.add_request(std::move(request));
  }
  run.outputs = testing::run_to_completion(engine);
  run.drafted = engine.stats().drafted_tokens;
  return run;
}

void expect_valid(const ConstrainedRun& run, int32_t free_rows) {
  ASSERT_EQ(run.outputs.size(), run.constraints.size());
  size_t i = 0;
  for (const auto& [id, generated] : run.outputs) {
    ASSERT_EQ(generated.tokens.size(), 24u) << "request " << id;
    for (size_t k = static_cast<size_t>(free_rows); k < generated.tokens.size(); ++k)
      EXPECT_TRUE(ResidueConstraint::allowed_at(static_cast<int64_t>(k), generated.tokens[k]))
          << "request " << id << " token " << k << " = " << generated.tokens[k];
    EXPECT_EQ(run.constraints[i]->history, generated.tokens) << "request " << id;
    ++i;
  }
}

SpeculativeConfig ngram(int32_t drafts) {
  SpeculativeConfig config;
  config.method = SpeculativeMethod::kNgram;
  config.num_drafts = drafts;
  config.ngram_min = 1;
  config.ngram_max = 3;
  config.adaptive = false;  // the controller's choices depend on step timings: keep the drafts fixed
  return config;
}

TEST(ConstrainedDecoding, EveryTokenIsAllowedGreedyAndSampled) {
  const auto dir = testing::write_tiny_qwen3({}, "constrained_plain");
  for (const float temperature : {0.0f, 1.0f}) {
    SCOPED_TRACE(temperature);
    const ConstrainedRun run = generate(dir, {}, temperature);
    expect_valid(run, 0);
    for (const auto& constraint : run.constraints) EXPECT_EQ(constraint->rolled_back, 0);
  }
}

TEST(ConstrainedDecoding, SpeculativeDraftsAreCheckedAndRolledBack) {
  const auto dir = testing::write_tiny_qwen3({}, "constrained_spec");
  const ConstrainedRun plain = generate(dir, {}, 0.0f);
  const ConstrainedRun speculative = generate(dir, ngram(3), 0.0f);
  ASSERT_GT(speculative.drafted, 0) << "the n-gram drafter proposed nothing; the test checks nothing";
  expect_valid(speculative, 0);
  // Greedy: drafts never change the output, constrained or not.
  EXPECT_EQ(testing::tokens_of(speculative.outputs), testing::tokens_of(plain.outputs));
  int64_t rolled_back = 0;
  for (const auto& constraint : speculative.constraints) rolled_back += constraint->rolled_back;
  EXPECT_GT(rolled_back, 0);
  // Sampled with drafts: rejection sampling against the masked distribution keeps every token valid.
  expect_valid(generate(dir, ngram(3), 1.0f), 0);
}

TEST(ConstrainedDecoding, FreeRowsSampleUnmasked) {
  const auto dir = testing::write_tiny_qwen3({}, "constrained_free");
  const ConstrainedRun unconstrained = [&] {
    EngineConfig config;
    config.block_size = 4;
    config.max_model_len = 256;
    Engine engine(load_model(dir, Device::cpu()), config);
    ConstrainedRun run;
    engine.add_request(make_request({5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8}, 24));
    run.outputs = testing::run_to_completion(engine);
    return run;
  }();
  const ConstrainedRun run = generate(dir, {}, 0.0f, /*free_rows=*/4);
  expect_valid(run, 4);
  // The first request's free prefix is the unconstrained greedy output's.
  const auto& free = run.outputs.begin()->second.tokens;
  const auto& reference = unconstrained.outputs.begin()->second.tokens;
  EXPECT_TRUE(std::equal(free.begin(), free.begin() + 4, reference.begin()));
}

TEST(ConstrainedDecoding, LogitBiasMovesTheChoice) {
  const auto dir = testing::write_tiny_qwen3({}, "logit_bias");
  EngineConfig config;
  config.block_size = 4;
  Engine engine(load_model(dir, Device::cpu()), config);
  Request request = make_request({5, 6, 7}, 6);
  request.sampling.logit_bias = {{42, 100.0f}};
  const int64_t id = engine.add_request(std::move(request));
  Request out_of_range = make_request({5, 6, 7}, 6);
  out_of_range.sampling.logit_bias = {{96, 1.0f}};
  EXPECT_THROW(engine.add_request(std::move(out_of_range)), Error);
  Request too_large = make_request({5, 6, 7}, 6);
  too_large.sampling.logit_bias = {{3, 101.0f}};
  EXPECT_THROW(engine.add_request(std::move(too_large)), Error);
  const auto outputs = testing::run_to_completion(engine);
  EXPECT_EQ(outputs.at(id).tokens, std::vector<int32_t>(6, 42));
}

TEST(TokenBitmask, MasksClearedBitsAndRefusesAnEmptyMask) {
  std::vector<float> logits(40, 1.0f);
  std::vector<uint32_t> mask(2, 0u);
  EXPECT_FALSE(apply_token_bitmask(logits, mask));
  EXPECT_EQ(std::count(logits.begin(), logits.end(), 1.0f), 40);
  mask[1] = 1u << 3;  // token 35
  mask[0] = 1u;       // token 0
  EXPECT_TRUE(apply_token_bitmask(logits, mask));
  for (size_t t = 0; t < logits.size(); ++t) {
    if (t == 0 || t == 35) {
      EXPECT_EQ(logits[t], 1.0f);
    } else {
      EXPECT_EQ(logits[t], -std::numeric_limits<float>::infinity()) << t;
    }
  }
  // Bits past the row's width do not count as allowed tokens.
  std::vector<float> short_row(33, 0.0f);
  std::vector<uint32_t> high_only = {0u, 1u << 5};
  EXPECT_FALSE(apply_token_bitmask(short_row, high_only));
}

// The masks of a step applied to a whole logits tensor (the device path, here on CPU tensors through
// the kernel's CPU twin): each chunk's mask rows land on its sampling rows (a verify chunk's last
// 1 + drafts rows), rows of unconstrained chunks and mask-free rows are untouched, and the result
// equals process_row on each row (the host path).
TEST(ConstrainedRows, AppliesEachChunksMasksToItsRows) {
  constexpr int64_t kVocab = 70;
  ConstrainedRows rows(kVocab);
  Sequence decode, verify, plain, free_row;
  decode.id = 1;
  verify.id = 2;
  plain.id = 3;
  free_row.id = 4;
  for (Sequence* s : {&decode, &verify, &plain, &free_row}) {
    s->tokens = {1, 2, 3};
    s->num_prompt = 3;
  }
  decode.request.constraint = std::make_shared<ResidueConstraint>(kVocab, 0);
  verify.request.constraint = std::make_shared<ResidueConstraint>(kVocab, 0);
  free_row.request.constraint = std::make_shared<ResidueConstraint>(kVocab, /*free_rows=*/1);
  verify.draft_tokens = {0, 1};  // allowed at positions 0 and 1: rows 0..2 all masked
  SchedulePlan plan;
  plan.chunks = {{&plain, 1, true, 0}, {&verify, 2, true, 2}, {&decode, 1, true, 0}, {&free_row, 1, true, 0}};
  rows.begin(plan);
  rows.wait();
  // Logits rows: plain 0, verify 1..4 (a 2-token chunk and 2 drafts: sampling rows 2..4), decode 5,
  // free_row 6.
  std::vector<LogitRowUse> uses(4);
  const int64_t firsts[] = {0, 1, 5, 6}, counts[] = {1, 4, 1, 1};
  for (size_t u = 0; u < uses.size(); ++u) {
    uses[u].chunk = plan.chunks[u];
    uses[u].first_row = firsts[u];
    uses[u].num_rows = counts[u];
  }
  std::vector<float> logits(7 * kVocab);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(i % 97) * 0.25f;
  std::vector<float> host = logits;
  EXPECT_EQ(rows.apply_to_logits(Tensor(logits.data(), DType::kF32, {7, kVocab}, Device::cpu()), uses), 4);
  // The host path, row by row.
  for (int64_t r = 0; r < 3; ++r) {
    rows.process_row(verify, r, std::span<float>(host.data() + (2 + r) * kVocab, kVocab));
  }
  rows.process_row(decode, 0, std::span<float>(host.data() + 5 * kVocab, kVocab));
  rows.process_row(free_row, 0, std::span<float>(host.data() + 6 * kVocab, kVocab));
  EXPECT_EQ(logits, host);
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < 7; ++r) {
    // Output position of each row's token: verify rows 2..4 are positions 0..2.
    const bool masked = (r >= 2 && r <= 5);
    const int64_t position = r >= 2 && r <= 4 ? r - 2 : 0;
    for (int64_t t = 0; t < kVocab; ++t) {
      const float value = logits[static_cast<size_t>(r * kVocab + t)];
      if (masked && !ResidueConstraint::allowed_at(position, static_cast<int32_t>(t))) {
        EXPECT_EQ(value, kMasked) << "row " << r << " token " << t;
      } else {
        EXPECT_NE(value, kMasked) << "row " << r << " token " << t;
      }
    }
  }
  // The verify chunk's walk rolled back its drafts.
  EXPECT_TRUE(static_cast<ResidueConstraint&>(*verify.request.constraint).history.empty());
}

TEST(ConstrainedRows, AStepWithoutConstraintsMasksNothing) {
  ConstrainedRows rows(40);
  Sequence plain;
  plain.tokens = {1};
  plain.num_prompt = 1;
  SchedulePlan plan;
  plan.chunks = {{&plain, 1, true, 0}};
  rows.begin(plan);
  rows.wait();
  std::vector<LogitRowUse> uses(1);
  uses[0].chunk = plan.chunks[0];
  uses[0].num_rows = 1;
  std::vector<float> logits(40, 1.0f);
  EXPECT_EQ(rows.apply_to_logits(Tensor(logits.data(), DType::kF32, {1, 40}, Device::cpu()), uses), 0);
  EXPECT_EQ(std::count(logits.begin(), logits.end(), 1.0f), 40);
}

}  // namespace
}  // namespace metrale
