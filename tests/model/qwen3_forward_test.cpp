// End-to-end forward of tiny random qwen3 / qwen3_moe checkpoints through load_model and
// Model::forward on hand-built ragged batches, against a double-precision reference of the
// architecture written in model_helpers.cpp from shared/arch/qwen.md (§3, §5.1, §5.2). Also checks
// that checkpoint layouts that hold the same weights (key prefixes, expert layouts, shards, storage
// dtype) give identical logits.
#include <gtest/gtest.h>

#include "core/test_support.h"
#include "model/model_helpers.h"
#include "model/registry.h"

namespace metrale {
namespace {

using testing::CheckpointLayout;
using testing::ExpertLayout;
using testing::ForwardRunner;
using testing::load_tiny;
using testing::random_tokens;
using testing::slice;
using testing::TinySpec;
using testing::TinyWeights;

// fp32 activations against a double reference through two layers: errors of a few 1e-7.
constexpr double kLogitTolerance = 1e-5;

// Prefills two sequences of different lengths in one step and compares every row with the reference.
void expect_matches_reference(const TinySpec& spec, uint64_t seed) {
  const TinyWeights weights = testing::make_tiny_weights(spec, seed);
  const auto loaded = load_tiny(spec, weights);
  const std::vector<int32_t> a = random_tokens(spec, 9, seed + 100), b = random_tokens(spec, 4, seed + 200);
  ForwardRunner runner(*loaded->model);
  const auto logits = runner.step({{0, a}, {1, b}});
  ASSERT_EQ(logits.size(), a.size() + b.size());
  const double error_a = testing::relative_l2(slice(logits, 0, a.size()), testing::reference_logits(spec, weights, a));
  const double error_b =
      testing::relative_l2(slice(logits, a.size(), logits.size()), testing::reference_logits(spec, weights, b));
  EXPECT_LE(error_a, kLogitTolerance);
  EXPECT_LE(error_b, kLogitTolerance);
  // The reference is sensitive: a model that ignored attention or the second sequence's own context
  // would be far away (guards against a vacuous comparison).
  EXPECT_GT(testing::relative_l2(slice(logits, a.size(), logits.size()),
                                 testing::reference_logits(spec, weights, {a.begin(), a.begin() + 4})),
            1e-2);
}

TEST(Qwen3Forward, TiedHeadMatchesReference) {
  expect_matches_reference(TinySpec{}, 11);
}

TEST(Qwen3Forward, UntiedHeadMatchesReference) {
  TinySpec spec;
  spec.tie_word_embeddings = false;
  expect_matches_reference(spec, 12);
}

TEST(Qwen3Forward, MultiQueryAndWiderHeadsMatchReference) {
  TinySpec spec;
  spec.num_heads = 6;
  spec.num_kv_heads = 1;
  spec.head_dim = 20;
  spec.num_layers = 3;
  spec.rope_theta = 1e6;
  expect_matches_reference(spec, 13);
}

TEST(Qwen3Forward, SlidingWindowLayersMatchReference) {
  TinySpec spec;
  spec.sliding_window = 3;
  spec.max_window_layers = 1;  // layer 0 full, layer 1 windowed
  expect_matches_reference(spec, 14);
}

TEST(Qwen3MoeForward, MatchesReference) {
  TinySpec spec;
  spec.model_type = "qwen3_moe";
  spec.mlp_only_layers = {0};  // layer 0 dense, layer 1 MoE
  expect_matches_reference(spec, 15);
}

TEST(Qwen3MoeForward, WithoutRenormalisationMatchesReference) {
  TinySpec spec;
  spec.model_type = "qwen3_moe";
  spec.num_experts = 6;
  spec.top_k = 3;
  spec.norm_topk_prob = false;
  expect_matches_reference(spec, 16);
}

TEST(Qwen3Forward, ChunkedPrefillAndDecodeMatchReference) {
  // Three steps mixing a chunked prefill, a fresh prompt and decode rows: every row must equal the
  // reference at its absolute position, which only holds if earlier steps' K/V are read back from
  // the paged cache correctly.
  TinySpec spec;
  spec.model_type = "qwen3_moe";
  spec.mlp_only_layers = {1};
  const TinyWeights weights = testing::make_tiny_weights(spec, 17);
  const auto loaded = load_tiny(spec, weights);
  const std::vector<int32_t> a = random_tokens(spec, 10, 117), b = random_tokens(spec, 5, 217),
                             c = random_tokens(spec, 3, 317);
  const auto ref_a = testing::reference_logits(spec, weights, a);
  const auto ref_b = testing::reference_logits(spec, weights, b);
  const auto ref_c = testing::reference_logits(spec, weights, c);
  ForwardRunner runner(*loaded->model, /*block_size=*/4);
  // Step 1: a[0:6) (crosses a block boundary), b[0:3).
  auto logits = runner.step({{0, slice(a, 0, 6)}, {1, slice(b, 0, 3)}});
  EXPECT_LE(testing::relative_l2(slice(logits, 0, 6), slice(ref_a, 0, 6)), kLogitTolerance);
  EXPECT_LE(testing::relative_l2(slice(logits, 6, 9), slice(ref_b, 0, 3)), kLogitTolerance);
  // Step 2: b decodes one token, c arrives, a continues with a chunk of 3.
  logits = runner.step({{1, slice(b, 3, 4)}, {2, c}, {0, slice(a, 6, 9)}});
  EXPECT_LE(testing::relative_l2(slice(logits, 0, 1), slice(ref_b, 3, 4)), kLogitTolerance);
  EXPECT_LE(testing::relative_l2(slice(logits, 1, 4), ref_c), kLogitTolerance);
  EXPECT_LE(testing::relative_l2(slice(logits, 4, 7), slice(ref_a, 6, 9)), kLogitTolerance);
  // Step 3: decode only, asking for the last rows as a generating engine does.
  logits = runner.step({{0, slice(a, 9, 10)}, {1, slice(b, 4, 5)}}, /*last_rows_only=*/true);
  ASSERT_EQ(logits.size(), 2u);
  EXPECT_LE(testing::relative_l2(slice(logits, 0, 1), slice(ref_a, 9, 10)), kLogitTolerance);
  EXPECT_LE(testing::relative_l2(slice(logits, 1, 2), slice(ref_b, 4, 5)), kLogitTolerance);
}

TEST(Qwen3Forward, LastRowsOnlyMatchTheFullRows) {
  const TinySpec spec;
  const TinyWeights weights = testing::make_tiny_weights(spec, 18);
  const auto loaded = load_tiny(spec, weights);
  const std::vector<int32_t> a = random_tokens(spec, 6, 118), b = random_tokens(spec, 3, 218);
  ForwardRunner full_runner(*loaded->model), last_runner(*loaded->model);
  const auto full = full_runner.step({{0, a}, {1, b}});
  const auto last = last_runner.step({{0, a}, {1, b}}, /*last_rows_only=*/true);
  ASSERT_EQ(last.size(), 2u);
  EXPECT_EQ(last[0], full[5]);
  EXPECT_EQ(last[1], full[8]);
}

TEST(Qwen3Forward, ASequenceDoesNotDependOnItsBatchNeighbours) {
  const TinySpec spec;
  const TinyWeights weights = testing::make_tiny_weights(spec, 19);
  const auto loaded = load_tiny(spec, weights);
  const std::vector<int32_t> a = random_tokens(spec, 7, 119), b = random_tokens(spec, 5, 219);
  ForwardRunner alone_runner(*loaded->model), together_runner(*loaded->model, 4, 64, /*seed=*/99);
  const auto alone = alone_runner.step({{0, a}});
  const auto together = together_runner.step({{1, b}, {0, a}});
  const std::vector<std::vector<double>> alone_d = [&] {
    std::vector<std::vector<double>> rows;
    for (const auto& row : alone) rows.emplace_back(row.begin(), row.end());
    return rows;
  }();
  EXPECT_LE(testing::relative_l2(slice(together, b.size(), together.size()), alone_d), 1e-6);
}

// Logits of one model under several checkpoint layouts that hold the same weights.
std::vector<std::vector<float>> logits_for(const TinySpec& spec, const TinyWeights& weights,
                                           const CheckpointLayout& layout, const std::vector<int32_t>& a,
                                           const std::vector<int32_t>& b) {
  const auto loaded = load_tiny(spec, weights, layout);
  ForwardRunner runner(*loaded->model);
  return runner.step({{0, a}, {1, b}});
}

TEST(Qwen3Forward, BothKeyPrefixesGiveIdenticalLogits) {
  TinySpec spec;
  spec.tie_word_embeddings = false;  // lm_head.weight stays at the root under both prefixes
  const TinyWeights weights = testing::make_tiny_weights(spec, 20);
  const auto a = random_tokens(spec, 6, 120), b = random_tokens(spec, 2, 220);
  const auto plain = logits_for(spec, weights, {"model.", ExpertLayout::kPerExpert, 1, DType::kBF16}, a, b);
  const auto language_model =
      logits_for(spec, weights, {"model.language_model.", ExpertLayout::kPerExpert, 1, DType::kBF16}, a, b);
  EXPECT_EQ(plain, language_model);
  EXPECT_LE(testing::relative_l2(slice(plain, 0, a.size()), testing::reference_logits(spec, weights, a)),
            kLogitTolerance);
}

TEST(Qwen3Forward, ShardedAndF32CheckpointsGiveIdenticalLogits) {
  const TinySpec spec;
  const TinyWeights weights = testing::make_tiny_weights(spec, 21);
  const auto a = random_tokens(spec, 5, 121), b = random_tokens(spec, 3, 221);
  const auto single = logits_for(spec, weights, {}, a, b);
  EXPECT_EQ(logits_for(spec, weights, {"model.", ExpertLayout::kPerExpert, 2, DType::kBF16}, a, b), single);
  EXPECT_EQ(logits_for(spec, weights, {"model.", ExpertLayout::kPerExpert, 1, DType::kF32}, a, b), single);
}

TEST(Qwen3MoeForward, BothExpertLayoutsAndPrefixesGiveIdenticalLogits) {
  TinySpec spec;
  spec.model_type = "qwen3_moe";
  const TinyWeights weights = testing::make_tiny_weights(spec, 22);
  const auto a = random_tokens(spec, 8, 122), b = random_tokens(spec, 3, 222);
  const auto per_expert = logits_for(spec, weights, {"model.", ExpertLayout::kPerExpert, 1, DType::kBF16}, a, b);
  const auto fused = logits_for(spec, weights, {"model.", ExpertLayout::kFused, 1, DType::kBF16}, a, b);
  const auto fused_lm =
      logits_for(spec, weights, {"model.language_model.", ExpertLayout::kFused, 2, DType::kBF16}, a, b);
  const auto per_expert_lm =
      logits_for(spec, weights, {"model.language_model.", ExpertLayout::kPerExpert, 1, DType::kBF16}, a, b);
  EXPECT_EQ(per_expert, fused);
  EXPECT_EQ(per_expert, fused_lm);
  EXPECT_EQ(per_expert, per_expert_lm);
  EXPECT_LE(testing::relative_l2(slice(per_expert, 0, a.size()), testing::reference_logits(spec, weights, a)),
            kLogitTolerance);
}

TEST(Qwen3MoeForward, FusedLayoutSwappingGateAndUpIsDetected) {
  // If the loader took the up rows for the gate (or vice versa) the logits would change: the fused
  // layout test above is only meaningful if gate and up are not interchangeable.
  TinySpec spec;
  spec.model_type = "qwen3_moe";
  const TinyWeights weights = testing::make_tiny_weights(spec, 23);
  TinyWeights swapped = weights;
  for (int64_t layer = 0; layer < spec.num_layers; ++layer)
    for (int64_t e = 0; e < spec.num_experts; ++e) {
      const std::string p = "layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(e) + ".";
      std::swap(swapped.at(p + "gate_proj.weight"), swapped.at(p + "up_proj.weight"));
    }
  const auto a = random_tokens(spec, 6, 123);
  const double error = testing::relative_l2(
      logits_for(spec, swapped, {"model.", ExpertLayout::kFused, 1, DType::kBF16}, a, {a[0]}), [&] {
        auto ref = testing::reference_logits(spec, weights, a);
        ref.push_back(testing::reference_logits(spec, weights, {a[0]})[0]);
        return ref;
      }());
  EXPECT_GT(error, 1e-2);
}

}  // namespace
}  // namespace metrale
