// Qwen3 dense (model_type "qwen3"): GQA attention with per-head q/k RMSNorm and full RoPE, SwiGLU
// MLP, plain RMSNorms in a pre-norm residual, tied or untied LM head. Optional sliding-window layers from layer_types.
#include "core/error.h"
#include "model/arch/architectures.h"
#include "model/blocks/attention.h"
#include "model/blocks/decoder.h"
#include "model/blocks/mlp.h"
#include "model/blocks/pre_norm.h"

namespace metrale::arch {

std::vector<int> qwen3_sliding_windows(const ModelConfig& config) {
  std::vector<int> windows(static_cast<size_t>(config.num_layers), 0);
  const bool sliding = config.get_bool("use_sliding_window", false);
  const int window = static_cast<int>(config.get_int("sliding_window", 0));
  std::vector<std::string> types = config.get_string_list("layer_types");
  if (!types.empty() && static_cast<int64_t>(types.size()) != config.num_layers) {
    raise(ErrorCode::kBadFormat, "{}: layer_types has {} entries for {} layers", config.source.string(), types.size(),
          config.num_layers);
  }
  const int64_t max_window_layers = config.get_int("max_window_layers", config.num_layers);
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const bool is_sliding = types.empty() ? (sliding && i >= max_window_layers)
                                          : types[static_cast<size_t>(i)] == "sliding_attention";
    if (!types.empty() && types[static_cast<size_t>(i)] != "sliding_attention" &&
        types[static_cast<size_t>(i)] != "full_attention") {
      raise(ErrorCode::kUnsupported, "{}: layer type '{}' is not supported by qwen3", config.source.string(),
            types[static_cast<size_t>(i)]);
    }
    if (is_sliding && sliding) {
      if (window <= 0) raise(ErrorCode::kBadFormat, "{}: sliding layers need a positive sliding_window", config.source.string());
      windows[static_cast<size_t>(i)] = window;
    }
  }
  return windows;
}

AttentionConfig qwen3_attention_config(const ModelConfig& config) {
  AttentionConfig attention;
  attention.hidden_size = config.hidden_size;
  attention.num_heads = config.num_heads;
  attention.num_kv_heads = config.num_kv_heads;
  attention.head_dim = config.head_dim;
  attention.rms_norm_eps = config.rms_norm_eps;
  attention.qk_norm = true;
  attention.norm_kind = kernels::RmsNormKind::kPlain;
  return attention;
}

std::unique_ptr<Model> build_qwen3(const ModelConfig& config, Weights& weights) {
  // Qwen3 rotates the whole head whatever partial_rotary_factor says.
  auto rope = std::make_shared<const RotaryEmbedding>(config.rope, config.head_dim, config.max_position_embeddings,
                                                      weights.device(), config.head_dim);
  const std::vector<int> windows = qwen3_sliding_windows(config);
  DecoderParts parts;
  parts.embed_tokens = load_embedding(weights, config);
  const auto norm = kernels::RmsNormKind::kPlain;
  std::vector<RmsNorm> site_norms;  // per layer: input_layernorm, post_attention_layernorm
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const std::string prefix = "layers." + std::to_string(i) + ".";
    AttentionConfig attention = qwen3_attention_config(config);
    attention.window = windows[static_cast<size_t>(i)];
    site_norms.push_back(
        RmsNorm::load(weights, prefix + "input_layernorm.weight", config.hidden_size, config.rms_norm_eps, norm));
    auto mixer = std::make_unique<Attention>(attention, weights, prefix + "self_attn.", rope);
    site_norms.push_back(RmsNorm::load(weights, prefix + "post_attention_layernorm.weight", config.hidden_size,
                                       config.rms_norm_eps, norm));
    auto ffn = std::make_unique<Mlp>(weights, prefix + "mlp.", config.hidden_size, config.intermediate_size);
    parts.layers.push_back(DecoderLayer{std::move(mixer), std::move(ffn)});
  }
  parts.residual = std::make_unique<PreNormResidual>(
      std::move(site_norms), RmsNorm::load(weights, "norm.weight", config.hidden_size, config.rms_norm_eps, norm));
  parts.lm_head = load_lm_head(weights, config, parts.embed_tokens);
  return std::make_unique<DecoderModel>(config, weights, std::move(parts));
}

}  // namespace metrale::arch
