// The architecture registry and load_model: what loads, and the errors when it cannot (unknown
// model_type, missing or mis-shaped tensors, a missing untied LM head), each naming what is wrong.
#include <gtest/gtest.h>

#include <fstream>

#include "core/test_support.h"
#include "model/model_helpers.h"
#include "model/registry.h"
#include "model/safetensors.h"

namespace metrale {
namespace {

using testing::TempDir;
using testing::throws_error;
using testing::TinySpec;

TEST(Registry, ListsTheSupportedArchitectures) {
  std::vector<std::string> types;
  for (const auto& entry : registered_architectures()) {
    types.emplace_back(entry.model_type);
    EXPECT_NE(entry.build, nullptr);
    EXPECT_FALSE(entry.description.empty());
  }
  EXPECT_NE(std::find(types.begin(), types.end(), "qwen3"), types.end());
  EXPECT_NE(std::find(types.begin(), types.end(), "qwen3_moe"), types.end());
  ASSERT_NE(find_architecture("qwen3_moe"), nullptr);
  EXPECT_EQ(find_architecture("qwen3_moe")->model_type, "qwen3_moe");
  EXPECT_EQ(find_architecture("llama"), nullptr);
  EXPECT_EQ(find_architecture(""), nullptr);
}

TEST(LoadModel, TinyQwen3LoadsWithItsCacheSpecs) {
  TempDir dir;
  const TinySpec spec;
  testing::write_tiny_checkpoint(dir.path(), spec, testing::make_tiny_weights(spec, 1));
  const auto model = load_model(dir.path(), Device::cpu());
  EXPECT_EQ(model->config().model_type, "qwen3");
  EXPECT_TRUE(model->device().is_cpu());
  const auto specs = model->cache_specs();
  ASSERT_EQ(specs.size(), static_cast<size_t>(spec.num_layers));
  for (const auto& s : specs) {
    ASSERT_EQ(s.tensors.size(), 2u);
    for (const CacheTensorSpec& tensor : s.tensors) {
      EXPECT_EQ(tensor.indexing, CacheIndexing::kPerToken);
      EXPECT_EQ(tensor.shape, (std::vector<int64_t>{spec.num_kv_heads, spec.head_dim}));
    }
    EXPECT_EQ(s.tensors[0].name, "k");
    EXPECT_EQ(s.tensors[1].name, "v");
  }
  EXPECT_TRUE(model->capabilities().supports_verify);
  EXPECT_EQ(model->verify_scratch_bytes(8, 2), 0u);  // keys per token only: nothing to commit
}

TEST(LoadModel, TheCpuComputesInFloat32Only) {
  TempDir dir;
  const TinySpec spec;
  testing::write_tiny_checkpoint(dir.path(), spec, testing::make_tiny_weights(spec, 1));
  EXPECT_EQ(load_model(dir.path(), Device::cpu())->activation_dtype(), DType::kF32);
  LoadOptions options;
  options.compute_dtype = DType::kF32;
  EXPECT_EQ(load_model(dir.path(), Device::cpu(), options)->activation_dtype(), DType::kF32);
  options.compute_dtype = DType::kBF16;
  EXPECT_TRUE(throws_error([&] { load_model(dir.path(), Device::cpu(), options); }, ErrorCode::kUnsupported,
                           {"float32", "bf16"}));
}

TEST(LoadModel, UnknownModelTypeListsTheSupportedOnes) {
  TempDir dir;
  TinySpec spec;
  testing::write_tiny_checkpoint(dir.path(), spec, testing::make_tiny_weights(spec, 2));
  nlohmann::json config = testing::tiny_config_json(spec);
  config["model_type"] = "llama4_text";
  std::ofstream(dir / "config.json") << config.dump();
  EXPECT_TRUE(throws_error([&] { load_model(dir.path(), Device::cpu()); }, ErrorCode::kUnsupported,
                           {(dir / "config.json").string(), "'llama4_text'", "qwen3", "qwen3_moe"}));
}

TEST(LoadModel, CompositeConfigFallsBackToTheOuterModelType) {
  TempDir dir;
  TinySpec spec;
  testing::write_tiny_checkpoint(dir.path(), spec, testing::make_tiny_weights(spec, 3));
  nlohmann::json text = testing::tiny_config_json(spec);
  text["model_type"] = "qwen3_text_unknown";
  std::ofstream(dir / "config.json") << nlohmann::json{{"model_type", "qwen3"}, {"text_config", text}}.dump();
  EXPECT_NO_THROW(load_model(dir.path(), Device::cpu()));
}

TEST(LoadModel, MissingTensorIsNamed) {
  TempDir dir;
  const TinySpec spec;
  testing::TinyWeights weights = testing::make_tiny_weights(spec, 4);
  weights.erase("layers.1.self_attn.k_proj.weight");
  testing::write_tiny_checkpoint(dir.path(), spec, weights);
  EXPECT_TRUE(throws_error([&] { load_model(dir.path(), Device::cpu()); }, ErrorCode::kNotFound,
                           {"'model.layers.1.self_attn.k_proj.weight'"}));
}

TEST(LoadModel, MisShapedTensorIsNamedWithBothShapes) {
  TempDir dir;
  const TinySpec spec;
  testing::TinyWeights weights = testing::make_tiny_weights(spec, 5);
  auto& q_norm = weights.at("layers.0.self_attn.q_norm.weight");
  q_norm.shape = {spec.head_dim + 2};
  q_norm.values.resize(static_cast<size_t>(spec.head_dim + 2), 0.5f);
  testing::write_tiny_checkpoint(dir.path(), spec, weights);
  EXPECT_TRUE(
      throws_error([&] { load_model(dir.path(), Device::cpu()); }, ErrorCode::kBadFormat,
                   {(dir / "model.safetensors").string(), "'model.layers.0.self_attn.q_norm.weight'", "[14]", "[12]"}));
}

TEST(LoadModel, TransposedProjectionIsRejected) {
  TempDir dir;
  const TinySpec spec;
  testing::TinyWeights weights = testing::make_tiny_weights(spec, 6);
  auto& o_proj = weights.at("layers.1.self_attn.o_proj.weight");
  std::swap(o_proj.shape[0], o_proj.shape[1]);  // [nH*D, H] instead of [H, nH*D]
  testing::write_tiny_checkpoint(dir.path(), spec, weights);
  EXPECT_TRUE(throws_error([&] { load_model(dir.path(), Device::cpu()); }, ErrorCode::kBadFormat,
                           {"'model.layers.1.self_attn.o_proj.weight'", "[48, 32]", "[32, 48]"}));
}

TEST(LoadModel, UntiedHeadWithoutLmHeadWeight) {
  TempDir dir;
  TinySpec spec;
  spec.tie_word_embeddings = false;
  testing::TinyWeights weights = testing::make_tiny_weights(spec, 7);
  weights.erase("lm_head.weight");
  testing::write_tiny_checkpoint(dir.path(), spec, weights);
  EXPECT_TRUE(throws_error([&] { load_model(dir.path(), Device::cpu()); }, ErrorCode::kNotFound,
                           {dir.path().string(), "lm_head.weight", "tie_word_embeddings"}));
}

TEST(LoadModel, TensorTheModelDoesNotReadIsAnErrorNamingIt) {
  TempDir dir;
  const TinySpec spec;
  testing::TinyWeights weights = testing::make_tiny_weights(spec, 8);
  weights["layers.0.self_attn.q_proj.bias"] = {{spec.num_heads * spec.head_dim},
                                               std::vector<float>(static_cast<size_t>(spec.num_heads * spec.head_dim), 0.5f)};
  testing::write_tiny_checkpoint(dir.path(), spec, weights);
  EXPECT_TRUE(throws_error([&] { load_model(dir.path(), Device::cpu()); }, ErrorCode::kBadFormat,
                           {dir.path().string(), "model.layers.0.self_attn.q_proj.bias", "qwen3", "--allow-unused-weights"}));
  // The override loads it (with a warning) and the model runs as without the tensor.
  const auto model = load_model(dir.path(), Device::cpu(), LoadOptions{.allow_unused_weights = true});
  EXPECT_EQ(model->config().model_type, "qwen3");
}

TEST(LoadModel, TiedEmbeddingsMayKeepTheirStoredLmHeadCopy) {
  TempDir dir;
  TinySpec spec;
  spec.tie_word_embeddings = true;
  testing::TinyWeights weights = testing::make_tiny_weights(spec, 9);
  weights["lm_head.weight"] = weights.at("embed_tokens.weight");
  testing::write_tiny_checkpoint(dir.path(), spec, weights);
  EXPECT_NO_THROW(load_model(dir.path(), Device::cpu()));
}

TEST(LoadModel, MoeWithoutExpertsIsNamed) {
  TempDir dir;
  TinySpec spec;
  spec.model_type = "qwen3_moe";
  testing::TinyWeights weights = testing::make_tiny_weights(spec, 8);
  for (auto it = weights.begin(); it != weights.end();) {
    it = it->first.rfind("layers.1.mlp.experts.", 0) == 0 ? weights.erase(it) : std::next(it);
  }
  testing::write_tiny_checkpoint(dir.path(), spec, weights);
  EXPECT_TRUE(throws_error([&] { load_model(dir.path(), Device::cpu()); }, ErrorCode::kNotFound,
                           {"model.layers.1.mlp.experts."}));
}

TEST(LoadModel, MoeTopKLargerThanExpertCount) {
  TempDir dir;
  TinySpec spec;
  spec.model_type = "qwen3_moe";
  testing::write_tiny_checkpoint(dir.path(), spec, testing::make_tiny_weights(spec, 9));
  nlohmann::json config = testing::tiny_config_json(spec);
  config["num_experts_per_tok"] = spec.num_experts + 1;
  std::ofstream(dir / "config.json") << config.dump();
  EXPECT_TRUE(throws_error([&] { load_model(dir.path(), Device::cpu()); }, ErrorCode::kBadFormat,
                           {(dir / "config.json").string(), "num_experts_per_tok"}));
}

TEST(LoadModel, UnsupportedRopeType) {
  TempDir dir;
  TinySpec spec;
  testing::write_tiny_checkpoint(dir.path(), spec, testing::make_tiny_weights(spec, 10));
  nlohmann::json config = testing::tiny_config_json(spec);
  config["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 4.0}};
  std::ofstream(dir / "config.json") << config.dump();
  EXPECT_TRUE(throws_error([&] { load_model(dir.path(), Device::cpu()); }, ErrorCode::kUnsupported, {"longrope"}));
}

}  // namespace
}  // namespace metrale
