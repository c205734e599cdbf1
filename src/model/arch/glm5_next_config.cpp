// glm5_next's config fields and schedules, as Glm5NextTextConfig.__post_init__ derives them
// (glm_deepseek.md §2.1).
#include <cmath>

#include "core/error.h"
#include "model/arch/glm5_next.h"

namespace metrale::arch {
namespace {

std::vector<Glm5NextMixer> parse_layer_types(const ModelConfig& config, int64_t layers) {
  std::vector<Glm5NextMixer> mixers(static_cast<size_t>(layers));
  const std::vector<std::string> types = config.get_string_list("layer_types");
  if (types.empty()) {
    for (int64_t i = 0; i < layers; ++i) {
      mixers[static_cast<size_t>(i)] = i % 4 == 3 ? Glm5NextMixer::kDsa : Glm5NextMixer::kKda;
    }
    return mixers;
  }
  if (static_cast<int64_t>(types.size()) != layers) {
    raise(ErrorCode::kBadFormat, "{}: layer_types has {} entries for {} layers", config.source.string(), types.size(),
          layers);
  }
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] == "linear_attention") {
      mixers[i] = Glm5NextMixer::kKda;
    } else if (types[i] == "deepseek_sparse_attention" || types[i] == "full_attention") {
      mixers[i] = Glm5NextMixer::kDsa;  // the reference renames full_attention to DSA
    } else {
      raise(ErrorCode::kUnsupported, "{}: layer type '{}' of layer {} is not a glm5_next layer type",
            config.source.string(), types[i], i);
    }
  }
  return mixers;
}

std::vector<bool> parse_mlp_types(const ModelConfig& config, int64_t layers) {
  std::vector<bool> moe(static_cast<size_t>(layers));
  const std::vector<std::string> types = config.get_string_list("mlp_layer_types");
  if (types.empty()) {
    for (int64_t i = 0; i < layers; ++i) moe[static_cast<size_t>(i)] = i >= 3;  // the first min(3, L) are dense
    return moe;
  }
  if (static_cast<int64_t>(types.size()) != layers) {
    raise(ErrorCode::kBadFormat, "{}: mlp_layer_types has {} entries for {} layers", config.source.string(),
          types.size(), layers);
  }
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] != "dense" && types[i] != "sparse") {
      raise(ErrorCode::kBadFormat, "{}: mlp_layer_types[{}] is '{}', expected 'dense' or 'sparse'",
            config.source.string(), i, types[i]);
    }
    moe[i] = types[i] == "sparse";
  }
  return moe;
}

// true for "shared" layers: from indexer_types (a saved config), else index_topk_pattern (a string
// of F / S or a list), else the index_topk_freq / index_skip_topk_offset rule.
std::vector<bool> parse_indexer_types(const ModelConfig& config, int64_t layers) {
  std::vector<std::string> types;
  if (config.has("indexer_types")) {
    types = config.get_string_list("indexer_types");
  } else if (config.has("index_topk_pattern")) {
    if (config.text["index_topk_pattern"].is_string()) {
      for (const char letter : config.text["index_topk_pattern"].get<std::string>()) {
        if (letter != 'F' && letter != 'S') {
          raise(ErrorCode::kBadFormat, "{}: index_topk_pattern holds '{}'; only F (full) and S (shared) are allowed",
                config.source.string(), std::string(1, letter));
        }
        types.emplace_back(letter == 'F' ? "full" : "shared");
      }
    } else {
      types = config.get_string_list("index_topk_pattern");
    }
  } else {
    const int64_t freq = std::max<int64_t>(config.get_int("index_topk_freq", 1), 1);
    const int64_t offset = config.get_int("index_skip_topk_offset", 2);
    for (int64_t i = 0; i < layers; ++i) {
      types.emplace_back(std::max<int64_t>(i - offset + 1, 0) % freq == 0 ? "full" : "shared");
    }
  }
  if (static_cast<int64_t>(types.size()) != layers) {
    raise(ErrorCode::kBadFormat, "{}: the indexer types have {} entries for {} layers", config.source.string(),
          types.size(), layers);
  }
  std::vector<bool> shared(static_cast<size_t>(layers));
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] != "full" && types[i] != "shared") {
      raise(ErrorCode::kBadFormat, "{}: indexer type '{}' of layer {}, expected 'full' or 'shared'",
            config.source.string(), types[i], i);
    }
    shared[i] = types[i] == "shared";
  }
  return shared;
}

