// The residual scheme seam (model/blocks/residual.h) with a test-only N-stream scheme: N streams per
// token ([T, N·H]), per-site pre and post maps with state kept between them, stream blocks acting on
// the streams between sites and a final collapse, on the CPU, around the unchanged Attention and Mlp
// blocks of a tiny qwen3. Identical streams must collapse to exactly the pre-norm result; a stream
// block must act on every stream and be observable.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/step_runner.h"
#include "common/tiny_checkpoint.h"
#include "core/test_support.h"
#include "model/blocks/residual.h"
#include "model/hand_built_helpers.h"
#include "model/registry.h"

namespace metrale {
namespace {

using testing::ForwardRunner;
using testing::HandBuiltOptions;
using testing::TinySpec;
using Logits = std::vector<std::vector<float>>;

// N streams of width H, stream n at channels [n·H, (n+1)·H), all starting as the input rows. Site s
// reads stream s % N through the pre-norm residual's norm of site s and keeps injection weights
// beta [T, N] (all one) for its post map, which adds beta_n · out to every stream n. While the
// streams stay equal this is exactly the pre-norm residual, whichever stream a site reads. The
// collapse normalises the last stream with the final norm. A site's pre map keeps its state in one
// of two [T, N + 1] buffers (by site parity; the last column names the site), and its post map
// throws unless it finds its own site's state there, then poisons it: the state really is carried
// from pre to post. CPU and f32 only.
class NStreamResidual : public ResidualScheme {
 public:
  NStreamResidual(int64_t streams, std::unique_ptr<PreNormResidual> norms) : n_(streams), norms_(std::move(norms)) {}

  int64_t hidden_size() const override { return norms_->hidden_size(); }
  int64_t stream_width() const override { return n_ * hidden_size(); }
  int64_t num_sites() const override { return norms_->num_sites(); }

  ResidualStreams allocate(const StepContext& step) const override {
    const int64_t tokens = step.batch.num_tokens;
    ResidualStreams streams;
    streams.streams = step.workspace.alloc(DType::kF32, {tokens, stream_width()});
    streams.input = step.workspace.alloc(DType::kF32, {tokens, hidden_size()});
    for (int i = 0; i < 2; ++i) {
      streams.state.push_back(step.workspace.alloc(DType::kF32, {tokens, n_ + 1}));
      poison(streams.state.back());
    }
    return streams;
  }

  void begin(const StepContext& step, const ResidualStreams& streams) const override {
    const int64_t h = hidden_size();
    for (int64_t t = 0; t < step.batch.num_tokens; ++t) {
      const float* in = streams.input.data_as<float>() + t * h;
      for (int64_t n = 0; n < n_; ++n) std::copy(in, in + h, streams.streams.data_as<float>() + (t * n_ + n) * h);
    }
  }

  void pre(const StepContext& step, const ResidualStreams& streams, int64_t site, const Tensor& x) const override {
    norms_->site_norms().at(static_cast<size_t>(site)).apply(stream(streams, site % n_), x);
    float* state = streams.state[static_cast<size_t>(site % 2)].data_as<float>();
    for (int64_t t = 0; t < step.batch.num_tokens; ++t) {
      for (int64_t n = 0; n < n_; ++n) state[t * (n_ + 1) + n] = 1.0f;
      state[t * (n_ + 1) + n_] = static_cast<float>(site);
    }
  }

  void post(const StepContext& step, const ResidualStreams& streams, int64_t site, const Tensor& out) const override {
    const int64_t h = hidden_size();
    const Tensor& state_tensor = streams.state[static_cast<size_t>(site % 2)];
    const float* state = state_tensor.data_as<float>();
    for (int64_t t = 0; t < step.batch.num_tokens; ++t) {
      if (state[t * (n_ + 1) + n_] != static_cast<float>(site)) {
        raise(ErrorCode::kInternal, "N-stream residual: site {} finds the state of site {}", site,
              state[t * (n_ + 1) + n_]);
      }
      const float* o = out.data_as<float>() + t * h;
      for (int64_t n = 0; n < n_; ++n) {
        const float beta = state[t * (n_ + 1) + n];
        float* s = streams.streams.data_as<float>() + (t * n_ + n) * h;
        for (int64_t i = 0; i < h; ++i) s[i] += beta * o[i];
      }
    }
    poison(state_tensor);
  }

