// Qwen4-Exp / "Qwen3.8-Flash-Next" (model_type "qwen4_exp", text config "qwen4_exp_text"; qwen.md
// §2.6, §4.6, §5.5, §7): N hyper-connection residual streams instead of layer norms
// (blocks/hyper_connections.h), Gated DeltaNet `linear_attention` layers (Qwen3.5's split projections,
// output gate `output_gate_type`), `qwen_sparse_attention` layers (gated attention with the QSA
// indexer, blocks/qsa.h), PLE hashed n-gram embeddings on the 1-based `ple_layer_ids`
// (blocks/ple.h), an MoE with a sigmoid-gated shared expert on every layer, and the final
// hyper-connection mixer in place of the final norm.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "model/arch/architectures.h"
#include "model/blocks/decoder.h"
#include "model/blocks/gdn.h"
#include "model/blocks/hyper_connections.h"
#include "model/blocks/moe.h"
#include "model/blocks/ple.h"
#include "model/blocks/qsa.h"

namespace metrale::arch {
namespace {

int64_t positive(const ModelConfig& config, const std::string& key, int64_t value) {
  if (value <= 0) raise(ErrorCode::kBadFormat, "{}: field '{}' must be positive, got {}", config.source.string(), key, value);
  return value;
}

// A required integer field (the indexer's, which every attention layer builds).
int64_t required(const ModelConfig& config, const std::string& key) {
  if (!config.has(key) || config.text[key].is_null()) {
    raise(ErrorCode::kBadFormat, "{}: qwen4_exp needs field '{}' (every attention layer has the QSA indexer)",
          config.source.string(), key);
  }
  return positive(config, key, config.get_int(key));
}

kernels::GatedNormGate output_gate(const ModelConfig& config) {
  const std::string act = config.get_string("hidden_act", "silu");
  const bool given = config.has("output_gate_type") && !config.text["output_gate_type"].is_null();
  const std::string gate = given ? config.get_string("output_gate_type", act) : act;
  if (gate == "sigmoid") return kernels::GatedNormGate::kSigmoidRounded;
  if (gate == "silu") return kernels::GatedNormGate::kSilu;
  raise(ErrorCode::kBadFormat, "{}: output_gate_type '{}' must be 'sigmoid' or 'silu'", config.source.string(), gate);
}

}  // namespace

Qwen4ExpLayout qwen4_exp_layout(const ModelConfig& config) {
  Qwen4ExpLayout layout;
  const std::string where = config.source.string();
  const std::vector<std::string> types = config.get_string_list("layer_types");
  layout.attention.assign(static_cast<size_t>(config.num_layers), false);
  if (types.empty()) {
    const int64_t interval = positive(config, "full_attention_interval", config.get_int("full_attention_interval", 4));
    for (int64_t i = 0; i < config.num_layers; ++i) layout.attention[static_cast<size_t>(i)] = (i + 1) % interval == 0;
  } else {
    if (static_cast<int64_t>(types.size()) != config.num_layers) {
      raise(ErrorCode::kBadFormat, "{}: layer_types has {} entries for {} layers", where, types.size(),
            config.num_layers);
    }
    for (size_t i = 0; i < types.size(); ++i) {
      // full_attention is rewritten to qwen_sparse_attention (qwen.md §2.6). Some versions of the
      // reference write the cache kinds instead (deepseek_sparse_attention, and hybrid_indexed /
      // hybrid for attention layers with PLE): the same attention layer.
      if (types[i] == "qwen_sparse_attention" || types[i] == "full_attention" ||
          types[i] == "deepseek_sparse_attention" || types[i] == "hybrid_indexed" || types[i] == "hybrid") {
        layout.attention[i] = true;
      } else if (types[i] != "linear_attention") {
        raise(ErrorCode::kBadFormat,
              "{}: layer type '{}' of layer {} is not one of linear_attention, qwen_sparse_attention "
              "(full_attention)",
              where, types[i], i);
      }
    }
  }
  const std::vector<int64_t> ids = config.get_int_list("ple_layer_ids");
  for (const int64_t id : ids) {
    if (id < 1 || id > config.num_layers) {
      raise(ErrorCode::kBadFormat, "{}: ple_layer_ids entry {} is outside the 1-based layer ids 1..{}", where, id,
            config.num_layers);
    }
    if (layout.attention[static_cast<size_t>(id - 1)]) {
      raise(ErrorCode::kBadFormat, "{}: ple_layer_ids entry {} (layer {}) is not a linear_attention layer", where, id,
            id - 1);
    }
    layout.ple_layers.push_back(id - 1);
  }
  std::sort(layout.ple_layers.begin(), layout.ple_layers.end());
  layout.ple_layers.erase(std::unique(layout.ple_layers.begin(), layout.ple_layers.end()), layout.ple_layers.end());
  return layout;
}

namespace {

QsaConfig qsa_config(const ModelConfig& config) {
  const std::string where = config.source.string();
  QsaConfig qsa;
  qsa.hidden_size = config.hidden_size;
  qsa.num_heads = config.num_heads;
  qsa.num_kv_heads = config.num_kv_heads;
  qsa.head_dim = config.head_dim;
  qsa.rms_norm_eps = config.rms_norm_eps;
  qsa.index_heads = required(config, "indexer_n_heads");
  qsa.index_head_dim = required(config, "indexer_head_dim");
  qsa.budget = required(config, "indexer_budget");
  qsa.compress_ratio = required(config, "indexer_compress_ratio");
  if (const int64_t kv = required(config, "indexer_kv_heads"); kv != 1) {
    raise(ErrorCode::kBadFormat, "{}: indexer_kv_heads must be 1, got {}", where, kv);
  }
  if (qsa.budget % qsa.compress_ratio != 0) {
    raise(ErrorCode::kBadFormat, "{}: indexer_budget {} is not a multiple of indexer_compress_ratio {}", where,
          qsa.budget, qsa.compress_ratio);
  }
  return qsa;
}

GdnConfig gdn_config(const ModelConfig& config) {
  GdnConfig gdn;
  gdn.hidden_size = config.hidden_size;
  gdn.num_k_heads = config.get_int("linear_num_key_heads", 16);
  gdn.num_v_heads = config.get_int("linear_num_value_heads", 32);
  gdn.head_k_dim = config.get_int("linear_key_head_dim", 128);
  gdn.head_v_dim = config.get_int("linear_value_head_dim", 128);
  gdn.conv_kernel = config.get_int("linear_conv_kernel_dim", 4);
  gdn.rms_norm_eps = config.rms_norm_eps;
  gdn.layout = GdnProjectionLayout::kSplit;
  gdn.output_gate = output_gate(config);
  return gdn;
}

MoeConfig moe_config(const ModelConfig& config) {
  MoeConfig moe;
  moe.hidden_size = config.hidden_size;
  moe.num_experts = config.get_int("num_experts", 512);
  moe.top_k = config.get_int("num_experts_per_tok", 10);
  moe.expert_intermediate_size = config.get_int("moe_intermediate_size", 512);
  moe.shared_expert_intermediate_size = config.get_int("shared_expert_intermediate_size", 512);
  moe.normalize_top_k = config.get_bool("norm_topk_prob", true);
  if (moe.top_k < 1 || moe.top_k > moe.num_experts) {
    raise(ErrorCode::kBadFormat, "{}: num_experts_per_tok {} must be in [1, num_experts = {}]",
          config.source.string(), moe.top_k, moe.num_experts);
  }
  return moe;
}

// The PLE settings shared by the PLE layers (layer_index is set per layer).
PleConfig ple_config(const ModelConfig& config, int64_t streams, bool has_ple_layers) {
  PleConfig ple;
  ple.streams = streams;
  ple.hidden_size = config.hidden_size;
  ple.embed_dim = config.get_int("ple_embed_dim", config.hidden_size);
  ple.ngram_size = config.get_int("ngram_size", 3);
  ple.heads_per_ngram = config.get_int("heads_per_ngram", 8);
  ple.conv_kernel = config.get_int("ple_conv_kernel_size", 4);
  ple.rms_norm_eps = config.rms_norm_eps;
  ple.vocab_size = config.vocab_size;
  ple.seed = config.get_int("seed", 1234);
  ple.vocab_size_base = config.get_int("ngram_vocab_size_base", 20000000);
  ple.pad_multiple = config.get_int("make_ngram_vocab_size_divisible_by", 128);
  ple.split_parts = config.get_int("split_ngram_parts", 512);
  if (has_ple_layers) {
    // The PLE EOS: eos_token_id, or its first entry when a list.
    const nlohmann::json eos = config.text.value("eos_token_id", nlohmann::json());
    const nlohmann::json first = eos.is_array() && !eos.empty() ? eos.front() : eos;
    if (!first.is_number_integer() || first.get<int64_t>() < 0 || first.get<int64_t>() >= config.vocab_size) {
      raise(ErrorCode::kBadFormat,
            "{}: PLE layers need eos_token_id (a token id, or a list whose first entry is one), got {}",
            config.source.string(), eos.dump());
    }
    ple.eos_token_id = first.get<int64_t>();
  }
  return ple;
}

}  // namespace

std::unique_ptr<Model> build_qwen4_exp(const ModelConfig& config, Weights& weights) {
  const std::string where = config.source.string();
  const std::string act = config.get_string("hidden_act", "silu");
  if (act != "silu") raise(ErrorCode::kUnsupported, "{}: hidden_act '{}' is not supported (silu is)", where, act);
  const Qwen4ExpLayout layout = qwen4_exp_layout(config);
  const int64_t h = config.hidden_size;
  const int64_t streams = config.get_int("hc_count", 4);
  if (streams <= 1) raise(ErrorCode::kBadFormat, "{}: hc_count must be > 1, got {}", where, streams);
  const int64_t rank = positive(config, "hc_lowrank", config.get_int("hc_lowrank", 320));

  // RoPE: partial_rotary_factor as given (qwen4_exp injects no default: 1.0 when absent, qwen.md §2.1).
  const auto rotary_dim =
      static_cast<int64_t>(static_cast<double>(config.head_dim) * config.rope.partial_rotary_factor);
  if (rotary_dim < 2 || rotary_dim % 2 != 0 || rotary_dim > config.head_dim) {
    raise(ErrorCode::kBadFormat, "{}: rotary dim {} (head_dim {} x partial_rotary_factor {}) must be even, in [2, {}]",
          where, rotary_dim, config.head_dim, config.rope.partial_rotary_factor, config.head_dim);
  }
  auto rope = std::make_shared<const RotaryEmbedding>(config.rope, config.head_dim, config.max_position_embeddings,
                                                      weights.device(), rotary_dim);
  const QsaConfig qsa = qsa_config(config);
  const GdnConfig gdn = gdn_config(config);
  const MoeConfig moe = moe_config(config);
  const PleConfig ple = ple_config(config, streams, !layout.ple_layers.empty());

  DecoderParts parts;
  parts.embed_tokens = load_embedding(weights, config);
  std::vector<HyperConnectionWeights> sites;
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    const bool attention = layout.attention[static_cast<size_t>(i)];
    try {
      DecoderLayer layer;
      const auto ple_at = std::find(layout.ple_layers.begin(), layout.ple_layers.end(), i);
      if (ple_at != layout.ple_layers.end()) {
        PleConfig layer_ple = ple;
        layer_ple.layer_index = ple_at - layout.ple_layers.begin();
        layer.stream_blocks.push_back(std::make_unique<PleBlock>(layer_ple, weights, p + "ple."));
      }
      if (attention) {
        layer.mixer = std::make_unique<QsaAttention>(qsa, weights, p + "self_attn.", rope);
      } else {
        layer.mixer = std::make_unique<GatedDeltaNet>(gdn, weights, p + "linear_attn.");
      }
      layer.ffn = std::make_unique<Moe>(moe, weights, p + "mlp.");
      sites.push_back(HyperConnectionWeights::load(weights, p + "attn_hyper_connection.", streams, h, rank, true));
      sites.push_back(HyperConnectionWeights::load(weights, p + "mlp_hyper_connection.", streams, h, rank, true));
      parts.layers.push_back(std::move(layer));
    } catch (const Error& e) {
      rethrow_with_context(e, "layer {} ({})", i, attention ? "qwen_sparse_attention" : "linear_attention");
    }
  }
  HyperConnectionWeights mixer =
      HyperConnectionWeights::load(weights, "hyper_connection_mixer.", streams, h, rank, false);
  parts.residual = std::make_unique<HyperConnectionResidual>(streams, h, rank, config.rms_norm_eps, std::move(sites),
                                                             std::move(mixer));
  parts.lm_head = load_lm_head(weights, config, parts.embed_tokens);
  return std::make_unique<DecoderModel>(config, weights, std::move(parts));
}

}  // namespace metrale::arch
