// load_model_config / parse_model_config: plain and composite configs, RoPE parameter folding
// (legacy rope_scaling vs rope_parameters vs top-level fields), eos ids merged with
// generation_config.json, defaults, and errors naming the file and the field.
#include "model/config.h"

#include <gtest/gtest.h>

#include <fstream>

#include "core/test_support.h"

namespace metrale {
namespace {

using testing::TempDir;
using testing::throws_error;
using testing::write_bytes;

nlohmann::json base_config() {
  return {{"model_type", "qwen3"},
          {"vocab_size", 151},
          {"hidden_size", 64},
          {"num_hidden_layers", 3},
          {"num_attention_heads", 8},
          {"num_key_value_heads", 2},
          {"head_dim", 16},
          {"intermediate_size", 96},
          {"rms_norm_eps", 1e-5},
          {"max_position_embeddings", 4096},
          {"tie_word_embeddings", true}};
}

void write_json(const std::filesystem::path& path, const nlohmann::json& json) {
  std::ofstream(path) << json.dump(2);
}

ModelConfig load(const TempDir& dir, const nlohmann::json& config) {
  write_json(dir / "config.json", config);
  return load_model_config(dir.path());
}

TEST(ModelConfig, PlainConfig) {
  TempDir dir;
  const ModelConfig c = load(dir, base_config());
  EXPECT_EQ(c.source, dir / "config.json");
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_EQ(c.outer_model_type, "qwen3");
  EXPECT_EQ(c.vocab_size, 151);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.num_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.intermediate_size, 96);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_FALSE(c.bos_token_id.has_value());
}

TEST(ModelConfig, Defaults) {
  TempDir dir;
  nlohmann::json config = base_config();
  for (const char* key :
       {"num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"})
    config.erase(key);
  const ModelConfig c = load(dir, config);
  EXPECT_EQ(c.num_kv_heads, 8);  // = num_attention_heads
  EXPECT_EQ(c.head_dim, 8);      // = hidden_size / num_attention_heads
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  // null counts as absent
  config["num_key_value_heads"] = nullptr;
  EXPECT_EQ(load(dir, config).num_kv_heads, 8);
}

TEST(ModelConfig, CompositeConfigUsesTextConfig) {
  TempDir dir;
  nlohmann::json text = base_config();
  text["model_type"] = "qwen3_5_text";
  text.erase("tie_word_embeddings");
  const nlohmann::json config = {
      {"model_type", "qwen3_5"},      {"text_config", text}, {"vision_config", {{"depth", 2}}},
      {"tie_word_embeddings", false}, {"eos_token_id", 7},   {"vocab_size", 999}};
  const ModelConfig c = load(dir, config);
  EXPECT_EQ(c.model_type, "qwen3_5_text");
  EXPECT_EQ(c.outer_model_type, "qwen3_5");
  EXPECT_EQ(c.vocab_size, 151);         // the text config's own fields win over top-level ones
  EXPECT_FALSE(c.tie_word_embeddings);  // filled from the top level
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{7}));
  EXPECT_EQ(c.text["hidden_size"], 64);
}

TEST(ModelConfig, CompositeTextConfigWithoutModelTypeTakesTheOuterOne) {
  TempDir dir;
  nlohmann::json text = base_config();
  text.erase("model_type");
  text["tie_word_embeddings"] = false;
  const ModelConfig c = load(dir, {{"model_type", "qwen3"}, {"text_config", text}, {"tie_word_embeddings", true}});
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_FALSE(c.tie_word_embeddings);  // text_config's value wins
}

TEST(ModelConfig, RopeParameters) {
  TempDir dir;
  nlohmann::json config = base_config();
  config["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
  config["rope_theta"] = 1e6;  // a value inside rope_parameters wins over the top-level one
  ModelConfig c = load(dir, config);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_DOUBLE_EQ(c.rope.theta, 5e5);

  config.erase("rope_parameters");
  c = load(dir, config);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);  // top-level rope_theta fills a missing value

  config["partial_rotary_factor"] = 0.25;
  c = load(dir, config);
  EXPECT_DOUBLE_EQ(c.rope.partial_rotary_factor, 0.25);
}