void require_positive(const ModelConfig& config, const char* field, int64_t value) {
  if (value <= 0) raise(ErrorCode::kBadFormat, "{}: {} must be positive, got {}", config.source.string(), field, value);
}

// The KDA fields: linear_* and the linear_attn_config override (§2.1).
void parse_linear_attention(const ModelConfig& config, Glm5NextConfig& c) {
  const std::string& src = config.source.string();
  c.linear_num_heads = config.get_int("linear_num_heads", 64);
  c.linear_head_dim = config.get_int("linear_head_dim", 128);
  c.linear_conv_kernel = config.get_int("linear_conv_kernel_dim", 4);
  const auto read_bound = [&](const nlohmann::json& object, const char* key) -> std::optional<double> {
    const nlohmann::json& value = object[key];
    if (value.is_null()) return std::nullopt;
    if (!value.is_number()) raise(ErrorCode::kBadFormat, "{}: {} must be a number or null", src, key);
    return value.get<double>();
  };
  if (config.text.contains("linear_lower_bound")) c.linear_lower_bound = read_bound(config.text, "linear_lower_bound");
  if (config.has("linear_attn_config")) {
    const nlohmann::json& linear = config.text["linear_attn_config"];
    if (!linear.is_object()) raise(ErrorCode::kBadFormat, "{}: linear_attn_config must be an object", src);
    const auto read_int = [&](const char* key, int64_t& field) {
      if (!linear.contains(key) || linear[key].is_null()) return;
      if (!linear[key].is_number_integer()) {
        raise(ErrorCode::kBadFormat, "{}: linear_attn_config.{} must be an integer", src, key);
      }
      field = linear[key].get<int64_t>();
    };
    read_int("head_dim", c.linear_head_dim);
    read_int("num_heads", c.linear_num_heads);
    read_int("short_conv_kernel_size", c.linear_conv_kernel);
    if (linear.contains("gate_lower_bound")) c.linear_lower_bound = read_bound(linear, "gate_lower_bound");
    const bool safe_gate = !linear.contains("safe_gate") || linear["safe_gate"].is_null() ||
                           (linear["safe_gate"].is_boolean() && linear["safe_gate"].get<bool>());
    if (safe_gate && !c.linear_lower_bound) c.linear_lower_bound = -5.0;
  }
  if (c.linear_lower_bound && !(*c.linear_lower_bound < 0 && std::isfinite(*c.linear_lower_bound))) {
    raise(ErrorCode::kBadFormat, "{}: linear_lower_bound must be negative, got {}", src, *c.linear_lower_bound);
  }
}

}  // namespace

