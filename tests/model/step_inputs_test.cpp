// The model side of host-prepared step inputs (Model::step_input_specs / prestage,
// ForwardBatch::step_inputs) end to end at the model level, with a test stream block in the spirit
// of PLE: it declares needs_prestage, reads per row the token before the row (its sequence's history
// or the batch's previous row, filled on the host by its prestage) and adds a function of it to the
// streams, and keeps a per-slot i64 count of the tokens its sequence has seen (one layer then owns
// two stateful blocks: the stream block and its attention). The engine's batch builder is another
// floor's; the common mini-runner plays its part here (host arrays, prestage with each sequence's
// history, the batch's step inputs).
#include <gtest/gtest.h>

#include <cmath>

#include "common/step_runner.h"
#include "common/tiny_checkpoint.h"
#include "core/test_support.h"
#include "model/hand_built_helpers.h"

namespace metrale {
namespace {

using testing::ForwardRunner;
using testing::TinySpec;
using Logits = std::vector<std::vector<float>>;

constexpr double kChunkTolerance = 1e-5;  // prefill in one step vs in chunks: fp32 summation order

// What the block read, per forward, for the test to inspect.
struct Readings {
  std::vector<std::vector<int32_t>> previous_tokens;  // per forward: [T]
};

class PreviousTokenBlock : public StreamBlock {
 public:
  PreviousTokenBlock(float scale, std::shared_ptr<Readings> readings) : scale_(scale), readings_(std::move(readings)) {}

  CacheSpec cache_spec() const override { return {{CacheTensorSpec::per_slot("seen", {1}, DType::kI64)}}; }
  BlockCapabilities capabilities() const override {
    BlockCapabilities capabilities;
    capabilities.needs_prestage = true;
    capabilities.supports_verify = false;  // no verify protocol for its per-slot count
    return capabilities;
  }
  std::vector<StepInputSpec> step_input_specs() const override { return {{"previous_token", DType::kI32, 1}}; }

  // previous_token[r]: the token before row r in its sequence, -1 at the sequence's start.
  void prestage(const PrestageRows& rows, std::span<const Tensor> host_inputs) const override {
    METRALE_CHECK(host_inputs.size() == 1 && host_inputs[0].shape() == (Shape{rows.num_tokens, 1}),
                  "previous_token {}", host_inputs.empty() ? "missing" : host_inputs[0].describe());
    auto* previous = host_inputs[0].data_as<int32_t>();
    for (int64_t s = 0; s < rows.num_seqs; ++s) {
      const auto history = rows.history[static_cast<size_t>(s)];
      for (int32_t r = rows.cu_q[static_cast<size_t>(s)]; r < rows.cu_q[static_cast<size_t>(s) + 1]; ++r) {
        const bool first = r == rows.cu_q[static_cast<size_t>(s)];
        previous[r] = !first ? rows.token_ids[static_cast<size_t>(r) - 1] : history.empty() ? -1 : history.back();
      }
    }
  }

  void forward(const StepContext& step, const BlockCache& cache, const Tensor& streams) override {
    const ForwardBatch& batch = step.batch;
    METRALE_CHECK(step.step_inputs.size() == 1, "{} step inputs", step.step_inputs.size());
    const auto* previous = step.step_inputs[0].data_as<const int32_t>();
    readings_->previous_tokens.emplace_back(previous, previous + batch.num_tokens);
    auto* seen = cache.tensors[0].data_as<int64_t>();  // [slots, 1]
    const int64_t width = streams.size(1);
    for (int64_t s = 0; s < batch.num_seqs; ++s) {
      const int32_t first = batch.host_cu_q[static_cast<size_t>(s)], last = batch.host_cu_q[static_cast<size_t>(s) + 1];
      const int32_t slot = batch.host_state_slots[static_cast<size_t>(s)];
      const int64_t cached = batch.host_kv_lens[static_cast<size_t>(s)] - (last - first);
      if (cached > 0 && seen[slot] != cached) {
        raise(ErrorCode::kInternal, "slot {} has seen {} tokens, the sequence has {} cached", slot, seen[slot], cached);
      }
      seen[slot] = batch.host_kv_lens[static_cast<size_t>(s)];
      for (int32_t r = first; r < last; ++r) {
        float* row = streams.data_as<float>() + r * width;
        const float shift = scale_ * static_cast<float>(previous[r] + 1);
        for (int64_t c = 0; c < width; ++c) row[c] += shift * static_cast<float>(c % 3);
      }
    }
  }

 private:
  float scale_;
  std::shared_ptr<Readings> readings_;
};

struct PrestageModel {
  TinySpec spec;
  testing::TempDir dir;
  std::shared_ptr<Readings> readings = std::make_shared<Readings>();
  std::unique_ptr<Model> model;

