#include "model/hand_built_helpers.h"

#include <string>

#include "model/blocks/attention.h"
#include "model/blocks/decoder.h"
#include "model/blocks/mlp.h"
#include "model/config.h"
#include "model/weight_store.h"

namespace metrale::testing {

std::unique_ptr<Model> build_qwen3_by_hand(const std::filesystem::path& dir, const HandBuiltOptions& options) {
  const ModelConfig config = load_model_config(dir);
  METRALE_CHECK(config.model_type == "qwen3", "hand-built models are qwen3, not {}", config.model_type);
  Weights weights(std::make_shared<const WeightStore>(dir), Device::cpu());
  auto rope = std::make_shared<const RotaryEmbedding>(config.rope, config.head_dim, config.max_position_embeddings,
                                                      weights.device(), config.head_dim);
  AttentionConfig attention;
  attention.hidden_size = config.hidden_size;
  attention.num_heads = config.num_heads;
  attention.num_kv_heads = config.num_kv_heads;
  attention.head_dim = config.head_dim;
  attention.rms_norm_eps = config.rms_norm_eps;
  const auto norm = kernels::RmsNormKind::kPlain;
  DecoderParts parts;
  parts.embed_tokens = load_embedding(weights, config);
  std::vector<RmsNorm> site_norms;
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const std::string prefix = "layers." + std::to_string(i) + ".";
    site_norms.push_back(
        RmsNorm::load(weights, prefix + "input_layernorm.weight", config.hidden_size, config.rms_norm_eps, norm));
    site_norms.push_back(RmsNorm::load(weights, prefix + "post_attention_layernorm.weight", config.hidden_size,
                                       config.rms_norm_eps, norm));
    DecoderLayer layer{std::make_unique<Attention>(attention, weights, prefix + "self_attn.", rope),
                       std::make_unique<Mlp>(weights, prefix + "mlp.", config.hidden_size, config.intermediate_size)};
    if (options.stream_blocks) layer.stream_blocks = options.stream_blocks(i);
    parts.layers.push_back(std::move(layer));
  }
  auto pre_norm = std::make_unique<PreNormResidual>(
      std::move(site_norms), RmsNorm::load(weights, "norm.weight", config.hidden_size, config.rms_norm_eps, norm));
  if (options.residual) {
    parts.residual = options.residual(std::move(pre_norm));
  } else {
    parts.residual = std::move(pre_norm);
  }
  parts.lm_head = load_lm_head(weights, config, parts.embed_tokens);
  return std::make_unique<DecoderModel>(config, weights, std::move(parts));
}

}  // namespace metrale::testing
