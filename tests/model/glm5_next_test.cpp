// glm5_next (GLM-5.3-Flash) on the CPU: its config and schedules, both checkpoint layouts, and the
// forward of tiny random checkpoints (tests/common/tiny_glm5_checkpoint.h) against the independent
// double-precision evaluation of glm5_reference_helpers.cpp and against itself (chunkings, decode,
// speculative verify with KDA rollback, the MTP head).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>

#include "model/spec_helpers.h"
#include "core/test_support.h"
#include "model/arch/glm5_next.h"
#include "model/glm5_reference_helpers.h"
#include "model/model_helpers.h"
#include "model/registry.h"
#include "model/safetensors.h"

namespace metrale {
namespace {

using testing::ForwardRunner;
using testing::Glm5CheckpointLayout;
using testing::Glm5Layout;
using testing::slice;
using testing::SpecRunner;
using testing::TinyGlm5Spec;
using testing::TinyWeights;
using Logits = std::vector<std::vector<float>>;

// fp32 activations against the fp64 evaluation over 4 layers and up to 80 tokens.
constexpr double kReferenceTolerance = 1e-4;
// The same model fed differently (chunked against recurrent KDA, other step shapes).
constexpr double kSelfTolerance = 1e-5;

std::vector<int32_t> tokens_of(const TinyGlm5Spec& spec, size_t count, uint64_t seed) {
  testing::TinySpec vocab;
  vocab.vocab_size = spec.vocab_size;
  return testing::random_tokens(vocab, count, seed);
}

std::vector<std::vector<double>> as_double(const Logits& logits) {
  std::vector<std::vector<double>> rows;
  for (const auto& row : logits) rows.emplace_back(row.begin(), row.end());
  return rows;
}

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

ModelConfig parse(const nlohmann::json& json) { return parse_model_config(json, "/virtual/glm5/config.json"); }

// ---------------------------------------------------------------------------------------------
// Config

TEST(Glm5NextConfig, DefaultsAndDerivedSchedules) {
  const nlohmann::json json = {{"model_type", "glm5_next_text"}, {"vocab_size", 100}, {"hidden_size", 64},
                               {"num_hidden_layers", 8},         {"num_attention_heads", 4}, {"head_dim", 0},
                               {"qk_rope_head_dim", 0}};
  const ModelConfig model = parse(json);
  const arch::Glm5NextConfig c = arch::parse_glm5_next_config(model);
  EXPECT_EQ(c.qk_nope_head_dim, 256);  // head_dim 0 in the file is accepted and ignored
  EXPECT_EQ(c.v_head_dim, 256);
  const std::vector<arch::Glm5NextMixer> expected_mixers = {
      arch::Glm5NextMixer::kKda, arch::Glm5NextMixer::kKda, arch::Glm5NextMixer::kKda, arch::Glm5NextMixer::kDsa,
      arch::Glm5NextMixer::kKda, arch::Glm5NextMixer::kKda, arch::Glm5NextMixer::kKda, arch::Glm5NextMixer::kDsa};
  EXPECT_EQ(c.mixers, expected_mixers);
  EXPECT_EQ(c.moe, (std::vector<bool>{false, false, false, true, true, true, true, true}));
  EXPECT_EQ(c.shared_indexer, std::vector<bool>(8, false));
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.num_experts, 288);
  EXPECT_EQ(c.index_kpool, 16);
  ASSERT_TRUE(c.linear_lower_bound.has_value());
  EXPECT_EQ(*c.linear_lower_bound, -5.0);
  EXPECT_EQ(c.swiglu_limit, 10.0);
}

TEST(Glm5NextConfig, CompositeConfigAndOverrides) {
  nlohmann::json text = {{"model_type", "glm5_next_text"}, {"vocab_size", 100}, {"hidden_size", 64},
                         {"num_hidden_layers", 4},
                         {"num_attention_heads", 4},
                         {"layer_types", {"linear_attention", "full_attention", "deepseek_sparse_attention",
                                          "linear_attention"}},
                         {"index_topk_pattern", "FFSF"},
                         {"linear_lower_bound", nullptr},
                         {"linear_attn_config", {{"num_heads", 3}, {"head_dim", 16}, {"short_conv_kernel_size", 3}}},
                         {"n_routed_experts", 16}};
  const nlohmann::json json = {{"model_type", "glm5_next"}, {"text_config", text}};
  const arch::Glm5NextConfig c = arch::parse_glm5_next_config(parse(json));
  EXPECT_EQ(c.mixers[1], arch::Glm5NextMixer::kDsa);  // full_attention is renamed to DSA
  EXPECT_EQ(c.shared_indexer, (std::vector<bool>{false, false, true, false}));
  EXPECT_EQ(c.linear_num_heads, 3);
  EXPECT_EQ(c.linear_head_dim, 16);
  EXPECT_EQ(c.linear_conv_kernel, 3);
  // safe_gate absent and no bound: the bound becomes -5.
  ASSERT_TRUE(c.linear_lower_bound.has_value());
  EXPECT_EQ(*c.linear_lower_bound, -5.0);
  text["linear_attn_config"]["safe_gate"] = false;
  EXPECT_FALSE(arch::parse_glm5_next_config(parse({{"model_type", "glm5_next"}, {"text_config", text}}))
                   .linear_lower_bound.has_value());
  // The freq / offset rule: layer i is full iff max(i - offset + 1, 0) % freq == 0.
  text.erase("index_topk_pattern");
  text["layer_types"] = std::vector<std::string>(4, "deepseek_sparse_attention");
  text["index_topk_freq"] = 2;
  text["index_skip_topk_offset"] = 1;
  EXPECT_EQ(arch::parse_glm5_next_config(parse(text)).shared_indexer, (std::vector<bool>{false, true, false, true}));
}

TEST(Glm5NextConfig, InvalidConfigsFailWithTheField) {
  const nlohmann::json base = {{"model_type", "glm5_next_text"}, {"vocab_size", 100}, {"hidden_size", 64},
                               {"num_hidden_layers", 4}, {"num_attention_heads", 4}};
  const auto fails_with = [&](nlohmann::json json, const std::string& text) {
    SCOPED_TRACE(json.dump());
    try {
      arch::parse_glm5_next_config(parse(json));
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  auto json = base;
  json["qk_rope_head_dim"] = 64;
  fails_with(json, "qk_rope_head_dim");
  json = base;
  json["num_key_value_heads"] = 2;
  fails_with(json, "num_key_value_heads");
  json = base;
  json["index_topk_pattern"] = "FFXF";
  fails_with(json, "index_topk_pattern");
  json = base;
  json["index_topk_pattern"] = "FFFS";  // layer 3 (DSA) after layer 2 (KDA)
  fails_with(json, "shared indexer");
  json = base;
  json["index_topk"] = 100;  // not a multiple of index_kpool 16
  fails_with(json, "index_topk");
  json = base;
  json["layer_types"] = {"linear_attention", "mamba", "linear_attention", "linear_attention"};
  fails_with(json, "mamba");
  json = base;
  json["q_lora_rank"] = nullptr;
  fails_with(json, "q_lora_rank");
}

// ---------------------------------------------------------------------------------------------
// Forward against the fp64 evaluation

class Glm5Forward : public ::testing::TestWithParam<bool> {  // true: the softplus gate (no lower bound)
 protected:
  TinyGlm5Spec spec() const {
    TinyGlm5Spec spec;
    if (GetParam()) spec.linear_lower_bound.reset();
    return spec;
  }
};

// Whole prefill and chunks of 64, 7 and 1 (decode) all match the reference, and each other; DSA is
// sparse for most of the 80 positions.
TEST_P(Glm5Forward, ChunkingsMatchTheReference) {
  const TinyGlm5Spec spec = this->spec();
  const TinyWeights weights = testing::make_glm5_weights(spec, 51);
  const auto loaded = testing::load_glm5(spec, weights);
  // 80 tokens: the KDA chunks of 64 are crossed inside the whole prefill and by the 64-token pieces.
  const auto tokens = tokens_of(spec, 80, 151);
  const testing::Glm5Reference reference = testing::glm5_reference(spec, weights, tokens);
  EXPECT_GE(reference.sparse_rows, 60);
  const Logits whole = feed(*loaded->model, tokens, 0);
  EXPECT_LE(testing::relative_l2(whole, reference.logits), kReferenceTolerance);
  std::printf("[glm5] whole: rel L2 %.3e against the fp64 evaluation (%lld sparse rows)\n",
              testing::relative_l2(whole, reference.logits), static_cast<long long>(reference.sparse_rows));
  for (const size_t chunk : {64u, 7u, 1u}) {
    SCOPED_TRACE(chunk);
    const Logits pieces = feed(*loaded->model, tokens, chunk);
    EXPECT_LE(testing::relative_l2(pieces, reference.logits), kReferenceTolerance);
    std::printf("[glm5] chunk %zu: rel L2 %.3e\n", chunk, testing::relative_l2(pieces, reference.logits));
    EXPECT_LE(testing::relative_l2(pieces, as_double(whole)), kSelfTolerance);
  }
  // Sensitivity: another context's rows are far away.
  const auto other = testing::glm5_reference(spec, weights, tokens_of(spec, 80, 152));
  EXPECT_GT(testing::relative_l2(whole, other.logits), 1e-2);
}

// Two sequences batched (prefill beside decode rows) equal each alone.
TEST_P(Glm5Forward, BatchedSequencesEqualEachAlone) {
  const TinyGlm5Spec spec = this->spec();
  const TinyWeights weights = testing::make_glm5_weights(spec, 52);
  const auto loaded = testing::load_glm5(spec, weights);
  const auto a = tokens_of(spec, 30, 153), b = tokens_of(spec, 9, 253);
  ForwardRunner together(*loaded->model, 4, 64, 77);
  const Logits t1 = together.step({{0, slice(a, 0, 21)}, {1, slice(b, 0, 8)}});
  const Logits t2 = together.step({{1, slice(b, 8, 9)}, {0, slice(a, 21, 30)}});
  ForwardRunner alone_a(*loaded->model), alone_b(*loaded->model);
  const Logits a1 = alone_a.step({{0, slice(a, 0, 21)}}), a2 = alone_a.step({{0, slice(a, 21, 30)}});
  const Logits b1 = alone_b.step({{0, slice(b, 0, 8)}}), b2 = alone_b.step({{0, slice(b, 8, 9)}});
  EXPECT_LE(testing::relative_l2(slice(t1, 0, 21), as_double(a1)), 1e-6);
  EXPECT_LE(testing::relative_l2(slice(t1, 21, 29), as_double(b1)), 1e-6);
  EXPECT_LE(testing::relative_l2(slice(t2, 0, 1), as_double(b2)), 1e-6);
  EXPECT_LE(testing::relative_l2(slice(t2, 1, 10), as_double(a2)), 1e-6);
}

// A sequence forked from another's cached prefix (latent, indexer and pool blocks copied, KDA slot
// copied: what a prefix-cache hit restores) continues exactly as the original.
TEST_P(Glm5Forward, ForkedPrefixContinuesExactly) {
  const TinyGlm5Spec spec = this->spec();
  const TinyWeights weights = testing::make_glm5_weights(spec, 53);
  const auto loaded = testing::load_glm5(spec, weights);
  const auto tokens = tokens_of(spec, 40, 154);
  ForwardRunner runner(*loaded->model);
  runner.step({{0, slice(tokens, 0, 24)}});
  runner.fork(0, 1);
  const Logits original = runner.step({{0, slice(tokens, 24, 40)}});
  const Logits restarted = runner.step({{1, slice(tokens, 24, 40)}});
  EXPECT_EQ(restarted, original);
}

INSTANTIATE_TEST_SUITE_P(Gates, Glm5Forward, ::testing::Values(false, true),
                         [](const auto& gate) { return gate.param ? "Softplus" : "LowerBound"; });

// ---------------------------------------------------------------------------------------------
// Layouts

TEST(Glm5Load, EveryLayoutAndPrefixLoadsTheSameModel) {
  TinyGlm5Spec spec;
  const TinyWeights weights = testing::make_glm5_weights(spec, 54);
  const auto tokens = tokens_of(spec, 20, 155);
  const auto expected = testing::glm5_reference(spec, weights, tokens).logits;
  const std::vector<Glm5CheckpointLayout> layouts = {
      {Glm5Layout::kHf, "model.language_model.", DType::kBF16},
      {Glm5Layout::kHf, "model.", DType::kF32},
      {Glm5Layout::kHub, "model.language_model.", DType::kBF16},
      {Glm5Layout::kHub, "model.", DType::kF32},
  };
  for (const auto& layout : layouts) {
    SCOPED_TRACE(layout.prefix + (layout.layout == Glm5Layout::kHub ? " hub" : " hf"));
    const auto loaded = testing::load_glm5(spec, weights, layout);
    EXPECT_TRUE(loaded->model->has_mtp());
    EXPECT_LE(testing::relative_l2(feed(*loaded->model, tokens, 0), expected), kReferenceTolerance);
  }
  TinyGlm5Spec flat = spec;
  flat.composite_config = false;
  const auto loaded = testing::load_glm5(flat, weights, {Glm5Layout::kHf, "model.", DType::kBF16});
  EXPECT_LE(testing::relative_l2(feed(*loaded->model, tokens, 0), expected), kReferenceTolerance);
}

// The hc maps are held in bf16: fp32 values in the file are rounded as the reference rounds them.
TEST(Glm5Load, HcMapsAreRoundedToBf16) {
  TinyGlm5Spec spec;
  TinyWeights weights = testing::make_glm5_weights(spec, 55);
  TinyWeights rounded = weights;
  for (auto& [key, w] : weights) {
    if (key.find("_hc.") == std::string::npos) continue;
    for (auto& v : w.values) v *= 1.0f + 1.0f / 512.0f;  // off the bf16 grid
    auto& r = rounded.at(key).values;
    for (size_t i = 0; i < r.size(); ++i) r[i] = round_to_bf16(w.values[i]);
  }
  const auto tokens = tokens_of(spec, 12, 156);
  const auto loaded = testing::load_glm5(spec, weights, {Glm5Layout::kHf, "model.language_model.", DType::kF32});
  const Logits logits = feed(*loaded->model, tokens, 0);
  EXPECT_LE(testing::relative_l2(logits, testing::glm5_reference(spec, rounded, tokens).logits), kReferenceTolerance);
}

TEST(Glm5Load, UnusedOrMissingTensorsAreErrors) {
  TinyGlm5Spec spec;
  TinyWeights weights = testing::make_glm5_weights(spec, 56);
  TinyWeights extra = weights;
  extra["layers.1.self_attn.stray.weight"] = {{2}, {1.0f, 2.0f}};
  try {
    testing::load_glm5(spec, extra);
    ADD_FAILURE() << "a stray tensor was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layers.1.self_attn.stray.weight"), std::string::npos) << e.what();
  }
  TinyWeights missing = weights;
  missing.erase("layers.0.self_attn.forget_gate.A_log");
  try {
    testing::load_glm5(spec, missing);
    ADD_FAILURE() << "a missing tensor was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("A_log"), std::string::npos) << e.what();
  }
  // A shared-indexer layer must not carry indexer weights; a full one must.
  TinyWeights shared_with_indexer = weights;
  shared_with_indexer["layers.2.self_attn.indexer.wk.weight"] = weights.at("layers.1.self_attn.indexer.wk.weight");
  EXPECT_THROW(testing::load_glm5(spec, shared_with_indexer), Error);
  // The MTP layer's tensors are the MTP head's: without eh_proj the head is not built, and its other
  // tensors are accepted unused.
  TinyWeights no_head = weights;
  no_head.erase("layers.4.eh_proj.weight");
  const auto loaded = testing::load_glm5(spec, no_head);
  EXPECT_FALSE(loaded->model->has_mtp());
}

// ---------------------------------------------------------------------------------------------
// Speculative verify, KDA rollback and the MTP head

// A verify step over drafts, committed with some rejected: the KDA slots equal plain decoding of
// the kept tokens, and the next steps agree.
TEST(Glm5Verify, CommittedKdaStateEqualsPlainDecoding) {
  TinyGlm5Spec spec;
  const TinyWeights weights = testing::make_glm5_weights(spec, 57);
  const auto loaded = testing::load_glm5(spec, weights);
  Model& model = *loaded->model;
  EXPECT_TRUE(model.capabilities().supports_verify);
  const std::vector<std::vector<int32_t>> prompts = {tokens_of(spec, 19, 160), tokens_of(spec, 6, 161)};
  const std::vector<std::vector<int32_t>> drafts = {tokens_of(spec, 4, 162), tokens_of(spec, 3, 163)};
  const std::vector<int32_t> kept = {2, 1};
  SpecRunner speculative(model, false), plain(model, false);
  for (SpecRunner* runner : {&speculative, &plain}) runner->step({{0, prompts[0]}, {1, prompts[1]}});
  const SpecRunner::Rows verified = speculative.step({{0, drafts[0]}, {1, drafts[1]}}, /*verify=*/true);
  speculative.commit(kept);
  size_t row = 0;
  for (int64_t s = 0; s < 2; ++s) {
    for (int32_t i = 0; i < kept[static_cast<size_t>(s)]; ++i) {
      const SpecRunner::Rows decoded = plain.step({{s, {drafts[static_cast<size_t>(s)][static_cast<size_t>(i)]}}});
      EXPECT_LE(testing::relative_l2(Logits{verified.logits[row + static_cast<size_t>(i)]}, as_double(decoded.logits)),
                kSelfTolerance);
    }
    row += drafts[static_cast<size_t>(s)].size();
  }
  const std::vector<CacheSpec> specs = model.cache_specs();
  int kda_blocks = 0;
  for (size_t b = 0; b < specs.size(); ++b) {
    if (!specs[b].has_slots()) continue;
    ++kda_blocks;
    for (size_t which = 0; which < specs[b].tensors.size(); ++which)
      for (int64_t s = 0; s < 2; ++s) {
        const auto a = speculative.state(s, b, which), p = plain.state(s, b, which);
        ASSERT_EQ(a.size(), p.size());
        double worst = 0.0;
        for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(a[i] - p[i])));
        EXPECT_LT(worst, 1e-5) << "block " << b << " state " << which << " sequence " << s;
      }
  }
  EXPECT_EQ(kda_blocks, 2);
  const auto next = tokens_of(spec, 3, 164);
  const SpecRunner::Rows a = speculative.step({{0, next}, {1, next}}), b = plain.step({{0, next}, {1, next}});
  EXPECT_LE(testing::relative_l2(a.logits, as_double(b.logits)), kSelfTolerance);
}