  explicit PrestageModel(float scale = 0.01f) {
    spec.num_layers = 2;
    testing::write_tiny_checkpoint(dir.path(), spec, testing::make_tiny_weights(spec, 71));
    testing::HandBuiltOptions options;
    options.stream_blocks = [this, scale](int64_t layer) {
      std::vector<std::unique_ptr<StreamBlock>> blocks;
      if (layer == 1) blocks.push_back(std::make_unique<PreviousTokenBlock>(scale, readings));
      return blocks;
    };
    model = testing::build_qwen3_by_hand(dir.path(), options);
  }
};

TEST(StepInputs, TheModelDeclaresWhatItsBlocksDeclare) {
  const PrestageModel fixture;
  const Model& model = *fixture.model;
  const ModelCapabilities capabilities = model.capabilities();
  EXPECT_TRUE(capabilities.needs_prestage);
  EXPECT_FALSE(capabilities.supports_verify);
  EXPECT_TRUE(capabilities.graph_safe);
  const std::vector<StepInputSpec> inputs = model.step_input_specs();
  ASSERT_EQ(inputs.size(), 1u);
  EXPECT_EQ(inputs[0].name, "previous_token");
  EXPECT_EQ(inputs[0].dtype, DType::kI32);
  EXPECT_EQ(inputs[0].per_row, 1);
  // Caches per stateful block in forward order: layer 0's attention, layer 1's stream block, then its
  // attention.
  const std::vector<CacheSpec> caches = model.cache_specs();
  ASSERT_EQ(caches.size(), 3u);
  EXPECT_TRUE(caches[0].has_paged() && !caches[0].has_slots());
  ASSERT_EQ(caches[1].tensors.size(), 1u);
  EXPECT_EQ(caches[1].tensors[0].name, "seen");
  EXPECT_EQ(caches[1].tensors[0].indexing, CacheIndexing::kPerSlot);
  EXPECT_EQ(caches[1].tensors[0].dtype, DType::kI64);
  EXPECT_TRUE(caches[2].has_paged() && !caches[2].has_slots());
  // The plain model declares none of it.
  const auto plain = testing::build_qwen3_by_hand(fixture.dir.path());
  EXPECT_FALSE(plain->capabilities().needs_prestage);
  EXPECT_TRUE(plain->capabilities().supports_verify);
  EXPECT_TRUE(plain->step_input_specs().empty());
}

TEST(StepInputs, PrestagedRowsFollowEachSequenceAcrossChunks) {
  PrestageModel fixture;
  const auto a = testing::random_tokens(fixture.spec, 12, 81), b = testing::random_tokens(fixture.spec, 5, 82);
  ForwardRunner whole_runner(*fixture.model);
  const Logits whole = whole_runner.step({{0, a}});
  ASSERT_EQ(fixture.readings->previous_tokens.size(), 1u);
  std::vector<int32_t> expected_previous{-1};
  expected_previous.insert(expected_previous.end(), a.begin(), a.end() - 1);
  EXPECT_EQ(fixture.readings->previous_tokens[0], expected_previous);

  // The same sequence in chunks and decode steps next to another one: its first row of each step
  // reads the last token of its history.
  ForwardRunner runner(*fixture.model);
  Logits pieces;
  const auto keep = [&](const Logits& rows, size_t begin, size_t end) {
    pieces.insert(pieces.end(), rows.begin() + static_cast<ptrdiff_t>(begin), rows.begin() + static_cast<ptrdiff_t>(end));
  };
  fixture.readings->previous_tokens.clear();
  keep(runner.step({{1, testing::slice(b, 0, 3)}, {0, testing::slice(a, 0, 5)}}), 3, 8);
  keep(runner.step({{0, testing::slice(a, 5, 10)}, {1, testing::slice(b, 3, 5)}}), 0, 5);
  keep(runner.step({{0, testing::slice(a, 10, 11)}}), 0, 1);
  keep(runner.step({{1, {a[0]}}, {0, testing::slice(a, 11, 12)}}), 1, 2);
  ASSERT_EQ(fixture.readings->previous_tokens.size(), 4u);
  EXPECT_EQ(fixture.readings->previous_tokens[0], (std::vector<int32_t>{-1, b[0], b[1], -1, a[0], a[1], a[2], a[3]}));
  EXPECT_EQ(fixture.readings->previous_tokens[1], (std::vector<int32_t>{a[4], a[5], a[6], a[7], a[8], b[2], b[3]}));
  EXPECT_EQ(fixture.readings->previous_tokens[2], (std::vector<int32_t>{a[9]}));
  EXPECT_EQ(fixture.readings->previous_tokens[3], (std::vector<int32_t>{b[4], a[10]}));
  EXPECT_LE(testing::relative_l2(pieces, whole), kChunkTolerance);

  // The input is observable: a block that scales it by zero gives other logits.
  PrestageModel unscaled(0.0f);
  ForwardRunner unscaled_runner(*unscaled.model);
  EXPECT_GT(testing::relative_l2(unscaled_runner.step({{0, a}}), whole), 1e-3);
}

TEST(StepInputs, ABatchWithoutTheDeclaredInputsIsRejected) {
  PrestageModel fixture;
  testing::TestCache cache(fixture.model->cache_specs(), {}, Device::cpu(), 4, 16, 4, 9);
  std::map<int64_t, int64_t> lengths;
  testing::HostBatch host;
  testing::build_batch({{0, testing::random_tokens(fixture.spec, 3, 91)}}, lengths, false, cache, host);
  std::vector<float> logits(static_cast<size_t>(3 * fixture.spec.vocab_size));
  Arena arena(Device::cpu(), 1 << 20);
  const Tensor out(logits.data(), DType::kF32, {3, fixture.spec.vocab_size});
  EXPECT_TRUE(testing::throws_error([&] { fixture.model->forward(host.batch, cache.caches(), out, arena); },
                                    ErrorCode::kInvalidArgument, {"0 step inputs", "declares 1"}));
  // prestage() checks its host arrays too.
  EXPECT_TRUE(testing::throws_error([&] { fixture.model->prestage(PrestageRows{}, {}); }, ErrorCode::kInternal,
                                    {"0 host inputs for 1 step inputs"}));
}

}  // namespace
}  // namespace metrale
