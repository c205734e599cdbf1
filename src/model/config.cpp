#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>

#include "core/error.h"
#include "core/json_depth.h"
#include "core/strings.h"

namespace metrale {
namespace {

// config.json nests a few levels (rope_parameters, quantization_config, text_config); deeper text
// is not a config, and the recursive copies below must not meet it.
constexpr size_t kMaxConfigDepth = 64;

nlohmann::json read_json(const std::filesystem::path& path) {
  const std::string text = read_file(path);
  if (json_nests_deeper_than(text, kMaxConfigDepth))
    raise(ErrorCode::kBadFormat, "{}: invalid JSON: nested deeper than {}", path.string(), kMaxConfigDepth);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    raise(ErrorCode::kBadFormat, "{}: invalid JSON: {}", path.string(), e.what());
  }
}

// eos_token_id may be an int, a list of ints, or null.
void append_ids(const nlohmann::json& value, std::vector<int64_t>& ids) {
  auto add = [&](int64_t id) {
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  };
  if (value.is_number_integer()) add(value.get<int64_t>());
  if (value.is_array())
    for (const auto& item : value)
      if (item.is_number_integer()) add(item.get<int64_t>());
}

// A value for an error message: its JSON text, cut short (a wrong value may be a huge list).
std::string brief(const nlohmann::json& value) {
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

// The ranges of the sizes the engine computes with. Every product of them that the engine forms
// (vocab x hidden, heads x head_dim, blocks of max_position_embeddings) fits an int64 with room,
// and positions fit the int32 arrays of a step.
struct IntRange {
  const char* field;
  int64_t lo, hi;
};
constexpr int64_t kMaxPositions = int64_t{1} << 28;  // 268M tokens; positions are int32 on the device
constexpr IntRange kRanges[] = {
    {"vocab_size", 1, std::numeric_limits<int32_t>::max()},
    {"hidden_size", 1, int64_t{1} << 20},
    {"num_hidden_layers", 1, 4096},
    {"num_attention_heads", 1, int64_t{1} << 16},
    {"num_key_value_heads", 1, int64_t{1} << 16},
    {"head_dim", 1, int64_t{1} << 16},
    {"intermediate_size", 0, int64_t{1} << 24},
    {"max_position_embeddings", 1, kMaxPositions},
};

void check_ranges(const ModelConfig& config) {
  const int64_t values[] = {config.vocab_size, config.hidden_size, config.num_layers, config.num_heads,
                            config.num_kv_heads, config.head_dim, config.intermediate_size,
                            config.max_position_embeddings};
  static_assert(std::size(values) == std::size(kRanges));
  for (size_t i = 0; i < std::size(kRanges); ++i) {
    const IntRange& range = kRanges[i];
    if (values[i] < range.lo || values[i] > range.hi) {
      if (range.lo == 1 && values[i] <= 0)
        raise(ErrorCode::kBadFormat, "{}: field '{}' must be positive, got {}", config.source.string(), range.field, values[i]);
      raise(ErrorCode::kBadFormat, "{}: field '{}' must be in [{}, {}], got {}", config.source.string(), range.field,
            range.lo, range.hi, values[i]);
    }
  }
  const auto check_double = [&](const char* field, double value, bool ok, const char* range) {
    if (!std::isfinite(value) || !ok)
      raise(ErrorCode::kBadFormat, "{}: {} must be {}, got {}", config.source.string(), field, range, value);
  };
  check_double("rms_norm_eps", config.rms_norm_eps, config.rms_norm_eps > 0 && config.rms_norm_eps < 1, "in (0, 1)");
  check_double("rope_theta", config.rope.theta, config.rope.theta > 0, "positive");
  check_double("partial_rotary_factor", config.rope.partial_rotary_factor,
               config.rope.partial_rotary_factor > 0 && config.rope.partial_rotary_factor <= 1, "in (0, 1]");
  check_double("the rope scaling factor", config.rope.factor, config.rope.factor > 0, "positive");
  check_double("rope beta_fast", config.rope.beta_fast, true, "finite");
  check_double("rope beta_slow", config.rope.beta_slow, true, "finite");
  if (config.rope.attention_factor) check_double("rope attention_factor", *config.rope.attention_factor, true, "finite");
  if (config.rope.original_max_position_embeddings &&
      (*config.rope.original_max_position_embeddings < 1 || *config.rope.original_max_position_embeddings > kMaxPositions)) {
    raise(ErrorCode::kBadFormat, "{}: rope original_max_position_embeddings must be in [1, {}], got {}",
          config.source.string(), kMaxPositions, *config.rope.original_max_position_embeddings);
  }
  const auto check_id = [&](const char* field, int64_t id) {
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      raise(ErrorCode::kBadFormat, "{}: {} {} is not a token id", config.source.string(), field, id);
  };
  for (const int64_t id : config.eos_token_ids) check_id("eos_token_id", id);
  if (config.bos_token_id) check_id("bos_token_id", *config.bos_token_id);
}

}  // namespace

bool ModelConfig::has(const std::string& key) const { return text.contains(key) && !text.at(key).is_null(); }

int64_t ModelConfig::get_int(const std::string& key) const {
  if (!has(key)) raise(ErrorCode::kBadFormat, "{}: missing required field '{}'", source.string(), key);
  return get_int(key, 0);
}

int64_t ModelConfig::get_int(const std::string& key, int64_t fallback) const {
  if (!has(key)) return fallback;
  const auto& value = text.at(key);
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) {
    const double number = value.get<double>();
    if (number >= -9.2e18 && number <= 9.2e18 && number == std::floor(number)) return static_cast<int64_t>(number);
  }
  raise(ErrorCode::kBadFormat, "{}: field '{}' must be an integer, got {}", source.string(), key, brief(value));
}

