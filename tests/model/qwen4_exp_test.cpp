// qwen4_exp (model/arch/qwen4_exp.cpp) on tiny random checkpoints (tests/common/tiny_qwen4_checkpoint.h):
// the PLE constants against qwen.md §7.2's values, loading (composite and text-only prefixes, the PLE
// table as one tensor or as row shards, the stored hash buffers checked) and its errors, the CPU
// forward against the independent fp64 evaluation of the formulas (tests/model/qwen4_reference.h),
// chunked prefill and decode against one whole prefill, PLE ids with EOS inside the prompt and
// across chunk boundaries, and the PLE and GDN state after a rejected draft.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "common/step_runner.h"
#include "common/tiny_qwen4_checkpoint.h"
#include "core/test_support.h"
#include "kernels/ple_ngram.h"
#include "model/arch/architectures.h"
#include "model/blocks/decoder.h"
#include "model/blocks/ple.h"
#include "model/qwen4_reference.h"
#include "model/registry.h"
#include "model/spec_helpers.h"

namespace metrale {
namespace {

using testing::ForwardRunner;
using testing::Qwen4Spec;
using testing::Qwen4Weights;
using Logits = std::vector<std::vector<float>>;

constexpr double kReferenceTolerance = 1e-4;  // fp32 engine vs fp64 formulas, relative L2 of all logits
constexpr double kChunkTolerance = 1e-5;      // chunked/decoded vs whole prefill (chunked vs recurrent GDN)

// A prompt with the PLE EOS inside it (positions 5 and 6: an EOS right after an EOS too).
std::vector<int32_t> prompt_with_eos(const Qwen4Spec& spec, size_t length, uint64_t seed) {
  std::vector<int32_t> tokens = testing::random_tokens(spec.base, length, seed);
  for (auto& t : tokens)
    if (t == spec.eos_token_id) t = static_cast<int32_t>(spec.eos_token_id + 1);
  tokens.at(5) = static_cast<int32_t>(spec.eos_token_id);
  tokens.at(6) = static_cast<int32_t>(spec.eos_token_id);
  tokens.at(17) = static_cast<int32_t>(spec.eos_token_id);
  return tokens;
}

// Runs `tokens` of sequence 0 in chunks of `chunk` tokens (0: one step) and returns every row's logits.
Logits run_chunked(Model& model, const std::vector<int32_t>& tokens, size_t chunk) {
  ForwardRunner runner(model, 4, 64);
  Logits all;
  const size_t step = chunk == 0 ? tokens.size() : chunk;
  for (size_t begin = 0; begin < tokens.size(); begin += step) {
    const size_t end = std::min(tokens.size(), begin + step);
    const Logits rows = runner.step({{0, testing::slice(tokens, begin, end)}});
    all.insert(all.end(), rows.begin(), rows.end());
  }
  return all;
}

std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Qwen4PleConstants, MultipliersAndPrimeSizesMatchTheSpec) {
  // qwen.md §7.2 (a): Vt 248320, seed 1234, L 0.
  EXPECT_EQ(kernels::ple_layer_multipliers(248320, 3, 0, 1234),
            (std::vector<int64_t>{23703573157769, 20109073645365, 8052911324071}));
  EXPECT_EQ(kernels::ple_layer_multipliers(248320, 3, 1, 1234), testing::reference_multipliers(248320, 3, 1, 1234));
  // (b): the first primes >= 20,000,000 are 20000003, 20000023, 20000033, 20000047; layer L's heads
  // continue the sequence after the L * NH primes of the layers before.
  const kernels::PleHeadTable layer0 = kernels::ple_head_table(20000000, 16, 0, 128);
  ASSERT_EQ(layer0.sizes.size(), 16u);
  EXPECT_EQ(std::vector<int64_t>(layer0.sizes.begin(), layer0.sizes.begin() + 4),
            (std::vector<int64_t>{20000003, 20000023, 20000033, 20000047}));
  EXPECT_EQ(layer0.offsets[0], 0);
  EXPECT_EQ(layer0.offsets[1], 20000003);
  EXPECT_EQ(layer0.total, 320001446);
  EXPECT_EQ(layer0.padded_rows, 320001536);  // ceil(320001446 / 128) * 128
  const kernels::PleHeadTable layer1 = kernels::ple_head_table(20000000, 16, 1, 128);
  EXPECT_EQ(layer1.sizes[0], 20000213);  // the 17th prime >= 2e7
  EXPECT_EQ(layer1.offsets[0], 0);
  EXPECT_EQ(kernels::ple_head_table(31, 4, 1, 8).sizes, testing::reference_head_sizes(31, 4, 1));
}

class Qwen4Model : public ::testing::Test {
 protected:
  Qwen4Spec spec;
  Qwen4Weights weights = testing::make_qwen4_weights(spec, 7);
};

TEST_F(Qwen4Model, ForwardMatchesTheFp64Formulas) {
  const auto loaded = testing::load_qwen4(spec, weights);
  const std::vector<int32_t> tokens = prompt_with_eos(spec, 40, 3);
  const Logits logits = run_chunked(*loaded->model, tokens, 0);
  const auto expected = testing::qwen4_reference_logits(spec, weights, tokens);
  EXPECT_LE(testing::relative_l2(logits, expected), kReferenceTolerance);
  // The selection matters: with a budget above the prompt (every query dense) the formulas give
  // other logits.
  Qwen4Spec dense = spec;
  dense.indexer_budget = 64;
  EXPECT_GT(testing::relative_l2(logits, testing::qwen4_reference_logits(dense, weights, tokens)), 1e-3);
}

// The same comparison on variants that isolate the pieces: GDN layers only (hyper-connections, GDN,
// MoE), dense attention (the budget above the prompt), PLE on a layer, sparse QSA.
TEST(Qwen4Variants, ForwardMatchesTheFp64Formulas) {
  struct Variant {
    const char* name;
    std::vector<std::string> types;
    std::vector<int64_t> ple;
    int64_t budget;
  };
  const std::vector<Variant> variants = {
      {"gdn only", {"linear_attention", "linear_attention"}, {}, 4},
      {"dense attention", {"linear_attention", "qwen_sparse_attention"}, {}, 64},
      {"ple", {"linear_attention", "linear_attention"}, {1}, 4},
      {"sparse attention", {"qwen_sparse_attention", "linear_attention"}, {}, 4},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    Qwen4Spec spec;
    spec.base.num_layers = static_cast<int64_t>(v.types.size());
    spec.layer_types = v.types;
    spec.ple_layer_ids = v.ple;
    spec.indexer_budget = v.budget;
    const Qwen4Weights weights = testing::make_qwen4_weights(spec, 17);
    const auto loaded = testing::load_qwen4(spec, weights);
    const std::vector<int32_t> tokens = prompt_with_eos(spec, 24, 3);
    EXPECT_LE(testing::relative_l2(run_chunked(*loaded->model, tokens, 0),
                                   testing::qwen4_reference_logits(spec, weights, tokens)),
              kReferenceTolerance);
  }
}

TEST_F(Qwen4Model, LayoutsLoadAlike) {
  const std::vector<int32_t> tokens = prompt_with_eos(spec, 24, 4);
  const auto sharded = testing::load_qwen4(spec, weights);
  const auto whole = testing::load_qwen4(spec, weights, {.shard_table = false, .write_buffers = false});
  Qwen4Spec text_only = spec;
  text_only.composite_config = false;
  const auto plain = testing::load_qwen4(text_only, weights);
  const Logits a = run_chunked(*sharded->model, tokens, 0);
  EXPECT_EQ(testing::relative_l2(run_chunked(*whole->model, tokens, 0), a), 0.0);
  EXPECT_EQ(testing::relative_l2(run_chunked(*plain->model, tokens, 0), a), 0.0);
  // The table stays in the mapped shards (3 parts of 51, 51, 50 rows).
  const auto& decoder = dynamic_cast<const DecoderModel&>(*sharded->model);
  const auto& ple = dynamic_cast<const PleBlock&>(decoder.trunk().block(0));
  EXPECT_EQ(ple.table().num_shards(), 3u);
  EXPECT_EQ(ple.table().rows(), 152);
}

TEST_F(Qwen4Model, ChunkedPrefillAndDecodeMatchOneWholePrefill) {
  const auto loaded = testing::load_qwen4(spec, weights);
  const std::vector<int32_t> tokens = prompt_with_eos(spec, 30, 5);
  const Logits whole = run_chunked(*loaded->model, tokens, 0);
  for (const size_t chunk : {64u, 7u, 1u}) {
    SCOPED_TRACE(::testing::Message() << "chunk " << chunk);
    EXPECT_LE(testing::relative_l2(run_chunked(*loaded->model, tokens, chunk), whole), kChunkTolerance);
  }
}

TEST_F(Qwen4Model, BatchedSequencesMatchSingleOnes) {
  const auto loaded = testing::load_qwen4(spec, weights);
  const std::vector<int32_t> a = prompt_with_eos(spec, 21, 6), b = testing::random_tokens(spec.base, 13, 7);
  ForwardRunner runner(*loaded->model, 4, 64);
  const Logits both = runner.step({{0, a}, {1, b}});
  const Logits alone_a = run_chunked(*loaded->model, a, 0), alone_b = run_chunked(*loaded->model, b, 0);
  EXPECT_LE(testing::relative_l2(testing::slice(both, 0, a.size()), alone_a), 1e-6);
  EXPECT_LE(testing::relative_l2(testing::slice(both, a.size(), both.size()), alone_b), 1e-6);
}

TEST_F(Qwen4Model, PleIdsFollowTheEosRulesAcrossChunks) {
  const auto loaded = testing::load_qwen4(spec, weights);
  const auto& decoder = dynamic_cast<const DecoderModel&>(*loaded->model);
  const auto& ple = dynamic_cast<const PleBlock&>(decoder.trunk().block(0));
  const std::vector<int32_t> tokens = prompt_with_eos(spec, 20, 8);
  const auto expected = testing::qwen4_reference_ple_ids(spec, 0, tokens);
  // Sequence split at 1, 6 (right after the first EOS) and 7 (after the second): each part sees the
  // earlier tokens as its history.
  const std::vector<size_t> cuts = {0, 1, 6, 7, 20};
  for (size_t part = 0; part + 1 < cuts.size(); ++part) {
    const std::vector<int32_t> past = testing::slice(tokens, 0, cuts[part]);
    const std::vector<int32_t> rows = testing::slice(tokens, cuts[part], cuts[part + 1]);
    const std::vector<int32_t> cu_q = {0, static_cast<int32_t>(rows.size())};
    std::vector<int32_t> positions(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) positions[i] = static_cast<int32_t>(cuts[part] + i);
    const std::vector<std::span<const int32_t>> history = {past};
    PrestageRows prestage;
    prestage.num_tokens = static_cast<int64_t>(rows.size());
    prestage.num_seqs = 1;
    prestage.token_ids = rows;
    prestage.positions = positions;
    prestage.cu_q = cu_q;
    prestage.history = history;
    const std::vector<int64_t> ids = ple.ngram_ids(prestage);
    const int64_t heads = spec.ngram_heads();
    for (size_t i = 0; i < rows.size(); ++i)
      for (int64_t h = 0; h < heads; ++h)
        EXPECT_EQ(ids[i * static_cast<size_t>(heads) + static_cast<size_t>(h)], expected[cuts[part] + i][static_cast<size_t>(h)])
            << "position " << cuts[part] + i << " head " << h;
  }
  // A token right after an EOS sees only EOS: positions 6 and 7 hash the same order-2 context
  // (EOS, token) as a sequence start with that token.
  const auto start = testing::qwen4_reference_ple_ids(spec, 0, {tokens[7]});
  EXPECT_EQ(expected[7], start[0]);
}

TEST_F(Qwen4Model, RejectedDraftLeavesPleAndGdnStateAsPlainDecoding) {
  const auto loaded = testing::load_qwen4(spec, weights);
  Model& model = *loaded->model;
  EXPECT_TRUE(model.capabilities().supports_verify);
  EXPECT_TRUE(model.capabilities().needs_prestage);
  const std::vector<int32_t> prompt = prompt_with_eos(spec, 19, 9);
  const std::vector<int32_t> drafts = {11, static_cast<int32_t>(spec.eos_token_id), 13, 14};
  const std::vector<CacheSpec> specs = model.cache_specs();
  for (int32_t kept = 1; kept <= 4; ++kept) {
    SCOPED_TRACE(::testing::Message() << "kept " << kept);
    testing::SpecRunner speculative(model, false), plain(model, false);
    (void)speculative.step({{0, prompt}});
    (void)plain.step({{0, prompt}});
    const auto verified = speculative.step({{0, drafts}}, /*verify=*/true);
    speculative.commit({kept});
    for (int32_t i = 0; i < kept; ++i) {
      const auto decoded = plain.step({{0, {drafts[static_cast<size_t>(i)]}}});
      EXPECT_LE(testing::relative_l2(Logits{verified.logits[static_cast<size_t>(i)]}, decoded.logits), kChunkTolerance);
    }
    for (size_t block = 0; block < specs.size(); ++block) {
      if (!specs[block].has_slots()) continue;
      for (size_t which = 0; which < specs[block].tensors.size(); ++which) {
        const std::vector<float> a = speculative.state(0, block, which), b = plain.state(0, block, which);
        double worst = 0.0;
        for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(double{a[i]} - double{b[i]}));
        EXPECT_LT(worst, 1e-6) << "block " << block << " state " << which;
      }
    }
    const std::vector<int32_t> next = {21, 22, 23};
    const auto a = speculative.step({{0, next}}), b = plain.step({{0, next}});
    EXPECT_LE(testing::relative_l2(a.logits, b.logits), kChunkTolerance);
  }
}

