// End-to-end forward of tiny random Qwen hybrid checkpoints (qwen3_next, qwen3_5, qwen3_5_moe: Gated
// DeltaNet and gated attention layers) through load_model and Model::forward on hand-built ragged
// batches: against the double-precision reference of hybrid_helpers.cpp (written from qwen.md), and
// against themselves: whole prefill = chunked prefill = token-by-token decode, batched = alone, and a
// sequence restarted from a copy of another's state slot (and KV blocks) continues exactly as it would.
#include <gtest/gtest.h>

#include <cmath>

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
using testing::TempDir;
using testing::TinySpec;
using testing::TinyWeights;

// fp32 activations against a double reference through four layers, two of them recurrent over up to
// 80 tokens: errors of order 1e-6.
constexpr double kLogitTolerance = 1e-5;
// The same model fed differently (chunked vs recurrent delta rule, other chunkings): order 1e-6.
constexpr double kSelfTolerance = 1e-5;

using Logits = std::vector<std::vector<float>>;

std::vector<std::vector<double>> as_double(const Logits& logits) {
  std::vector<std::vector<double>> rows;
  for (const auto& row : logits) rows.emplace_back(row.begin(), row.end());
  return rows;
}
double distance(const Logits& actual, const Logits& expected) {
  return testing::relative_l2(actual, as_double(expected));
}

// Four layers (GDN, attention, GDN, attention) with Hv = 2 Hk and dk != dv; qwen3_next has a dense
// layer (mlp_only_layers) between MoE layers.
TinySpec hybrid_spec(const std::string& model_type) {
  TinySpec spec;
  spec.model_type = model_type;
  spec.num_layers = 4;
  spec.full_attention_interval = 2;
  spec.head_dim = 16;  // rotary 4 at the default factor 0.25
  spec.tie_word_embeddings = false;
  if (model_type == "qwen3_next") spec.mlp_only_layers = {2};
  return spec;
}

// Feeds `tokens` of sequence 0 in steps of `chunk` tokens (0: all at once) and returns every row.
Logits feed(Model& model, const std::vector<int32_t>& tokens, size_t chunk) {
  ForwardRunner runner(model);
  Logits all;
  const size_t step = chunk == 0 ? tokens.size() : chunk;
  for (size_t begin = 0; begin < tokens.size(); begin += step) {
    const Logits rows = runner.step({{0, slice(tokens, begin, std::min(tokens.size(), begin + step))}});
    all.insert(all.end(), rows.begin(), rows.end());
  }
  return all;
}

class HybridForward : public ::testing::TestWithParam<std::string> {};

// Two sequences of different lengths prefilled in one step (70 rows cross a chunk of 64) match the
// reference row by row.
TEST_P(HybridForward, BatchedPrefillMatchesReference) {
  const TinySpec spec = hybrid_spec(GetParam());
  const TinyWeights weights = testing::make_tiny_weights(spec, 31);
  const auto loaded = load_tiny(spec, weights);
  const auto a = random_tokens(spec, 70, 131), b = random_tokens(spec, 9, 231);
  ForwardRunner runner(*loaded->model);
  const Logits logits = runner.step({{0, a}, {1, b}});
  ASSERT_EQ(logits.size(), a.size() + b.size());
  EXPECT_LE(testing::relative_l2(slice(logits, 0, a.size()), testing::reference_logits(spec, weights, a)),
            kLogitTolerance);
  EXPECT_LE(testing::relative_l2(slice(logits, a.size(), logits.size()), testing::reference_logits(spec, weights, b)),
            kLogitTolerance);
  // Sensitivity: b's rows are far from those of another context (a's first 9 tokens).
  EXPECT_GT(testing::relative_l2(slice(logits, a.size(), logits.size()),
                                 testing::reference_logits(spec, weights, slice(a, 0, 9))),
            1e-2);
}