// The MTP head against the fp64 evaluation of §2.10, and whole = incremental.
TEST(Glm5Mtp, DraftLogitsMatchTheReference) {
  TinyGlm5Spec spec;
  const TinyWeights weights = testing::make_glm5_weights(spec, 58);
  const auto loaded = testing::load_glm5(spec, weights);
  Model& model = *loaded->model;
  ASSERT_TRUE(model.has_mtp());
  const auto tokens = tokens_of(spec, 30, 165);
  const testing::Glm5Reference trunk_reference = testing::glm5_reference(spec, weights, tokens);
  SpecRunner runner(model, /*with_mtp=*/true);
  const SpecRunner::Rows trunk = runner.step({{0, tokens}, {1, tokens}});
  const std::vector<int32_t> next(tokens.begin() + 1, tokens.end());
  const Logits hidden = slice(trunk.hidden, 0, next.size());
  const std::vector<std::vector<double>> hidden_reference = slice(trunk_reference.hidden, 0, next.size());
  const auto expected = testing::glm5_mtp_reference(spec, weights, next, hidden_reference);
  const SpecRunner::Rows whole = runner.mtp_step({{0, next}}, hidden);
  EXPECT_LE(testing::relative_l2(whole.logits, expected), kReferenceTolerance);
  Logits pieces;
  for (size_t begin = 0; begin < next.size(); begin += 5) {
    const size_t end = std::min(next.size(), begin + 5);
    const SpecRunner::Rows part = runner.mtp_step({{1, slice(next, begin, end)}}, slice(hidden, begin, end));
    pieces.insert(pieces.end(), part.logits.begin(), part.logits.end());
  }
  EXPECT_LE(testing::relative_l2(pieces, as_double(whole.logits)), kSelfTolerance);
}