  void finish(const StepContext& /*step*/, const ResidualStreams& streams, const Tensor& hidden) const override {
    norms_->final_norm().apply(stream(streams, n_ - 1), hidden);
  }

 private:
  Tensor stream(const ResidualStreams& streams, int64_t n) const {
    return streams.streams.slice(1, n * hidden_size(), (n + 1) * hidden_size());  // [T, H], rows N·H apart
  }
  static void poison(const Tensor& tensor) {
    std::fill_n(tensor.data_as<float>(), tensor.numel(), std::numeric_limits<float>::quiet_NaN());
  }

  int64_t n_;
  std::unique_ptr<PreNormResidual> norms_;
};

// Adds v [H] to every stream of every row: an observable stream block with nothing to keep.
class AddToStreams : public StreamBlock {
 public:
  explicit AddToStreams(std::vector<float> v) : v_(std::move(v)) {}
  CacheSpec cache_spec() const override { return {}; }
  void forward(const StepContext& step, const BlockCache& /*cache*/, const Tensor& streams) override {
    const auto width = streams.size(1), h = static_cast<int64_t>(v_.size());
    METRALE_CHECK(streams.dtype() == DType::kF32 && width % h == 0, "streams {}", streams.describe());
    for (int64_t t = 0; t < step.batch.num_tokens; ++t) {
      float* row = streams.data_as<float>() + t * width;
      for (int64_t c = 0; c < width; ++c) row[c] += v_[static_cast<size_t>(c % h)];
    }
  }