// Whole prefill, chunks of 7 (each continuing from the state slot and the KV cache) and one token at a
// time (the recurrent decode kernels) give the same logits, all matching the reference.
TEST_P(HybridForward, WholeChunkedAndTokenByTokenAgree) {
  const TinySpec spec = hybrid_spec(GetParam());
  const TinyWeights weights = testing::make_tiny_weights(spec, 32);
  const auto loaded = load_tiny(spec, weights);
  const auto tokens = random_tokens(spec, 80, 132);
  const Logits whole = feed(*loaded->model, tokens, 0);
  const Logits chunked = feed(*loaded->model, tokens, 7);
  const Logits decoded = feed(*loaded->model, tokens, 1);
  EXPECT_LE(testing::relative_l2(whole, testing::reference_logits(spec, weights, tokens)), kLogitTolerance);
  EXPECT_LE(distance(chunked, whole), kSelfTolerance);
  EXPECT_LE(distance(decoded, whole), kSelfTolerance);
}

// Mixed steps of two sequences (prefill chunks beside decode rows, then decode only) give each
// sequence what it gets alone.
TEST_P(HybridForward, BatchedSequencesEqualEachAlone) {
  const TinySpec spec = hybrid_spec(GetParam());
  const TinyWeights weights = testing::make_tiny_weights(spec, 33);
  const auto loaded = load_tiny(spec, weights);
  const auto a = random_tokens(spec, 35, 133), b = random_tokens(spec, 8, 233);
  ForwardRunner together(*loaded->model, 4, 64, /*seed=*/77);
  const Logits t1 = together.step({{0, slice(a, 0, 20)}, {1, slice(b, 0, 6)}});
  const Logits t2 = together.step({{1, slice(b, 6, 7)}, {0, slice(a, 20, 34)}});
  const Logits t3 = together.step({{0, slice(a, 34, 35)}, {1, slice(b, 7, 8)}});
  ForwardRunner alone_a(*loaded->model), alone_b(*loaded->model);
  const Logits a1 = alone_a.step({{0, slice(a, 0, 20)}}), a2 = alone_a.step({{0, slice(a, 20, 34)}}),
               a3 = alone_a.step({{0, slice(a, 34, 35)}});
  const Logits b1 = alone_b.step({{0, slice(b, 0, 6)}}), b2 = alone_b.step({{0, slice(b, 6, 7)}}),
               b3 = alone_b.step({{0, slice(b, 7, 8)}});
  EXPECT_LE(distance(slice(t1, 0, 20), a1), 1e-6);
  EXPECT_LE(distance(slice(t1, 20, 26), b1), 1e-6);
  EXPECT_LE(distance(slice(t2, 0, 1), b2), 1e-6);
  EXPECT_LE(distance(slice(t2, 1, 15), a2), 1e-6);
  EXPECT_LE(distance(slice(t3, 0, 1), a3), 1e-6);
  EXPECT_LE(distance(slice(t3, 1, 2), b3), 1e-6);
}

// A sequence forked from another's cached prefix (KV blocks and state slot copied) continues exactly as
// the original does, also after the original has moved on and changed its own slot.
TEST_P(HybridForward, RestartingFromACopiedStateSlotReproducesTheContinuation) {
  const TinySpec spec = hybrid_spec(GetParam());
  const TinyWeights weights = testing::make_tiny_weights(spec, 34);
  const auto loaded = load_tiny(spec, weights);
  const auto tokens = random_tokens(spec, 45, 134);
  ForwardRunner runner(*loaded->model);
  runner.step({{0, slice(tokens, 0, 30)}});
  runner.fork(0, 1);
  const Logits original = runner.step({{0, slice(tokens, 30, 40)}});
  const Logits original_decode = runner.step({{0, slice(tokens, 40, 41)}});
  const Logits restarted = runner.step({{1, slice(tokens, 30, 40)}});
  const Logits restarted_decode = runner.step({{1, slice(tokens, 40, 41)}});
  EXPECT_EQ(restarted, original);
  EXPECT_EQ(restarted_decode, original_decode);
  const auto reference = testing::reference_logits(spec, weights, slice(tokens, 0, 41));
  EXPECT_LE(testing::relative_l2(restarted, slice(reference, 30, 40)), kLogitTolerance);
}