// ---- loading errors ----

class Qwen4Errors : public Qwen4Model {
 protected:
  // The load error of `spec` after `edit` changes its config.json's text config.
  std::string load_error(const std::function<void(nlohmann::json&)>& edit, const testing::Qwen4Layout& layout = {}) {
    testing::TempDir dir;
    testing::write_qwen4_checkpoint(dir.path(), spec, weights, layout);
    nlohmann::json config = testing::qwen4_config_json(spec);
    edit(config["text_config"]);
    std::ofstream(dir.path() / "config.json") << config.dump(2);
    return error_of([&] { (void)load_model(dir.path(), Device::cpu()); });
  }
};

TEST_F(Qwen4Errors, MalformedFieldsAreNamed) {
  EXPECT_NE(load_error([](auto& c) { c["hc_count"] = 1; }).find("hc_count must be > 1"), std::string::npos);
  EXPECT_NE(load_error([](auto& c) { c["ple_layer_ids"] = {2}; }).find("is not a linear_attention layer"),
            std::string::npos);
  EXPECT_NE(load_error([](auto& c) { c["ple_layer_ids"] = {0}; }).find("outside the 1-based layer ids"),
            std::string::npos);
  EXPECT_NE(load_error([](auto& c) { c["layer_types"][1] = "sliding_attention"; }).find("sliding_attention"),
            std::string::npos);
  EXPECT_NE(load_error([](auto& c) { c["indexer_kv_heads"] = 2; }).find("indexer_kv_heads must be 1"),
            std::string::npos);
  EXPECT_NE(load_error([](auto& c) { c["indexer_budget"] = 5; }).find("not a multiple of indexer_compress_ratio"),
            std::string::npos);
  EXPECT_NE(load_error([](auto& c) { c.erase("indexer_head_dim"); }).find("indexer_head_dim"), std::string::npos);
  EXPECT_NE(load_error([](auto& c) { c["output_gate_type"] = "relu"; }).find("output_gate_type 'relu'"),
            std::string::npos);
  EXPECT_NE(load_error([](auto& c) { c.erase("eos_token_id"); }).find("need eos_token_id"), std::string::npos);
  EXPECT_NE(load_error([](auto& c) { c["ple_embed_dim"] = 15; }).find("ple_embed_dim 15"), std::string::npos);
  // full_attention is rewritten to qwen_sparse_attention; the reference's cache kinds name it too.
  EXPECT_EQ(load_error([](auto& c) { c["layer_types"][1] = "full_attention"; }), "(no error)");
  EXPECT_EQ(load_error([](auto& c) { c["layer_types"][3] = "deepseek_sparse_attention"; }), "(no error)");
}