double ModelConfig::get_double(const std::string& key, double fallback) const {
  if (!has(key)) return fallback;
  const auto& value = text.at(key);
  if (!value.is_number()) raise(ErrorCode::kBadFormat, "{}: field '{}' must be a number, got {}", source.string(), key, brief(value));
  return value.get<double>();
}

bool ModelConfig::get_bool(const std::string& key, bool fallback) const {
  if (!has(key)) return fallback;
  const auto& value = text.at(key);
  if (!value.is_boolean()) raise(ErrorCode::kBadFormat, "{}: field '{}' must be true or false, got {}", source.string(), key, brief(value));
  return value.get<bool>();
}

std::string ModelConfig::get_string(const std::string& key, const std::string& fallback) const {
  if (!has(key)) return fallback;
  const auto& value = text.at(key);
  if (!value.is_string()) raise(ErrorCode::kBadFormat, "{}: field '{}' must be a string, got {}", source.string(), key, brief(value));
  return value.get<std::string>();
}

std::vector<int64_t> ModelConfig::get_int_list(const std::string& key) const {
  std::vector<int64_t> values;
  if (!has(key)) return values;
  const auto& value = text.at(key);
  if (!value.is_array()) raise(ErrorCode::kBadFormat, "{}: field '{}' must be a list of integers", source.string(), key);
  for (const auto& item : value) {
    if (!item.is_number_integer()) raise(ErrorCode::kBadFormat, "{}: field '{}' must be a list of integers", source.string(), key);
    values.push_back(item.get<int64_t>());
  }
  return values;
}

std::vector<std::string> ModelConfig::get_string_list(const std::string& key) const {
  std::vector<std::string> values;
  if (!has(key)) return values;
  const auto& value = text.at(key);
  if (!value.is_array()) raise(ErrorCode::kBadFormat, "{}: field '{}' must be a list of strings", source.string(), key);
  for (const auto& item : value) {
    if (!item.is_string()) raise(ErrorCode::kBadFormat, "{}: field '{}' must be a list of strings", source.string(), key);
    values.push_back(item.get<std::string>());
  }
  return values;
}