Glm5NextConfig parse_glm5_next_config(const ModelConfig& config) {
  Glm5NextConfig c;
  const std::string& src = config.source.string();
  c.vocab_size = config.vocab_size;
  c.hidden_size = config.hidden_size;
  c.num_layers = config.num_layers;
  c.rms_norm_eps = config.get_double("rms_norm_eps", 1e-5);
  c.tie_word_embeddings = config.get_bool("tie_word_embeddings", false);
  const std::string act = config.get_string("hidden_act", "silu");
  if (act != "silu") raise(ErrorCode::kUnsupported, "{}: hidden_act '{}' is not supported (silu is)", src, act);

  c.intermediate_size = config.get_int("intermediate_size", 12288);
  c.moe_intermediate_size = config.get_int("moe_intermediate_size", 2048);
  c.num_experts = config.get_int("n_routed_experts", config.get_int("num_local_experts", 288));
  c.top_k = config.get_int("num_experts_per_tok", 8);
  c.num_shared_experts = config.get_int("n_shared_experts", 1);
  c.routed_scaling_factor = config.get_double("routed_scaling_factor", 2.5);
  c.norm_topk_prob = config.get_bool("norm_topk_prob", true);
  c.n_group = config.get_int("n_group", 1);
  c.topk_group = config.get_int("topk_group", 1);
  c.swiglu_limit = config.get_double("swiglu_limit", 10.0);

  c.num_heads = config.num_heads;
  if (config.num_kv_heads != config.num_heads) {
    raise(ErrorCode::kBadFormat, "{}: num_key_value_heads {} must equal num_attention_heads {}", src,
          config.num_kv_heads, config.num_heads);
  }
  if (!config.has("q_lora_rank") && config.text.contains("q_lora_rank")) {
    raise(ErrorCode::kBadFormat, "{}: q_lora_rank must be set (glm5_next has no direct q_proj)", src);
  }
  c.q_lora_rank = config.get_int("q_lora_rank", 1536);
  c.kv_lora_rank = config.get_int("kv_lora_rank", 512);
  c.qk_nope_head_dim = config.get_int("qk_nope_head_dim", 256);
  c.v_head_dim = config.get_int("v_head_dim", 256);
  if (const int64_t rope = config.get_int("qk_rope_head_dim", 0); rope != 0) {
    raise(ErrorCode::kUnsupported, "{}: qk_rope_head_dim must be 0 (glm5_next is NoPE), got {}", src, rope);
  }
  c.index_n_heads = config.get_int("index_n_heads", 32);
  c.index_head_dim = config.get_int("index_head_dim", 128);
  c.index_topk = config.get_int("index_topk", 2048);
  c.index_kpool = config.get_int("index_kpool", 16);
  if (!config.get_bool("index_kpool_always_select_tail", true)) {
    raise(ErrorCode::kUnsupported, "{}: index_kpool_always_select_tail false is not supported", src);
  }

  parse_linear_attention(config, c);

  c.hc_mult = config.get_int("hc_mult", 4);
  c.hc_sinkhorn_iters = config.get_int("hc_sinkhorn_iters", 20);
  c.hc_eps = config.get_double("hc_eps", 1e-6);

  for (const auto& [field, value] : std::initializer_list<std::pair<const char*, int64_t>>{
           {"moe_intermediate_size", c.moe_intermediate_size}, {"n_routed_experts", c.num_experts},
           {"num_experts_per_tok", c.top_k}, {"q_lora_rank", c.q_lora_rank}, {"kv_lora_rank", c.kv_lora_rank},
           {"qk_nope_head_dim", c.qk_nope_head_dim}, {"v_head_dim", c.v_head_dim}, {"index_n_heads", c.index_n_heads},
           {"index_head_dim", c.index_head_dim}, {"index_topk", c.index_topk}, {"index_kpool", c.index_kpool},
           {"linear_num_heads", c.linear_num_heads}, {"linear_head_dim", c.linear_head_dim},
           {"linear_conv_kernel_dim", c.linear_conv_kernel}, {"hc_mult", c.hc_mult},
           {"hc_sinkhorn_iters", c.hc_sinkhorn_iters}, {"n_group", c.n_group}, {"topk_group", c.topk_group}}) {
    require_positive(config, field, value);
  }
  if (c.index_topk % c.index_kpool != 0) {
    raise(ErrorCode::kBadFormat, "{}: index_topk {} must be a multiple of index_kpool {}", src, c.index_topk,
          c.index_kpool);
  }
  if (c.top_k > c.num_experts) {
    raise(ErrorCode::kBadFormat, "{}: num_experts_per_tok {} exceeds n_routed_experts {}", src, c.top_k, c.num_experts);
  }
  if (c.num_experts % c.n_group != 0 || c.topk_group > c.n_group) {
    raise(ErrorCode::kBadFormat, "{}: n_group {} must divide n_routed_experts {} and be >= topk_group {}", src,
          c.n_group, c.num_experts, c.topk_group);
  }
  if (c.num_shared_experts < 0 || c.swiglu_limit < 0 || c.hc_eps <= 0) {
    raise(ErrorCode::kBadFormat, "{}: n_shared_experts, swiglu_limit and hc_eps must not be negative", src);
  }

  c.mixers = parse_layer_types(config, c.num_layers);
  c.moe = parse_mlp_types(config, c.num_layers);
  c.shared_indexer = parse_indexer_types(config, c.num_layers);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const auto at = static_cast<size_t>(i);
    if (c.mixers[at] != Glm5NextMixer::kDsa) {
      c.shared_indexer[at] = false;  // KDA layers have no indexer
      continue;
    }
    if (c.shared_indexer[at] && (i == 0 || c.mixers[at - 1] != Glm5NextMixer::kDsa)) {
      raise(ErrorCode::kBadFormat,
            "{}: layer {} has a shared indexer but layer {} is not a DSA layer whose selection it could reuse", src, i,
            i - 1);
    }
  }
  c.num_mtp_layers = config.get_int("num_nextn_predict_layers", 0);
  return c;
}

}  // namespace metrale::arch