TEST_F(Qwen4Errors, StoredBuffersMustMatchTheFormulas) {
  // A seed that differs from the checkpoint's changes the multipliers.
  EXPECT_NE(load_error([](auto& c) { c["seed"] = 99; }).find("ple.ple_embedding.layer_multipliers"),
            std::string::npos);
  // Another base changes the head sizes (and the table's rows).
  EXPECT_NE(load_error([](auto& c) { c["ngram_vocab_size_base"] = 37; }).find("ngram_heads_vocab_sizes"),
            std::string::npos);
  // A different shard count than the checkpoint's.
  const std::string shards = load_error([](auto& c) { c["split_ngram_parts"] = 4; });
  EXPECT_NE(shards.find("shard_"), std::string::npos) << shards;
}

TEST(Qwen4Layout, LayerKindsFromTheConfig) {
  Qwen4Spec spec;
  nlohmann::json text = testing::qwen4_config_json(spec)["text_config"];
  text.erase("layer_types");
  text["full_attention_interval"] = 2;
  text["ple_layer_ids"] = {3, 1, 3};
  const ModelConfig config = parse_model_config(text, "/virtual/qwen4/config.json");
  const arch::Qwen4ExpLayout layout = arch::qwen4_exp_layout(config);
  EXPECT_EQ(layout.attention, (std::vector<bool>{false, true, false, true}));
  EXPECT_EQ(layout.ple_layers, (std::vector<int64_t>{0, 2}));
}

// The bench preset (configs/qwen3.8-flash-next.json) parses into the released per-layer shapes.
TEST(Qwen4Layout, BenchPresetParses) {
  const std::filesystem::path preset = std::filesystem::path(METRALE_SOURCE_DIR) / "configs" / "qwen3.8-flash-next.json";
  ASSERT_TRUE(std::filesystem::exists(preset)) << preset;
  std::ifstream in(preset);
  const ModelConfig config = parse_model_config(nlohmann::json::parse(in), preset);
  EXPECT_EQ(config.model_type, "qwen4_exp_text");
  EXPECT_EQ(config.hidden_size, 2560);
  const arch::Qwen4ExpLayout layout = arch::qwen4_exp_layout(config);
  EXPECT_EQ(std::count(layout.attention.begin(), layout.attention.end(), true), config.num_layers / 4);
  EXPECT_EQ(layout.ple_layers, (std::vector<int64_t>{0}));
  EXPECT_EQ(config.get_int("indexer_budget") / config.get_int("indexer_compress_ratio"), 512);
  EXPECT_DOUBLE_EQ(config.rope.partial_rotary_factor * static_cast<double>(config.head_dim), 64.0);
}

}  // namespace
}  // namespace metrale
