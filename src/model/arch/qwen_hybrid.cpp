// The decoder shared by the Qwen hybrid models (qwen.md §5.3-§5.4): per layer a Gated DeltaNet mixer
// (`linear_attention`) or gated full attention (`full_attention`: interleaved query/gate q_proj,
// zero-centred q/k norms, partial RoPE, sigmoid output gate), then a dense SwiGLU MLP or an MoE with a
// sigmoid-gated shared expert; every RMSNorm is zero-centred except the GDN output norm. The optional
// MTP head (blocks/mtp.h) reuses the full_attention layer build with the mtp.* weights.
#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "model/arch/architectures.h"
#include "model/blocks/attention.h"
#include "model/blocks/decoder.h"
#include "model/blocks/gdn.h"
#include "model/blocks/mlp.h"
#include "model/blocks/moe.h"
#include "model/blocks/mtp.h"
#include "model/blocks/pre_norm.h"

namespace metrale::arch {

std::vector<bool> qwen_hybrid_full_attention_layers(const ModelConfig& config) {
  std::vector<bool> full(static_cast<size_t>(config.num_layers), false);
  const std::vector<std::string> types = config.get_string_list("layer_types");
  if (types.empty()) {
    // transformers derives the pattern from full_attention_interval (default 4): every interval-th layer.
    const int64_t interval = config.get_int("full_attention_interval", 4);
    if (interval <= 0) {
      raise(ErrorCode::kBadFormat, "{}: full_attention_interval must be positive, got {}", config.source.string(),
            interval);
    }
    for (int64_t i = 0; i < config.num_layers; ++i) full[static_cast<size_t>(i)] = (i + 1) % interval == 0;
    return full;
  }
  if (static_cast<int64_t>(types.size()) != config.num_layers) {
    raise(ErrorCode::kBadFormat, "{}: layer_types has {} entries for {} layers", config.source.string(), types.size(),
          config.num_layers);
  }
  for (size_t i = 0; i < types.size(); ++i) {
    // Legacy names as remap_legacy_layer_types maps them.
    const std::string& type = types[i];
    if (type == "full_attention" || type == "attention") {
      full[i] = true;
    } else if (type != "linear_attention" && type != "mamba" && type != "conv") {
      raise(ErrorCode::kUnsupported, "{}: layer type '{}' of layer {} is not supported by {}", config.source.string(),
            type, i, config.model_type);
    }
  }
  return full;
}

double qwen_hybrid_partial_rotary_factor(const ModelConfig& config) {
  // As config.cpp folds RoPE fields: rope_scaling replaces rope_parameters; a top-level value fills a
  // missing one. The hybrid configs inject 0.25 when no value is given anywhere.
  const char* dict = config.has("rope_scaling") && config.text["rope_scaling"].is_object()         ? "rope_scaling"
                     : config.has("rope_parameters") && config.text["rope_parameters"].is_object() ? "rope_parameters"
                                                                                                   : nullptr;
  const bool given = (dict != nullptr && config.text[dict].contains("partial_rotary_factor") &&
                      !config.text[dict]["partial_rotary_factor"].is_null()) ||
                     config.has("partial_rotary_factor");
  return given ? config.rope.partial_rotary_factor : 0.25;
}

std::unique_ptr<Model> build_qwen_hybrid(const ModelConfig& config, Weights& weights,
                                         const QwenHybridOptions& options) {
  const std::string act = config.get_string("hidden_act", "silu");
  if (act != "silu") {
    raise(ErrorCode::kUnsupported, "{}: hidden_act '{}' is not supported (silu is)", config.source.string(), act);
  }
  const std::vector<bool> full_attention = qwen_hybrid_full_attention_layers(config);
  RopeConfig rope_config = config.rope;
  rope_config.partial_rotary_factor = qwen_hybrid_partial_rotary_factor(config);
  // Text-only input makes mRoPE's three position rows equal: plain partial RoPE (qwen.md §3.2).
  const auto rotary_dim =
      static_cast<int64_t>(static_cast<double>(config.head_dim) * rope_config.partial_rotary_factor);
  auto rope = std::make_shared<const RotaryEmbedding>(rope_config, config.head_dim, config.max_position_embeddings,
                                                      weights.device(), rotary_dim);

  GdnConfig gdn;
  gdn.hidden_size = config.hidden_size;
  gdn.num_k_heads = config.get_int("linear_num_key_heads", 16);
  gdn.num_v_heads = config.get_int("linear_num_value_heads", 32);
  gdn.head_k_dim = config.get_int("linear_key_head_dim", 128);
  gdn.head_v_dim = config.get_int("linear_value_head_dim", 128);
  gdn.conv_kernel = config.get_int("linear_conv_kernel_dim", 4);
  gdn.rms_norm_eps = config.rms_norm_eps;
  gdn.layout = options.gdn_layout;

  AttentionConfig attention_config;
  attention_config.hidden_size = config.hidden_size;
  attention_config.num_heads = config.num_heads;
  attention_config.num_kv_heads = config.num_kv_heads;
  attention_config.head_dim = config.head_dim;
  attention_config.rms_norm_eps = config.rms_norm_eps;
  attention_config.qk_norm = true;
  attention_config.norm_kind = kernels::RmsNormKind::kZeroCentered;
  attention_config.output_gate = true;

  MoeConfig moe;
  moe.hidden_size = config.hidden_size;
  moe.num_experts = config.get_int("num_experts", config.get_int("num_local_experts", options.default_num_experts));
  moe.top_k = config.get_int("num_experts_per_tok", options.default_top_k);
  moe.expert_intermediate_size = config.get_int("moe_intermediate_size", 512);
  moe.shared_expert_intermediate_size = config.get_int("shared_expert_intermediate_size", 512);
  // qwen3_5_moe always renormalises the top-k weights; qwen3_next reads norm_topk_prob (default true).
  moe.normalize_top_k = options.ffn == QwenHybridFfn::kMoe || config.get_bool("norm_topk_prob", true);
  const int64_t dense_width = config.get_int("intermediate_size", options.default_intermediate_size);
  const int64_t sparse_step = config.get_int("decoder_sparse_step", 1);
  const std::vector<int64_t> mlp_only = config.get_int_list("mlp_only_layers");
  const auto layer_is_moe = [&](int64_t i) {
    switch (options.ffn) {
      case QwenHybridFfn::kDense:
        return false;
      case QwenHybridFfn::kMoe:
        return true;
      case QwenHybridFfn::kSparseStepRule:
        return std::find(mlp_only.begin(), mlp_only.end(), i) == mlp_only.end() && moe.num_experts > 0 &&
               sparse_step > 0 && (i + 1) % sparse_step == 0;
    }
    return false;
  };
  if (options.ffn != QwenHybridFfn::kDense && (moe.top_k < 1 || moe.top_k > moe.num_experts)) {
    raise(ErrorCode::kBadFormat, "{}: num_experts_per_tok {} must be in [1, num_experts = {}]", config.source.string(),
          moe.top_k, moe.num_experts);
  }

  const auto norm = kernels::RmsNormKind::kZeroCentered;
  // One decoder layer from `layer_weights` under `prefix`, its two site norms appended to
  // `site_norms`; the MTP layers are built like the trunk's full_attention layers. Load order (random
  // weights draw in it): mixer, FFN, input_layernorm, post_attention_layernorm.
  const auto build_layer = [&](Weights& layer_weights, const std::string& prefix, bool attention, bool moe_ffn,
                               std::vector<RmsNorm>& site_norms) {
    std::unique_ptr<Mixer> mixer;
    if (attention) {
      mixer = std::make_unique<Attention>(attention_config, layer_weights, prefix + "self_attn.", rope);
    } else {
      mixer = std::make_unique<GatedDeltaNet>(gdn, layer_weights, prefix + "linear_attn.");
    }
    std::unique_ptr<FeedForward> ffn;
    if (moe_ffn) {
      ffn = std::make_unique<Moe>(moe, layer_weights, prefix + "mlp.");
    } else {
      if (dense_width <= 0) {
        raise(ErrorCode::kBadFormat, "{}: a dense layer needs intermediate_size, got {}", config.source.string(),
              dense_width);
      }
      ffn = std::make_unique<Mlp>(layer_weights, prefix + "mlp.", config.hidden_size, dense_width);
    }
    site_norms.push_back(
        RmsNorm::load(layer_weights, prefix + "input_layernorm.weight", config.hidden_size, config.rms_norm_eps, norm));
    site_norms.push_back(RmsNorm::load(layer_weights, prefix + "post_attention_layernorm.weight", config.hidden_size,
                                       config.rms_norm_eps, norm));
    return DecoderLayer{std::move(mixer), std::move(ffn)};
  };

  DecoderParts parts;
  parts.embed_tokens = load_embedding(weights, config);
  std::vector<RmsNorm> site_norms;
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const bool attention = full_attention[static_cast<size_t>(i)];
    try {
      parts.layers.push_back(
          build_layer(weights, "layers." + std::to_string(i) + ".", attention, layer_is_moe(i), site_norms));
    } catch (const Error& e) {
      rethrow_with_context(e, "layer {} ({})", i, attention ? "attention" : "gdn");
    }
  }
  parts.residual = std::make_unique<PreNormResidual>(
      std::move(site_norms), RmsNorm::load(weights, "norm.weight", config.hidden_size, config.rms_norm_eps, norm));
  parts.lm_head = load_lm_head(weights, config, parts.embed_tokens);