// Rows whose draft nobody reads get only the head's keys (latent, indexer rows, pool keys:
// Model::mtp_write_keys); the rows after them see what a full MTP forward would have written, also
// where the keys-only rows complete pools.
TEST(Glm5Mtp, KeysOnlyCatchUpEqualsForward) {
  TinyGlm5Spec spec;
  const TinyWeights weights = testing::make_glm5_weights(spec, 59);
  const auto loaded = testing::load_glm5(spec, weights);
  Model& model = *loaded->model;
  const auto tokens = tokens_of(spec, 34, 166);
  SpecRunner keys(model, true), full(model, true);
  const SpecRunner::Rows trunk = keys.step({{0, tokens}});
  (void)full.step({{0, tokens}});
  const std::vector<int32_t> next(tokens.begin() + 1, tokens.end());
  const Logits hidden = slice(trunk.hidden, 0, next.size());
  const size_t last = next.size() - 1;
  const SpecRunner::Rows expected = full.mtp_step({{0, next}}, hidden);
  keys.mtp_write_keys({{0, slice(next, 0, 18)}}, slice(hidden, 0, 18));
  const SpecRunner::Rows middle = keys.mtp_step({{0, slice(next, 18, 19)}}, slice(hidden, 18, 19));
  keys.mtp_write_keys({{0, slice(next, 19, last)}}, slice(hidden, 19, last));
  const SpecRunner::Rows tail = keys.mtp_step({{0, slice(next, last, last + 1)}}, slice(hidden, last, last + 1));
  EXPECT_LE(testing::relative_l2(middle.logits, as_double(slice(expected.logits, 18, 19))), kSelfTolerance);
  EXPECT_LE(testing::relative_l2(tail.logits, as_double(slice(expected.logits, last, last + 1))), kSelfTolerance);
}

}  // namespace
}  // namespace metrale
