// Qwen3-MoE (model_type "qwen3_moe"): Qwen3 attention; the FFN of layer i is a sparse MoE (softmax
// router, top-k, optional renormalisation, no shared expert) when i is not in mlp_only_layers and
// (i + 1) % decoder_sparse_step == 0, else a dense SwiGLU MLP of intermediate_size.
#include "core/error.h"
#include "model/arch/architectures.h"
#include "model/blocks/attention.h"
#include "model/blocks/decoder.h"
#include "model/blocks/mlp.h"
#include "model/blocks/moe.h"
#include "model/blocks/pre_norm.h"

#include <algorithm>

namespace metrale::arch {

std::unique_ptr<Model> build_qwen3_moe(const ModelConfig& config, Weights& weights) {
  auto rope = std::make_shared<const RotaryEmbedding>(config.rope, config.head_dim, config.max_position_embeddings,
                                                      weights.device(), config.head_dim);
  MoeConfig moe;
  moe.hidden_size = config.hidden_size;
  moe.num_experts = config.get_int("num_experts", config.get_int("num_local_experts", 128));
  moe.top_k = config.get_int("num_experts_per_tok", 8);
  moe.expert_intermediate_size = config.get_int("moe_intermediate_size", 768);
  moe.normalize_top_k = config.get_bool("norm_topk_prob", false);
  if (moe.top_k < 1 || moe.top_k > moe.num_experts) {
    raise(ErrorCode::kBadFormat, "{}: num_experts_per_tok {} must be in [1, num_experts = {}]", config.source.string(),
          moe.top_k, moe.num_experts);
  }
  const int64_t sparse_step = config.get_int("decoder_sparse_step", 1);
  const std::vector<int64_t> mlp_only = config.get_int_list("mlp_only_layers");
  const bool sliding = config.get_bool("use_sliding_window", false);
  const int window = sliding ? static_cast<int>(config.get_int("sliding_window", 0)) : 0;

  DecoderParts parts;
  parts.embed_tokens = load_embedding(weights, config);
  const auto norm = kernels::RmsNormKind::kPlain;
  std::vector<RmsNorm> site_norms;  // per layer: input_layernorm, post_attention_layernorm
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const std::string prefix = "layers." + std::to_string(i) + ".";
    AttentionConfig attention = qwen3_attention_config(config);
    attention.window = window;
    const bool is_moe = std::find(mlp_only.begin(), mlp_only.end(), i) == mlp_only.end() && moe.num_experts > 0 &&
                        sparse_step > 0 && (i + 1) % sparse_step == 0;
    // Load order (random weights draw in it): the FFN, input_layernorm, attention,
    // post_attention_layernorm.
    std::unique_ptr<FeedForward> ffn;
    if (is_moe) {
      ffn = std::make_unique<Moe>(moe, weights, prefix + "mlp.");
    } else {
      ffn = std::make_unique<Mlp>(weights, prefix + "mlp.", config.hidden_size, config.intermediate_size);
    }
    site_norms.push_back(
        RmsNorm::load(weights, prefix + "input_layernorm.weight", config.hidden_size, config.rms_norm_eps, norm));
    auto mixer = std::make_unique<Attention>(attention, weights, prefix + "self_attn.", rope);
    site_norms.push_back(RmsNorm::load(weights, prefix + "post_attention_layernorm.weight", config.hidden_size,
                                       config.rms_norm_eps, norm));
    parts.layers.push_back(DecoderLayer{std::move(mixer), std::move(ffn)});
  }
  parts.residual = std::make_unique<PreNormResidual>(
      std::move(site_norms), RmsNorm::load(weights, "norm.weight", config.hidden_size, config.rms_norm_eps, norm));
  parts.lm_head = load_lm_head(weights, config, parts.embed_tokens);
  return std::make_unique<DecoderModel>(config, weights, std::move(parts));
}

}  // namespace metrale::arch