  // The MTP draft head (mtp.* at the checkpoint's root): loaded when the config declares MTP layers
  // (Qwen3.5's mtp_num_hidden_layers, Qwen3-Next's num_nextn_predict_layers) and the checkpoint has
  // them (re-uploads often strip mtp.*). A head that fails to load leaves the trunk usable: a warning,
  // and has_mtp() is false.
  const int64_t declared_mtp_layers =
      config.get_int("mtp_num_hidden_layers", config.get_int("num_nextn_predict_layers", 0));
  if (declared_mtp_layers > 0 && (weights.is_random() || weights.has_root("mtp.fc.weight"))) {
    Weights mtp_weights = weights.with_prefix("mtp.");
    try {
      MtpHeadParts head;
      const int64_t h = config.hidden_size;
      head.pre_fc_norm_embedding =
          RmsNorm::load(mtp_weights, "pre_fc_norm_embedding.weight", h, config.rms_norm_eps, norm);
      head.pre_fc_norm_hidden = RmsNorm::load(mtp_weights, "pre_fc_norm_hidden.weight", h, config.rms_norm_eps, norm);
      head.fc = mtp_weights.get_linear("fc.weight", {h, 2 * h});
      std::vector<RmsNorm> head_norms;
      for (int64_t i = 0; i < declared_mtp_layers; ++i) {
        const std::string prefix = "layers." + std::to_string(i) + ".";
        // vLLM builds MTP layer i with the trunk's FFN rule for index i; a checkpoint says it directly.
        const bool moe_ffn = weights.is_random() ? layer_is_moe(i) : mtp_weights.has(prefix + "mlp.gate.weight");
        try {
          head.layers.push_back(build_layer(mtp_weights, prefix, true, moe_ffn, head_norms));
        } catch (const Error& e) {
          rethrow_with_context(e, "MTP layer {}", i);
        }
      }
      head.residual = std::make_unique<PreNormResidual>(
          std::move(head_norms), RmsNorm::load(mtp_weights, "norm.weight", h, config.rms_norm_eps, norm));
      if (config.get_bool("mtp_use_dedicated_embeddings", false)) {
        head.embed_tokens = mtp_weights.get("embed_tokens.weight", {config.vocab_size, h});
      }
      parts.mtp = std::make_unique<MtpHead>(std::move(head), mtp_weights.take_device_buffers());
    } catch (const Error& e) {
      METRALE_LOG_WARN("{}: the MTP head is not loaded: {}", config.source.string(), e.what());
    }
  }
  return std::make_unique<DecoderModel>(config, weights, std::move(parts));
}

}  // namespace metrale::arch