ModelConfig parse_model_config(const nlohmann::json& config, const std::filesystem::path& source) {
  if (!config.is_object()) raise(ErrorCode::kBadFormat, "{}: expected a JSON object", source.string());
  ModelConfig result;
  result.source = source;
  if (config.contains("model_type") && !config["model_type"].is_string()) {
    raise(ErrorCode::kBadFormat, "{}: field 'model_type' must be a string, got {}", source.string(), brief(config["model_type"]));
  }
  result.outer_model_type = config.value("model_type", std::string());
  if (config.contains("text_config") && config["text_config"].is_object()) {
    result.text = config["text_config"];
    // Fields that composite configs keep at the top level.
    for (const char* key :
         {"tie_word_embeddings", "eos_token_id", "bos_token_id", "dtype", "torch_dtype", "quantization_config"}) {
      if (!result.text.contains(key) && config.contains(key)) result.text[key] = config[key];
    }
  } else {
    result.text = config;
  }
  result.model_type = result.get_string("model_type", result.outer_model_type);
  if (result.model_type.empty()) raise(ErrorCode::kBadFormat, "{}: no model_type", source.string());

  result.vocab_size = result.get_int("vocab_size");
  result.hidden_size = result.get_int("hidden_size");
  result.num_layers = result.get_int("num_hidden_layers");
  result.num_heads = result.get_int("num_attention_heads");
  result.num_kv_heads = result.get_int("num_key_value_heads", result.num_heads);
  if (result.has("qk_nope_head_dim") || result.has("qk_rope_head_dim") || result.has("kv_lora_rank")) {
    // MLA models: the attention head is the query's nope + rope parts; head_dim, when present, is
    // not the head width (glm5_next forces it to 0, glm_moe_dsa to the rope dim). Their builders
    // read the MLA fields themselves.
    result.head_dim = result.get_int("qk_nope_head_dim", 0) + result.get_int("qk_rope_head_dim", 0);
    if (result.head_dim <= 0 && result.num_heads > 0) result.head_dim = result.hidden_size / result.num_heads;
  } else {
    result.head_dim = result.get_int("head_dim", result.num_heads > 0 ? result.hidden_size / result.num_heads : 0);
  }
  result.intermediate_size = result.get_int("intermediate_size", 0);
  result.rms_norm_eps = result.get_double("rms_norm_eps", 1e-6);
  result.tie_word_embeddings = result.get_bool("tie_word_embeddings", false);
  result.max_position_embeddings = result.get_int("max_position_embeddings", 32768);
  result.dtype = result.get_string("dtype", result.get_string("torch_dtype", "bfloat16"));
  if (result.has("bos_token_id")) result.bos_token_id = result.get_int("bos_token_id");
  append_ids(result.text.value("eos_token_id", nlohmann::json()), result.eos_token_ids);

  for (const auto& [name, value] : std::initializer_list<std::pair<const char*, int64_t>>{
           {"vocab_size", result.vocab_size}, {"hidden_size", result.hidden_size},
           {"num_hidden_layers", result.num_layers}, {"num_attention_heads", result.num_heads},
           {"num_key_value_heads", result.num_kv_heads}, {"head_dim", result.head_dim}}) {
    if (value <= 0) raise(ErrorCode::kBadFormat, "{}: field '{}' must be positive, got {}", source.string(), name, value);
  }
  if (result.num_heads % result.num_kv_heads != 0) {
    raise(ErrorCode::kBadFormat, "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
          source.string(), result.num_heads, result.num_kv_heads);
  }

  // RoPE: rope_scaling (legacy) replaces rope_parameters; top-level rope_theta and
  // partial_rotary_factor fill what is missing (transformers' convert_rope_params_to_dict).
  nlohmann::json rope = nlohmann::json::object();
  if (result.has("rope_parameters") && result.text["rope_parameters"].is_object()) rope = result.text["rope_parameters"];
  if (result.has("rope_scaling") && result.text["rope_scaling"].is_object()) rope = result.text["rope_scaling"];
  if (!rope.contains("rope_theta") && result.has("rope_theta")) rope["rope_theta"] = result.text["rope_theta"];
  if (!rope.contains("partial_rotary_factor") && result.has("partial_rotary_factor"))
    rope["partial_rotary_factor"] = result.text["partial_rotary_factor"];
  auto number = [&](const char* key, double fallback) {
    if (!rope.contains(key) || rope[key].is_null()) return fallback;
    if (!rope[key].is_number()) raise(ErrorCode::kBadFormat, "{}: rope field '{}' must be a number", source.string(), key);
    return rope[key].get<double>();
  };
  for (const char* key : {"rope_type", "type"}) {
    if (rope.contains(key) && !rope[key].is_string())
      raise(ErrorCode::kBadFormat, "{}: rope field '{}' must be a string, got {}", source.string(), key, brief(rope[key]));
  }
  result.rope.type = rope.value("rope_type", rope.value("type", std::string("default")));
  result.rope.theta = number("rope_theta", 10000.0);
  result.rope.partial_rotary_factor = number("partial_rotary_factor", 1.0);
  result.rope.factor = number("factor", 1.0);
  result.rope.beta_fast = number("beta_fast", 32.0);
  result.rope.beta_slow = number("beta_slow", 1.0);
  if (rope.contains("attention_factor") && rope["attention_factor"].is_number())
    result.rope.attention_factor = rope["attention_factor"].get<double>();
  if (rope.contains("original_max_position_embeddings") && rope["original_max_position_embeddings"].is_number_integer())
    result.rope.original_max_position_embeddings = rope["original_max_position_embeddings"].get<int64_t>();
  if (rope.contains("truncate") && rope["truncate"].is_boolean()) result.rope.truncate = rope["truncate"].get<bool>();
  check_ranges(result);
  return result;
}

ModelConfig load_model_config(const std::filesystem::path& dir) {
  const auto config_path = dir / "config.json";
  if (!std::filesystem::exists(config_path)) {
    raise(ErrorCode::kNotFound, "{}: no config.json (is this a Hugging Face model directory?)", dir.string());
  }
  ModelConfig config = parse_model_config(read_json(config_path), config_path);
  const auto generation_path = dir / "generation_config.json";
  if (std::filesystem::exists(generation_path)) {
    const nlohmann::json generation = read_json(generation_path);
    if (generation.is_object() && generation.contains("eos_token_id")) {
      append_ids(generation["eos_token_id"], config.eos_token_ids);
    }
  }
  return config;
}

}  // namespace metrale