TEST(ModelConfig, LegacyRopeScalingReplacesRopeParameters) {
  TempDir dir;
  nlohmann::json config = base_config();
  config["rope_theta"] = 1e6;
  config["rope_parameters"] = {{"rope_type", "linear"}, {"factor", 2.0}, {"rope_theta", 123.0}};
  config["rope_scaling"] = {
      {"rope_type", "yarn"},      {"factor", 4.0},    {"original_max_position_embeddings", 1024}, {"beta_fast", 16},
      {"attention_factor", 1.25}, {"truncate", false}};
  const ModelConfig c = load(dir, config);
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope.factor, 4.0);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);  // rope_parameters was replaced, so its theta is gone
  EXPECT_EQ(c.rope.original_max_position_embeddings, 1024);
  EXPECT_DOUBLE_EQ(c.rope.beta_fast, 16.0);
  EXPECT_DOUBLE_EQ(c.rope.beta_slow, 1.0);
  EXPECT_EQ(c.rope.attention_factor, 1.25);
  EXPECT_FALSE(c.rope.truncate);

  // The oldest spelling: {"type": "linear"}.
  config.erase("rope_parameters");
  config["rope_scaling"] = {{"type", "linear"}, {"factor", 8.0}};
  const ModelConfig legacy = load(dir, config);
  EXPECT_EQ(legacy.rope.type, "linear");
  EXPECT_DOUBLE_EQ(legacy.rope.factor, 8.0);
  // rope_scaling: null is ignored.
  config["rope_scaling"] = nullptr;
  EXPECT_EQ(load(dir, config).rope.type, "default");
}

TEST(ModelConfig, EosIdsMergedWithGenerationConfig) {
  TempDir dir;
  nlohmann::json config = base_config();
  config["eos_token_id"] = 2;
  config["bos_token_id"] = 1;
  write_json(dir / "generation_config.json", {{"eos_token_id", {2, 7}}, {"do_sample", true}});
  ModelConfig c = load(dir, config);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{2, 7}));
  EXPECT_EQ(c.bos_token_id, 1);

  config["eos_token_id"] = {5, 3};
  write_json(dir / "generation_config.json", {{"eos_token_id", 3}});
  c = load(dir, config);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{5, 3}));

  config["eos_token_id"] = nullptr;
  write_json(dir / "generation_config.json", {{"eos_token_id", {9}}});
  EXPECT_EQ(load(dir, config).eos_token_ids, (std::vector<int64_t>{9}));

  std::filesystem::remove(dir / "generation_config.json");
  config["eos_token_id"] = {4};
  EXPECT_EQ(load(dir, config).eos_token_ids, (std::vector<int64_t>{4}));

  write_bytes(dir / "generation_config.json", "{broken");
  EXPECT_TRUE(throws_error([&] { load(dir, config); }, ErrorCode::kBadFormat,
                           {(dir / "generation_config.json").string(), "invalid JSON"}));
}

TEST(ModelConfig, MissingFileAndBadJson) {
  TempDir dir;
  EXPECT_TRUE(
      throws_error([&] { load_model_config(dir.path()); }, ErrorCode::kNotFound, {dir.path().string(), "config.json"}));
  write_bytes(dir / "config.json", "{\"model_type\": ");
  EXPECT_TRUE(throws_error([&] { load_model_config(dir.path()); }, ErrorCode::kBadFormat,
                           {(dir / "config.json").string(), "invalid JSON"}));
  write_bytes(dir / "config.json", "[1, 2]");
  EXPECT_TRUE(throws_error([&] { load_model_config(dir.path()); }, ErrorCode::kBadFormat,
                           {(dir / "config.json").string(), "object"}));
}

