// Speculative verify and commit (Model::commit_verified, GatedDeltaNet::commit) on tiny random hybrid
// checkpoints: a verify step of 1 + k_i rows per sequence (several sequences, different k), then a
// commit keeping any number of rows, leaves every recurrent layer's slots (conv window and delta-rule
// state) equal to plainly decoding the kept tokens one at a time, and the next step's logits equal;
// the verify step's logits equal those of plain decoding.
#include <gtest/gtest.h>

#include <cmath>

#include "core/test_support.h"
#include "model/model_helpers.h"
#include "model/registry.h"
#include "model/spec_helpers.h"

namespace metrale {
namespace {

using testing::random_tokens;
using testing::SpecRunner;
using testing::TinySpec;
using Rows = std::vector<std::vector<float>>;

// Same kernels on the same inputs in the same order: the states agree to fp32 rounding, in practice
// bit for bit.
constexpr double kStateTolerance = 1e-6;
constexpr double kLogitTolerance = 1e-5;

double max_abs_difference(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  }
  return worst;
}

TinySpec spec_for(const std::string& model_type) {
  TinySpec spec;
  spec.model_type = model_type;
  spec.num_layers = 4;  // GDN, attention, GDN, attention
  spec.full_attention_interval = 2;
  spec.head_dim = 16;
  spec.tie_word_embeddings = false;
  if (model_type == "qwen3_next") spec.mlp_only_layers = {2};
  return spec;
}

class VerifyCommit : public ::testing::TestWithParam<std::string> {};

// Three sequences verify 3, 1 and 2 drafts in one step (and a fourth, decoding without drafts, rides
// along); every kept count of the first sequence (1..4 rows: 0..3 accepted drafts) is combined with
// the others' counts cycling, and each case compared with plain decoding.
TEST_P(VerifyCommit, CommittedStateEqualsPlainDecoding) {
  const TinySpec spec = spec_for(GetParam());
  testing::TempDir dir;
  testing::write_tiny_checkpoint(dir.path(), spec, testing::make_tiny_weights(spec, 41));
  const auto model = load_model(dir.path(), Device::cpu());
  ASSERT_GT(model->verify_scratch_bytes(10, 4), 0u);
  EXPECT_TRUE(model->capabilities().supports_verify);
  const std::vector<size_t> prompt_lengths = {13, 6, 21, 9};
  const std::vector<size_t> drafts = {3, 1, 2, 0};
  std::vector<std::vector<int32_t>> prompts, verify_rows;
  for (size_t s = 0; s < prompt_lengths.size(); ++s) {
    prompts.push_back(random_tokens(spec, prompt_lengths[s], 100 + s));
    verify_rows.push_back(random_tokens(spec, 1 + drafts[s], 200 + s));
  }
  const std::vector<CacheSpec> specs = model->cache_specs();
  const auto prefill = [&](SpecRunner& runner) {
    std::vector<SpecRunner::Chunk> chunks;
    for (size_t s = 0; s < prompts.size(); ++s) chunks.push_back({static_cast<int64_t>(s), prompts[s]});
    (void)runner.step(chunks);
  };

  for (int32_t case_index = 0; case_index < 4; ++case_index) {
    std::vector<int32_t> kept(prompts.size());
    for (size_t s = 0; s < prompts.size(); ++s)
      kept[s] = 1 + (case_index + static_cast<int32_t>(s)) % static_cast<int32_t>(1 + drafts[s]);
    SCOPED_TRACE(::testing::Message() << "kept rows " << kept[0] << " " << kept[1] << " " << kept[2] << " " << kept[3]);

    SpecRunner speculative(*model, false), plain(*model, false);
    prefill(speculative);
    prefill(plain);
    std::vector<SpecRunner::Chunk> chunks;
    for (size_t s = 0; s < prompts.size(); ++s) chunks.push_back({static_cast<int64_t>(s), verify_rows[s]});
    const SpecRunner::Rows verified = speculative.step(chunks, /*verify=*/true);
    speculative.commit(kept);

    // Plain decoding of the kept tokens, one sequence and one token at a time.
    size_t row_base = 0;
    for (size_t s = 0; s < prompts.size(); ++s) {
      const auto seq = static_cast<int64_t>(s);
      for (int32_t i = 0; i < kept[s]; ++i) {
        const SpecRunner::Rows decoded = plain.step({{seq, {verify_rows[s][static_cast<size_t>(i)]}}});
        EXPECT_LT(max_abs_difference(verified.logits[row_base + static_cast<size_t>(i)], decoded.logits[0]),
                  kLogitTolerance)
            << "verify logits of sequence " << s << " row " << i;
        EXPECT_LT(max_abs_difference(verified.hidden[row_base + static_cast<size_t>(i)], decoded.hidden[0]),
                  kLogitTolerance);
      }
      row_base += verify_rows[s].size();
      EXPECT_EQ(speculative.cached(seq), plain.cached(seq));
    }
    for (size_t layer = 0; layer < specs.size(); ++layer) {
      if (!specs[layer].has_slots()) continue;
      for (size_t which = 0; which < specs[layer].tensors.size(); ++which)
        for (size_t s = 0; s < prompts.size(); ++s) {
          const auto seq = static_cast<int64_t>(s);
          EXPECT_LT(max_abs_difference(speculative.state(seq, layer, which), plain.state(seq, layer, which)),
                    kStateTolerance)
              << "layer " << layer << " state " << which << " sequence " << s;
        }
    }
    // The next step (two tokens per sequence, then one) gives the same logits.
    for (const size_t length : {2u, 1u}) {
      std::vector<SpecRunner::Chunk> next;
      for (size_t s = 0; s < prompts.size(); ++s)
        next.push_back({static_cast<int64_t>(s), random_tokens(spec, length, 300 + s + length)});
      const SpecRunner::Rows a = speculative.step(next), b = plain.step(next);
      for (size_t r = 0; r < a.logits.size(); ++r)
        EXPECT_LT(max_abs_difference(a.logits[r], b.logits[r]), kLogitTolerance) << "next step row " << r;
    }
  }
}

// The slots stay as they were until the commit: a verify step whose commit keeps only the first row
// of every sequence equals one plain decode step, and the verify forward itself writes no slot.
TEST_P(VerifyCommit, VerifyForwardLeavesSlotsUntouched) {
  const TinySpec spec = spec_for(GetParam());
  testing::TempDir dir;
  testing::write_tiny_checkpoint(dir.path(), spec, testing::make_tiny_weights(spec, 42));
  const auto model = load_model(dir.path(), Device::cpu());
  SpecRunner runner(*model, false);
  (void)runner.step({{0, random_tokens(spec, 11, 1)}, {1, random_tokens(spec, 5, 2)}});
  const std::vector<CacheSpec> specs = model->cache_specs();
  std::vector<std::vector<float>> before;
  for (size_t layer = 0; layer < specs.size(); ++layer) {
    if (!specs[layer].has_slots()) continue;
    for (size_t which = 0; which < 2; ++which)
      for (int64_t seq = 0; seq < 2; ++seq) before.push_back(runner.state(seq, layer, which));
  }
  (void)runner.step({{0, random_tokens(spec, 4, 3)}, {1, random_tokens(spec, 3, 4)}}, /*verify=*/true);
  size_t index = 0;
  for (size_t layer = 0; layer < specs.size(); ++layer) {
    if (!specs[layer].has_slots()) continue;
    for (size_t which = 0; which < 2; ++which)
      for (int64_t seq = 0; seq < 2; ++seq) {
        EXPECT_EQ(max_abs_difference(runner.state(seq, layer, which), before[index++]), 0.0);
      }
  }
  EXPECT_THROW(runner.commit({0, 1}), Error);  // a sequence keeps at least its first row
  EXPECT_THROW(runner.commit({5, 1}), Error);  // and at most its rows
  runner.commit({1, 3});
  EXPECT_EQ(runner.cached(0), 12);
  EXPECT_EQ(runner.cached(1), 8);
}

INSTANTIATE_TEST_SUITE_P(Hybrids, VerifyCommit, ::testing::Values("qwen3_5", "qwen3_next", "qwen3_5_moe"));

}  // namespace
}  // namespace metrale
