// The MTP draft head (blocks/mtp.h): on the demo model against the reference the training script
// recorded (models/demo/train_log.json "reference.mtp": fp32 CPU draft ids and top-5 logits of row t
// = (h_t, input_ids[t+1])), whole = incremental (the MTP layer's own KV cache across steps), chained
// drafts, and random-weight qwen3_5_moe / qwen3_next heads (MoE MTP layers); a checkpoint without
// mtp.* loads without a head.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "common/fixtures.h"
#include "core/test_support.h"
#include "model/model_helpers.h"
#include "model/registry.h"
#include "model/spec_helpers.h"

namespace metrale {
namespace {

using testing::SpecRunner;

const std::filesystem::path kDemoDir = std::filesystem::path(METRALE_SOURCE_DIR) / "models" / "demo";

// The demo checkpoint and the reference its training script recorded.
::testing::AssertionResult demo_present() {
  return testing::fixtures_present({kDemoDir / "config.json", kDemoDir / "model.safetensors", kDemoDir / "train_log.json"});
}

nlohmann::json demo_reference() {
  std::ifstream file(kDemoDir / "train_log.json");
  return nlohmann::json::parse(file).at("reference");
}

std::vector<int64_t> top_k(const std::vector<float>& row, size_t k) {
  std::vector<int64_t> order(row.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + static_cast<ptrdiff_t>(k), order.end(),
                    [&](int64_t a, int64_t b) { return row[static_cast<size_t>(a)] > row[static_cast<size_t>(b)]; });
  order.resize(k);
  return order;
}

double max_abs_difference(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double worst = 0.0;
  for (size_t r = 0; r < a.size(); ++r)
    for (size_t c = 0; c < a[r].size(); ++c)
      worst = std::max(worst, std::abs(static_cast<double>(a[r][c]) - static_cast<double>(b[r][c])));
  return worst;
}

template <typename T>
std::vector<T> rows_between(const std::vector<T>& rows, size_t begin, size_t end) {
  return {rows.begin() + static_cast<ptrdiff_t>(begin), rows.begin() + static_cast<ptrdiff_t>(end)};
}

TEST(MtpDemo, DraftsMatchTheTrainingReference) {
  ASSERT_TRUE(demo_present());
  const nlohmann::json reference = demo_reference();
  const auto ids = reference.at("input_ids").get<std::vector<int32_t>>();
  const auto draft_ids = reference.at("mtp").at("draft_ids").get<std::vector<int64_t>>();
  const auto top5_ids = reference.at("mtp").at("top5_ids").get<std::vector<std::vector<int64_t>>>();
  const auto top5_logits = reference.at("mtp").at("top5_logits").get<std::vector<std::vector<double>>>();
  ASSERT_EQ(ids.size(), 64u);
  ASSERT_EQ(draft_ids.size(), ids.size() - 1);

  const auto model = load_model(kDemoDir, Device::cpu());
  ASSERT_TRUE(model->has_mtp());
  EXPECT_EQ(model->num_mtp_layers(), 1);
  ASSERT_EQ(model->mtp_cache_specs().size(), 1u);
  const CacheSpec mtp_cache = model->mtp_cache_specs()[0];
  EXPECT_TRUE(mtp_cache.has_paged() && !mtp_cache.has_slots());
  EXPECT_EQ(mtp_cache.tensors.size(), 2u);  // its attention's k and v

  SpecRunner runner(*model, /*with_mtp=*/true);
  const SpecRunner::Rows trunk = runner.step({{0, ids}});
  // Row t pairs h_t with input_ids[t + 1], t = 0..62.
  const std::vector<int32_t> next(ids.begin() + 1, ids.end());
  const SpecRunner::Rows mtp = runner.mtp_step({{0, next}}, rows_between(trunk.hidden, 0, ids.size() - 1));
  ASSERT_EQ(mtp.logits.size(), draft_ids.size());
  double worst_relative = 0.0;
  for (size_t t = 0; t < draft_ids.size(); ++t) {
    const std::vector<int64_t> top = top_k(mtp.logits[t], 5);
    EXPECT_EQ(top[0], draft_ids[t]) << "row " << t;
    for (size_t j = 0; j < 5; ++j) {
      // Near-ties may swap places among the top 5; compare each reference id's logit.
      const double expected = top5_logits[t][j];
      const double actual = mtp.logits[t][static_cast<size_t>(top5_ids[t][j])];
      worst_relative = std::max(worst_relative, std::abs(actual - expected) / std::max(1.0, std::abs(expected)));
    }
    EXPECT_EQ(top, top5_ids[t]) << "row " << t;
  }
  EXPECT_LT(worst_relative, 1e-3);
  RecordProperty("worst_relative_top5_logit_error", std::to_string(worst_relative));
}

TEST(MtpDemo, IncrementalStepsEqualOneStep) {
  ASSERT_TRUE(demo_present());
  const auto ids = demo_reference().at("input_ids").get<std::vector<int32_t>>();
  const auto model = load_model(kDemoDir, Device::cpu());
  SpecRunner runner(*model, /*with_mtp=*/true);
  const SpecRunner::Rows trunk = runner.step({{0, ids}});
  const std::vector<int32_t> next(ids.begin() + 1, ids.end());
  const std::vector<std::vector<float>> hidden = rows_between(trunk.hidden, 0, next.size());
  const SpecRunner::Rows whole = runner.mtp_step({{0, next}}, hidden);

  // The same rows for a second sequence, fed in uneven chunks (single rows like a decode catch-up,
  // several rows like an accepted run), batched with nothing and with the first sequence's redo.
  std::vector<std::vector<float>> pieces_logits, pieces_hidden;
  const std::vector<size_t> cuts = {0, 1, 2, 7, 8, 25, 26, 27, 40, 63};
  (void)runner.step({{1, ids}});
  for (size_t c = 0; c + 1 < cuts.size(); ++c) {
    const size_t begin = cuts[c], end = cuts[c + 1];
    const SpecRunner::Rows part =
        runner.mtp_step({{1, rows_between(next, begin, end)}}, rows_between(hidden, begin, end));
    pieces_logits.insert(pieces_logits.end(), part.logits.begin(), part.logits.end());
    pieces_hidden.insert(pieces_hidden.end(), part.hidden.begin(), part.hidden.end());
  }
  ASSERT_EQ(pieces_logits.size(), whole.logits.size());
  EXPECT_LT(max_abs_difference(pieces_logits, whole.logits), 1e-4);
  EXPECT_LT(max_abs_difference(pieces_hidden, whole.hidden), 1e-5);
}

TEST(MtpDemo, ChainedDraftLeavesNoTraceAfterCatchUp) {
  ASSERT_TRUE(demo_present());
  // A second draft runs at position t + 1 with o_t (the first draft's output hidden state) and the
  // first draft's token, writing MTP keys there; the catch-up after verification reruns position
  // t + 1 with the trunk's h_{t+1} and the true token, which must overwrite them.
  const auto ids = demo_reference().at("input_ids").get<std::vector<int32_t>>();
  const auto model = load_model(kDemoDir, Device::cpu());
  const std::vector<int32_t> prompt = rows_between(ids, 0, 21);
  SpecRunner chained(*model, /*with_mtp=*/true), plain(*model, /*with_mtp=*/true);
  const SpecRunner::Rows trunk = chained.step({{0, prompt}});
  (void)plain.step({{0, prompt}});

  // Rows t = 0..18, then draft 2 at t = 19 from o_18 and draft 1.
  const SpecRunner::Rows drafts = chained.mtp_step({{0, rows_between(ids, 1, 20)}}, rows_between(trunk.hidden, 0, 19));
  const int32_t first_draft = static_cast<int32_t>(top_k(drafts.logits.back(), 1)[0]);
  const SpecRunner::Rows second = chained.mtp_step({{0, {first_draft}}}, {drafts.hidden.back()});
  ASSERT_EQ(second.logits.size(), 1u);
  for (const float value : second.logits[0]) ASSERT_TRUE(std::isfinite(value));
  EXPECT_GT(max_abs_difference(second.logits, {drafts.logits.back()}), 0.0);

  // Catch-up: position 19 again, with h_19 and the true token ids[20].
  chained.set_mtp_cached(0, 19);
  const SpecRunner::Rows caught_up = chained.mtp_step({{0, {ids[20]}}}, {trunk.hidden[19]});
  const SpecRunner::Rows expected = plain.mtp_step({{0, rows_between(ids, 1, 21)}}, rows_between(trunk.hidden, 0, 20));
  EXPECT_LT(max_abs_difference(caught_up.logits, {expected.logits.back()}), 1e-4);
  // The next MTP row reads position 19's keys: those of the catch-up, not of the chained draft.
  const SpecRunner::Rows chained_next = chained.mtp_step({{0, {ids[21]}}}, {trunk.hidden[20]});
  const SpecRunner::Rows plain_next = plain.mtp_step({{0, {ids[21]}}}, {trunk.hidden[20]});
  EXPECT_LT(max_abs_difference(chained_next.logits, plain_next.logits), 1e-5);
}

TEST(MtpDemo, KeysOnlyCatchUpEqualsForward) {
  ASSERT_TRUE(demo_present());
  // Positions whose draft nobody reads get only their MTP keys (Model::mtp_write_keys); the rows
  // that follow must see the keys a full MTP forward would have written.
  const auto ids = demo_reference().at("input_ids").get<std::vector<int32_t>>();
  const auto model = load_model(kDemoDir, Device::cpu());
  SpecRunner keys(*model, /*with_mtp=*/true), full(*model, /*with_mtp=*/true);
  const SpecRunner::Rows trunk = keys.step({{0, ids}});
  (void)full.step({{0, ids}});
  const std::vector<int32_t> next(ids.begin() + 1, ids.end());
  const std::vector<std::vector<float>> hidden = rows_between(trunk.hidden, 0, next.size());
  const size_t last = next.size() - 1;
  const SpecRunner::Rows expected = full.mtp_step({{0, next}}, hidden);
  // Keys only for a prefix, a full row, keys only again, then the last row in full.
  keys.mtp_write_keys({{0, rows_between(next, 0, 20)}}, rows_between(hidden, 0, 20));
  const SpecRunner::Rows middle = keys.mtp_step({{0, rows_between(next, 20, 21)}}, rows_between(hidden, 20, 21));
  keys.mtp_write_keys({{0, rows_between(next, 21, last)}}, rows_between(hidden, 21, last));
  const SpecRunner::Rows tail =
      keys.mtp_step({{0, rows_between(next, last, last + 1)}}, rows_between(hidden, last, last + 1));
  EXPECT_LT(max_abs_difference(middle.logits, rows_between(expected.logits, 20, 21)), 1e-5);
  EXPECT_LT(max_abs_difference(tail.logits, rows_between(expected.logits, last, last + 1)), 1e-5);
  EXPECT_LT(max_abs_difference(tail.hidden, rows_between(expected.hidden, last, last + 1)), 1e-6);
}

// Random-weight hybrids whose config declares an MTP layer: the head loads with the family's FFN
// (MoE for qwen3_5_moe and qwen3_next) and its KV cache works across steps.
TEST(MtpRandom, MoeHeadsRunWholeEqualsIncremental) {
  for (const std::string model_type : {"qwen3_5_moe", "qwen3_next", "qwen3_5"}) {
    SCOPED_TRACE(model_type);
    testing::TinySpec spec;
    spec.model_type = model_type;
    spec.num_layers = 4;
    spec.head_dim = 16;
    nlohmann::json config = testing::hybrid_config_json(spec);
    config[model_type == "qwen3_next" ? "num_nextn_predict_layers" : "mtp_num_hidden_layers"] = 1;
    const auto model = make_random_model(parse_model_config(config, "random.json"), Device::cpu(), 3);
    ASSERT_TRUE(model->has_mtp());
    SpecRunner runner(*model, /*with_mtp=*/true);
    const std::vector<int32_t> ids = {3, 17, 5, 42, 8, 8, 21, 60, 1, 33, 12};
    const SpecRunner::Rows trunk = runner.step({{0, ids}, {1, ids}});
    const std::vector<int32_t> next(ids.begin() + 1, ids.end());
    const std::vector<std::vector<float>> hidden = rows_between(trunk.hidden, 0, next.size());
    const SpecRunner::Rows whole = runner.mtp_step({{0, next}}, hidden);
    std::vector<std::vector<float>> pieces;
    for (size_t begin = 0; begin < next.size(); begin += 3) {
      const size_t end = std::min(next.size(), begin + 3);
      const SpecRunner::Rows part =
          runner.mtp_step({{1, rows_between(next, begin, end)}}, rows_between(hidden, begin, end));
      pieces.insert(pieces.end(), part.logits.begin(), part.logits.end());
    }
    for (const auto& row : whole.logits)
      for (const float value : row) ASSERT_TRUE(std::isfinite(value));
    EXPECT_LT(max_abs_difference(pieces, whole.logits), 1e-4);
  }
}

TEST(MtpLoad, CheckpointWithoutMtpHasNoHead) {
  testing::TinySpec spec;
  spec.model_type = "qwen3_5";
  spec.num_layers = 2;
  spec.head_dim = 16;
  testing::TempDir dir;
  testing::write_tiny_checkpoint(dir.path(), spec, testing::make_hybrid_weights(spec, 7));
  const auto model = load_model(dir.path(), Device::cpu());
  EXPECT_FALSE(model->has_mtp());
  EXPECT_EQ(model->num_mtp_layers(), 0);
  EXPECT_TRUE(model->mtp_cache_specs().empty());
  Arena arena(Device::cpu(), 1024);
  EXPECT_THROW(model->mtp_forward(ForwardBatch{}, {}, Tensor(), Tensor(), arena, 0), Error);
}

}  // namespace
}  // namespace metrale