TEST(ModelConfig, MissingRequiredFieldsNameFileAndField) {
  TempDir dir;
  for (const char* key : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"}) {
    nlohmann::json config = base_config();
    config.erase(key);
    EXPECT_TRUE(throws_error([&] { load(dir, config); }, ErrorCode::kBadFormat,
                             {(dir / "config.json").string(), std::string("'") + key + "'", "missing"}))
        << key;
  }
  nlohmann::json config = base_config();
  config.erase("model_type");
  EXPECT_TRUE(
      throws_error([&] { load(dir, config); }, ErrorCode::kBadFormat, {(dir / "config.json").string(), "model_type"}));
}

TEST(ModelConfig, WrongTypesNameFileAndField) {
  TempDir dir;
  const std::vector<std::pair<std::string, nlohmann::json>> cases = {
      {"hidden_size", "64"},      {"hidden_size", 64.5},
      {"vocab_size", true},       {"num_hidden_layers", {1, 2}},
      {"rms_norm_eps", "1e-6"},   {"tie_word_embeddings", "yes"},
      {"tie_word_embeddings", 1}, {"num_key_value_heads", 2.5},
      {"rope_theta", "big"},      {"max_position_embeddings", "4k"},
  };
  for (const auto& [key, value] : cases) {
    nlohmann::json config = base_config();
    config[key] = value;
    EXPECT_TRUE(throws_error([&] { load(dir, config); }, ErrorCode::kBadFormat, {(dir / "config.json").string(), key}))
        << key << " = " << value.dump();
  }
  // An integral float is accepted as an integer.
  nlohmann::json config = base_config();
  config["hidden_size"] = 64.0;
  EXPECT_EQ(load(dir, config).hidden_size, 64);
}

// A wrong type anywhere in config.json is a kBadFormat metrale::Error naming the file, not a
// nlohmann::json exception escaping to the caller.
TEST(ModelConfig, WrongTypesOfStringAndRopeFields) {
  TempDir dir;
  const std::vector<std::pair<std::string, nlohmann::json>> cases = {
      {"model_type", 5},
      {"rope_scaling", {{"rope_type", 3}, {"factor", 2.0}}},
      {"rope_scaling", {{"rope_type", "yarn"}, {"factor", "two"}}},
  };
  for (const auto& [key, value] : cases) {
    nlohmann::json config = base_config();
    config[key] = value;
    EXPECT_TRUE(throws_error([&] { load(dir, config); }, ErrorCode::kBadFormat, {(dir / "config.json").string()}))
        << key << " = " << value.dump();
  }
}