 private:
  std::vector<float> v_;
};

TinySpec untied_spec() {
  TinySpec spec;
  spec.tie_word_embeddings = false;
  spec.num_layers = 3;
  return spec;
}

// Multiples of 1/64 in [-1, 1): e + v stays exact in f32 for the bf16 embedding rows e.
std::vector<float> shift_vector(const TinySpec& spec) {
  std::vector<float> v(static_cast<size_t>(spec.hidden_size));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(static_cast<int>((i * 37) % 128) - 64) / 64.0f;
  return v;
}

HandBuiltOptions n_streams(int64_t n) {
  HandBuiltOptions options;
  options.residual = [n](std::unique_ptr<PreNormResidual> norms) {
    return std::make_unique<NStreamResidual>(n, std::move(norms));
  };
  return options;
}

HandBuiltOptions with_block_at(HandBuiltOptions options, int64_t at_layer, const std::vector<float>& v) {
  options.stream_blocks = [at_layer, v](int64_t layer) {
    std::vector<std::unique_ptr<StreamBlock>> blocks;
    if (layer == at_layer) blocks.push_back(std::make_unique<AddToStreams>(v));
    return blocks;
  };
  return options;
}

// Two sequences through prefill chunks, a mixed step and decode steps: every row's logits.
Logits run_steps(Model& model, const TinySpec& spec) {
  const auto a = testing::random_tokens(spec, 13, 51), b = testing::random_tokens(spec, 6, 52);
  ForwardRunner runner(model);
  Logits all;
  for (const Logits& rows : {runner.step({{0, testing::slice(a, 0, 9)}}),
                             runner.step({{1, testing::slice(b, 0, 5)}, {0, testing::slice(a, 9, 12)}}),
                             runner.step({{0, testing::slice(a, 12, 13)}, {1, testing::slice(b, 5, 6)}})})
    all.insert(all.end(), rows.begin(), rows.end());
  return all;
}

void expect_all_finite(const Logits& logits) {
  for (const auto& row : logits)
    for (const float value : row) ASSERT_TRUE(std::isfinite(value));
}

struct Checkpoint {
  TinySpec spec = untied_spec();
  testing::TinyWeights weights = testing::make_tiny_weights(spec, 61);
  testing::TempDir dir;
  // f32 storage, so that a checkpoint whose embedding rows differ reads every other weight the same way.
  Checkpoint() { testing::write_tiny_checkpoint(dir.path(), spec, weights, {"model.", {}, 1, DType::kF32}); }
};

TEST(ResidualScheme, HandBuiltPreNormModelEqualsTheRegistrysQwen3) {
  const Checkpoint checkpoint;
  const auto registry = load_model(checkpoint.dir.path(), Device::cpu());
  const auto by_hand = testing::build_qwen3_by_hand(checkpoint.dir.path());
  const Logits expected = run_steps(*registry, checkpoint.spec);
  expect_all_finite(expected);
  EXPECT_EQ(run_steps(*by_hand, checkpoint.spec), expected);
}

TEST(ResidualScheme, IdenticalStreamsCollapseToExactlyThePreNormResult) {
  const Checkpoint checkpoint;
  const auto pre_norm = testing::build_qwen3_by_hand(checkpoint.dir.path());
  const Logits expected = run_steps(*pre_norm, checkpoint.spec);
  for (const int64_t n : {1, 2, 3}) {
    const auto streams = testing::build_qwen3_by_hand(checkpoint.dir.path(), n_streams(n));
    EXPECT_EQ(run_steps(*streams, checkpoint.spec), expected) << n << " streams";
    EXPECT_EQ(streams->cache_specs().size(), pre_norm->cache_specs().size());
  }
}

// A stream block before layer 0 that adds v is the same model as embedding rows e + v.
TEST(ResidualScheme, StreamBlockBeforeTheFirstSiteEqualsShiftedEmbeddings) {
  const Checkpoint checkpoint;
  const std::vector<float> v = shift_vector(checkpoint.spec);
  testing::TinyWeights shifted = checkpoint.weights;
  auto& embedding = shifted.at("embed_tokens.weight").values;
  for (size_t i = 0; i < embedding.size(); ++i) embedding[i] += v[i % v.size()];
  testing::TempDir shifted_dir;
  testing::write_tiny_checkpoint(shifted_dir.path(), checkpoint.spec, shifted, {"model.", {}, 1, DType::kF32});
  const Logits expected = run_steps(*load_model(shifted_dir.path(), Device::cpu()), checkpoint.spec);
  expect_all_finite(expected);

  const auto pre_norm = testing::build_qwen3_by_hand(checkpoint.dir.path(), with_block_at({}, 0, v));
  EXPECT_EQ(run_steps(*pre_norm, checkpoint.spec), expected);
  const auto streams = testing::build_qwen3_by_hand(checkpoint.dir.path(), with_block_at(n_streams(3), 0, v));
  EXPECT_EQ(run_steps(*streams, checkpoint.spec), expected);
  // And it is observable: without the block the logits differ.
  const auto plain = testing::build_qwen3_by_hand(checkpoint.dir.path());
  EXPECT_GT(testing::relative_l2(run_steps(*plain, checkpoint.spec), expected), 1e-2);
}

// Between layers the block sits between one site's post map and the next one's pre map (no fused
// add + norm there); it must act on every stream.
TEST(ResidualScheme, StreamBlockBetweenLayersActsOnEveryStream) {
  const Checkpoint checkpoint;
  const std::vector<float> v = shift_vector(checkpoint.spec);
  for (const int64_t layer : {1, 2}) {
    const auto pre_norm = testing::build_qwen3_by_hand(checkpoint.dir.path(), with_block_at({}, layer, v));
    const Logits expected = run_steps(*pre_norm, checkpoint.spec);
    expect_all_finite(expected);
    for (const int64_t n : {2, 3}) {
      const auto streams = testing::build_qwen3_by_hand(checkpoint.dir.path(), with_block_at(n_streams(n), layer, v));
      EXPECT_EQ(run_steps(*streams, checkpoint.spec), expected) << n << " streams, block at layer " << layer;
    }
    const auto plain = testing::build_qwen3_by_hand(checkpoint.dir.path());
    EXPECT_GT(testing::relative_l2(run_steps(*plain, checkpoint.spec), expected), 1e-3) << "block at layer " << layer;
  }
}

TEST(ResidualScheme, ASchemeMustHaveTwoSitesPerLayer) {
  const Checkpoint checkpoint;
  HandBuiltOptions options;
  options.residual = [](std::unique_ptr<PreNormResidual> norms) {
    std::vector<RmsNorm> fewer = norms->site_norms();
    fewer.pop_back();
    return std::make_unique<PreNormResidual>(std::move(fewer), norms->final_norm());
  };
  EXPECT_TRUE(testing::throws_error([&] { testing::build_qwen3_by_hand(checkpoint.dir.path(), options); },
                                    ErrorCode::kInternal, {"5 sites for 3 layers"}));
}

}  // namespace
}  // namespace metrale