INSTANTIATE_TEST_SUITE_P(Models, HybridForward, ::testing::Values("qwen3_next", "qwen3_5", "qwen3_5_moe"),
                         [](const auto& param_info) { return param_info.param; });

TEST(HybridForward, CacheSpecsDeclareSlotStateForGdnLayersAndKeysPerTokenForAttention) {
  const TinySpec spec = hybrid_spec("qwen3_5");
  const auto loaded = load_tiny(spec, testing::make_tiny_weights(spec, 35));
  const auto specs = loaded->model->cache_specs();
  ASSERT_EQ(specs.size(), 4u);
  const int64_t conv_dim = 2 * spec.linear_num_key_heads * spec.linear_key_head_dim +
                           spec.linear_num_value_heads * spec.linear_value_head_dim;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& tensors = specs[i].tensors;
    ASSERT_EQ(tensors.size(), 2u) << "layer " << i;
    if (spec.layer_is_linear(static_cast<int64_t>(i))) {
      EXPECT_TRUE(specs[i].has_slots() && !specs[i].has_paged()) << "layer " << i;
      EXPECT_EQ(tensors[0].name, "conv");
      EXPECT_EQ(tensors[0].indexing, CacheIndexing::kPerSlot);
      EXPECT_EQ(tensors[0].shape, (std::vector<int64_t>{spec.linear_conv_kernel_dim - 1, conv_dim}));
      EXPECT_FALSE(tensors[0].dtype.has_value());  // the activation dtype
      EXPECT_EQ(tensors[1].name, "recurrent");
      EXPECT_EQ(tensors[1].indexing, CacheIndexing::kPerSlot);
      EXPECT_EQ(tensors[1].shape, (std::vector<int64_t>{spec.linear_num_value_heads, spec.linear_key_head_dim,
                                                        spec.linear_value_head_dim}));
      EXPECT_EQ(tensors[1].dtype, DType::kF32);
    } else {
      EXPECT_TRUE(specs[i].has_paged() && !specs[i].has_slots()) << "layer " << i;
      for (size_t j = 0; j < 2; ++j) {
        EXPECT_EQ(tensors[j].name, j == 0 ? "k" : "v");
        EXPECT_EQ(tensors[j].indexing, CacheIndexing::kPerToken);
        EXPECT_EQ(tensors[j].shape, (std::vector<int64_t>{spec.num_kv_heads, spec.head_dim}));
        EXPECT_FALSE(tensors[j].dtype.has_value());
      }
    }
  }
  const ModelCapabilities capabilities = loaded->model->capabilities();
  EXPECT_TRUE(capabilities.graph_safe && capabilities.supports_verify && !capabilities.needs_prestage);
  EXPECT_TRUE(loaded->model->step_input_specs().empty());
  // conv window (K-1) x conv_dim in f32 on the CPU + Hv dk dv fp32, per GDN layer.
  const uint64_t per_layer =
      static_cast<uint64_t>((spec.linear_conv_kernel_dim - 1) * conv_dim) * 4 +
      static_cast<uint64_t>(spec.linear_num_value_heads * spec.linear_key_head_dim * spec.linear_value_head_dim) * 4;
  EXPECT_EQ(slot_bytes_per_slot(specs, DType::kF32), 2 * per_layer);
  EXPECT_EQ(paged_bytes_per_block(specs, 16, DType::kF32),
            2u * 2 * 16 * static_cast<uint64_t>(spec.num_kv_heads * spec.head_dim) * 4);  // 2 layers, k and v
}