TEST(ModelConfig, NonPositiveSizesAreRejected) {
  TempDir dir;
  for (const char* key :
       {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"}) {
    for (const int value : {0, -4}) {
      nlohmann::json config = base_config();
      config[key] = value;
      EXPECT_TRUE(throws_error([&] { load(dir, config); }, ErrorCode::kBadFormat,
                               {(dir / "config.json").string(), key, "positive"}))
          << key << " = " << value;
    }
  }
  nlohmann::json config = base_config();
  config["num_key_value_heads"] = 3;  // 8 heads are not a multiple of 3
  EXPECT_TRUE(throws_error([&] { load(dir, config); }, ErrorCode::kBadFormat, {"multiple"}));
}

// Sizes that would overflow the engine's size arithmetic (a max_position_embeddings of 2^62 used to
// wrap the planner's block count and crash), and values no model has.
TEST(ModelConfig, SizesBeyondTheirRangesAreRejected) {
  TempDir dir;
  const std::vector<std::pair<const char*, nlohmann::json>> cases = {
      {"max_position_embeddings", int64_t{1} << 62},
      {"max_position_embeddings", (int64_t{1} << 28) + 1},
      {"vocab_size", int64_t{1} << 40},
      {"hidden_size", int64_t{1} << 40},
      {"num_hidden_layers", 100000},
      {"head_dim", int64_t{1} << 20},
      {"intermediate_size", -1},
      {"intermediate_size", int64_t{1} << 40},
  };
  for (const auto& [key, value] : cases) {
    nlohmann::json config = base_config();
    config[key] = value;
    EXPECT_TRUE(throws_error([&] { load(dir, config); }, ErrorCode::kBadFormat, {(dir / "config.json").string(), key}))
        << key << " = " << value;
  }
  const std::vector<std::pair<nlohmann::json, std::string>> others = {
      {{{"rms_norm_eps", 0}}, "rms_norm_eps"},
      {{{"rms_norm_eps", -1e-6}}, "rms_norm_eps"},
      {{{"rope_theta", -5}}, "rope_theta"},
      {{{"partial_rotary_factor", 1.5}}, "partial_rotary_factor"},
      {{{"rope_scaling", {{"rope_type", "linear"}, {"factor", 0}}}}, "factor"},
      {{{"eos_token_id", -3}}, "eos_token_id"},
      {{{"eos_token_id", {1, int64_t{1} << 40}}}, "eos_token_id"},
      {{{"bos_token_id", -1}}, "bos_token_id"},
  };
  for (const auto& [patch, fragment] : others) {
    nlohmann::json config = base_config();
    config.update(patch);
    EXPECT_TRUE(throws_error([&] { load(dir, config); }, ErrorCode::kBadFormat, {fragment})) << patch.dump();
  }
  nlohmann::json config = base_config();
  config["max_position_embeddings"] = int64_t{1} << 28;
  EXPECT_EQ(load(dir, config).max_position_embeddings, int64_t{1} << 28);
}

TEST(ModelConfig, DeeplyNestedJsonIsBadFormatNotACrash) {
  TempDir dir;
  write_bytes(dir / "config.json", std::string(200000, '[') + std::string(200000, ']'));
  EXPECT_TRUE(throws_error([&] { load_model_config(dir.path()); }, ErrorCode::kBadFormat, {"nested deeper than 64"}));
  // A huge value of the wrong type is named without being printed whole.
  nlohmann::json config = base_config();
  config["hidden_size"] = std::vector<int>(100000, 7);
  try {
    load(dir, config);
    ADD_FAILURE() << "a list as hidden_size was accepted";
  } catch (const Error& e) {
    EXPECT_LT(std::string(e.what()).size(), 400u) << e.what();
  }
}

TEST(ModelConfig, TypedGetters) {
  nlohmann::json config = base_config();
  config["layer_types"] = {"full_attention", "sliding_attention", "full_attention"};
  config["mlp_only_layers"] = {0, 2};
  config["bad_list"] = {1, "x"};
  config["not_list"] = 3;
  config["name"] = "tiny";
  const ModelConfig c = parse_model_config(config, "/virtual/config.json");
  EXPECT_EQ(c.get_string_list("layer_types").size(), 3u);
  EXPECT_EQ(c.get_int_list("mlp_only_layers"), (std::vector<int64_t>{0, 2}));
  EXPECT_TRUE(c.get_int_list("absent").empty());
  EXPECT_EQ(c.get_string("name", ""), "tiny");
  EXPECT_EQ(c.get_string("absent", "fallback"), "fallback");
  EXPECT_EQ(c.get_int("absent", 17), 17);
  EXPECT_DOUBLE_EQ(c.get_double("rms_norm_eps", 0.0), 1e-5);
  EXPECT_TRUE(c.get_bool("tie_word_embeddings", false));
  EXPECT_TRUE(
      throws_error([&] { c.get_int_list("bad_list"); }, ErrorCode::kBadFormat, {"/virtual/config.json", "'bad_list'"}));
  EXPECT_TRUE(throws_error([&] { c.get_int_list("not_list"); }, ErrorCode::kBadFormat, {"'not_list'"}));
  EXPECT_TRUE(
      throws_error([&] { c.get_string_list("mlp_only_layers"); }, ErrorCode::kBadFormat, {"'mlp_only_layers'"}));
  EXPECT_TRUE(throws_error([&] { c.get_string("hidden_size", ""); }, ErrorCode::kBadFormat, {"'hidden_size'"}));
  EXPECT_TRUE(throws_error([&] { c.get_int("absent"); }, ErrorCode::kBadFormat, {"'absent'", "missing"}));
}

}  // namespace
}  // namespace metrale
