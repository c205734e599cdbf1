// ModelConfig: the typed view of a Hugging Face config.json that the engine needs. Architecture
// files read their own extra fields from `text` with the typed getters below, so a missing or
// mistyped field is reported with the key and the file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace metrale {

struct RopeConfig {
  std::string type = "default";  // "default", "linear", "yarn", "dynamic" (only default/linear/yarn supported)
  double theta = 10000.0;
  double partial_rotary_factor = 1.0;
  double factor = 1.0;                         // linear / yarn scaling factor
  double beta_fast = 32.0, beta_slow = 1.0;    // yarn
  std::optional<double> attention_factor;      // yarn: overrides 0.1 ln(factor) + 1
  std::optional<int64_t> original_max_position_embeddings;
  bool truncate = true;                        // yarn
};

struct ModelConfig {
  std::filesystem::path source;  // the config.json this came from (for error messages)
  std::string model_type;        // of the text model ("qwen3", "qwen3_5_text", ...)
  std::string outer_model_type;  // of the top-level config ("qwen3_5" for composite configs)
  nlohmann::json text;           // the text config (text_config of composite configs, else the whole file)

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  RopeConfig rope;
  std::vector<int64_t> eos_token_ids;  // config.json and generation_config.json merged, in order
  std::optional<int64_t> bos_token_id;
  std::string dtype = "bfloat16";     // "dtype" / "torch_dtype" of the checkpoint

  // Typed getters on `text`: throw kBadFormat naming the key and file when the type is wrong, and
  // (for the required forms) kBadFormat when the key is missing.
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_double(const std::string& key, double fallback) const;
  bool get_bool(const std::string& key, bool fallback) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  std::vector<int64_t> get_int_list(const std::string& key) const;  // missing or null -> empty
  std::vector<std::string> get_string_list(const std::string& key) const;
  bool has(const std::string& key) const;
};

// Reads <dir>/config.json (plain, or composite with text_config) and <dir>/generation_config.json
// when present. Throws kNotFound / kBadFormat with the path on error.
ModelConfig load_model_config(const std::filesystem::path& dir);
ModelConfig parse_model_config(const nlohmann::json& config, const std::filesystem::path& source);

}  // namespace metrale