// Composite configs (text_config, model.language_model. keys, mtp.* and model.visual.* present) and
// fused experts load the same weights as the plain layout.
TEST(HybridForward, CompositeConfigsPrefixesAndExpertLayoutsGiveIdenticalLogits) {
  for (const std::string model_type : {"qwen3_5", "qwen3_5_moe"}) {
    TinySpec spec = hybrid_spec(model_type);
    const TinyWeights weights = testing::make_tiny_weights(spec, 36);
    const auto a = random_tokens(spec, 12, 136), b = random_tokens(spec, 3, 236);
    const auto run = [&](const TinySpec& s, const CheckpointLayout& layout) {
      const auto loaded = load_tiny(s, weights, layout);
      ForwardRunner runner(*loaded->model);
      return runner.step({{0, a}, {1, b}});
    };
    const Logits plain = run(spec, {"model.", ExpertLayout::kPerExpert, 1, DType::kBF16});
    TinySpec composite = spec;
    composite.composite_config = true;
    EXPECT_EQ(run(composite, {"model.language_model.", ExpertLayout::kPerExpert, 1, DType::kBF16}), plain)
        << model_type;
    if (spec.is_moe_model()) {
      EXPECT_EQ(run(composite, {"model.language_model.", ExpertLayout::kFused, 2, DType::kBF16}), plain) << model_type;
    }
    EXPECT_LE(testing::relative_l2(slice(plain, 0, a.size()), testing::reference_logits(spec, weights, a)),
              kLogitTolerance)
        << model_type;
  }
}

TEST(HybridForward, ExplicitLayerTypesAndRotaryFractionMatchReference) {
  // layer_types with legacy names (attention -> full_attention, mamba -> linear_attention) and a rotary
  // fraction of one half.
  TinySpec spec = hybrid_spec("qwen3_next");
  spec.num_layers = 3;
  spec.mlp_only_layers = {};
  spec.layer_types = {"linear_attention", "full_attention", "linear_attention"};
  spec.partial_rotary_factor = 0.5;
  const TinyWeights weights = testing::make_tiny_weights(spec, 37);
  TinySpec legacy = spec;
  legacy.layer_types = {"mamba", "attention", "linear_attention"};
  const auto loaded = load_tiny(legacy, weights);
  const auto tokens = random_tokens(spec, 20, 137);
  ForwardRunner runner(*loaded->model);
  EXPECT_LE(testing::relative_l2(runner.step({{0, tokens}}), testing::reference_logits(spec, weights, tokens)),
            kLogitTolerance);
  // The reference is sensitive to the rotary fraction.
  TinySpec quarter = spec;
  quarter.partial_rotary_factor = 0.25;
  ForwardRunner again(*loaded->model);
  EXPECT_GT(testing::relative_l2(again.step({{0, tokens}}), testing::reference_logits(quarter, weights, tokens)), 1e-4);
}

TEST(HybridForward, UnknownLayerTypeIsRejected) {
  TinySpec spec = hybrid_spec("qwen3_5");
  spec.num_layers = 2;
  spec.layer_types = {"linear_attention", "sliding_attention"};
  const TinyWeights weights = testing::make_tiny_weights(spec, 38);
  TempDir dir;
  testing::write_tiny_checkpoint(dir.path(), spec, weights);
  EXPECT_TRUE(testing::throws_error([&] { load_model(dir.path(), Device::cpu()); }, ErrorCode::kUnsupported,
                                    {"sliding_attention"}));
}

// Benchmarks build these architectures with random weights: every mixer and FFN kind must come up and
// produce finite logits from a text-only *_text config.
TEST(HybridForward, RandomWeightModelsRun) {
  for (const std::string model_type : {"qwen3_next", "qwen3_5", "qwen3_5_moe"}) {
    TinySpec spec = hybrid_spec(model_type);
    nlohmann::json config = testing::tiny_config_json(spec);
    if (model_type != "qwen3_next") config["model_type"] = model_type + "_text";
    const auto model = make_random_model(parse_model_config(config, "random.json"), Device::cpu(), 3);
    ForwardRunner runner(*model);
    const auto tokens = random_tokens(spec, 10, 139);
    for (const Logits& rows : {runner.step({{0, tokens}}), runner.step({{0, {tokens[0]}}})}) {
      for (const auto& row : rows)
        for (const float value : row) ASSERT_TRUE(std::isfinite(value)) << model_type;
    }
  }
}

}  // namespace
}  // namespace metrale
