// glm5_next (GLM-5.3-Flash, glm_deepseek.md §2): per layer a Kimi Delta Attention mixer
// (`linear_attention`, blocks/kda.h) or a DSA mixer (NoPE MLA with the pooled lightning indexer,
// blocks/mla_dsa.h), then a clamped SwiGLU MLP (dense layers) or the sigmoid-routed MoE with a shared
// expert; the layers are joined by the mHC streams (blocks/mhc_streams.h). The MTP layer stored at
// index num_hidden_layers (§2.10) becomes the MTP draft head (blocks/mtp.h).
//
// Checkpoint layouts: the HF layout and the hub layout (conversion_mapping.py["glm5_next"]), under
// model.language_model. or model., with lm_head.weight at the root. The hub layout's renames are
// aliases on the Weights (hc_attn_* -> attn_hc.*, hc_ffn_* -> ffn_hc.*, the forget-gate tensors
// under self_attn.forget_gate.); its per-expert MoE tensors and separate q/k/v conv weights are read
// by the MoE and KDA blocks directly. Every checkpoint tensor must be read, except those of the MTP
// layer (when its head is not built), shared_head tensors of other layers and the vision tower's.
//
// MTP conventions §2.10 leaves open: e_{t+1} is not zeroed at position 0 (the embedding of the next
// token is always used), and the hidden state a chained draft step feeds back is the head's output
// after shared_head.norm (MtpHead's o_t).
#include <regex>

#include "core/error.h"
#include "core/log.h"
#include "model/arch/architectures.h"
#include "model/arch/glm5_next.h"
#include "model/blocks/decoder.h"
#include "model/blocks/kda.h"
#include "model/blocks/mhc_streams.h"
#include "model/blocks/mla_dsa.h"
#include "model/blocks/mlp.h"
#include "model/blocks/moe.h"
#include "model/blocks/mtp.h"
#include "model/blocks/pre_norm.h"

namespace metrale::arch {
namespace {

// The hub layout's names as aliases of the HF names they load as (conversion_mapping.py renames).
void add_hub_aliases(Weights& weights) {
  if (weights.is_random()) return;
  static const std::pair<std::string, std::string> kRenames[] = {
      {"hc_attn_fn", "attn_hc.fn"},     {"hc_attn_base", "attn_hc.base"}, {"hc_attn_scale", "attn_hc.scale"},
      {"hc_ffn_fn", "ffn_hc.fn"},       {"hc_ffn_base", "ffn_hc.base"},   {"hc_ffn_scale", "ffn_hc.scale"},
      {"self_attn.f_a_proj.weight", "self_attn.forget_gate.f_a_proj.weight"},
      {"self_attn.f_b_proj.weight", "self_attn.forget_gate.f_b_proj.weight"},
      {"self_attn.dt_bias", "self_attn.forget_gate.dt_bias"},
      {"self_attn.A_log", "self_attn.forget_gate.A_log"},
  };
  for (const std::string& name : weights.store().names()) {
    for (const auto& [hub, hf] : kRenames) {
      const size_t at = name.find(hub);
      if (at == std::string::npos || !name.ends_with(hub)) continue;
      const std::string canonical = name.substr(0, at) + hf;
      if (weights.store().has(canonical)) {
        raise(ErrorCode::kBadFormat, "{}: the checkpoint holds both '{}' and its hub spelling '{}'",
              weights.source_name(), canonical, name);
      }
      weights.add_alias(canonical, name);
    }
  }
}

struct LayerBuilder {
  const ModelConfig& model_config;
  const Glm5NextConfig& config;

  KdaConfig kda() const {
    KdaConfig kda;
    kda.hidden_size = config.hidden_size;
    kda.num_heads = config.linear_num_heads;
    kda.head_dim = config.linear_head_dim;
    kda.conv_kernel = config.linear_conv_kernel;
    kda.rms_norm_eps = config.rms_norm_eps;
    kda.lower_bound = config.linear_lower_bound;
    return kda;
  }
  DsaConfig dsa() const {
    DsaConfig dsa;
    dsa.hidden_size = config.hidden_size;
    dsa.num_heads = config.num_heads;
    dsa.q_lora_rank = config.q_lora_rank;
    dsa.kv_lora_rank = config.kv_lora_rank;
    dsa.qk_nope_head_dim = config.qk_nope_head_dim;
    dsa.v_head_dim = config.v_head_dim;
    dsa.index_n_heads = config.index_n_heads;
    dsa.index_head_dim = config.index_head_dim;
    dsa.index_topk = config.index_topk;
    dsa.index_kpool = config.index_kpool;
    dsa.rms_norm_eps = config.rms_norm_eps;
    return dsa;
  }
  std::unique_ptr<FeedForward> ffn(Weights& weights, const std::string& prefix, bool moe) const {
    const auto limit = static_cast<float>(config.swiglu_limit);
    if (!moe) return std::make_unique<Mlp>(weights, prefix + "mlp.", config.hidden_size, config.intermediate_size, limit);
    MoeConfig moe_config;
    moe_config.hidden_size = config.hidden_size;
    moe_config.num_experts = config.num_experts;
    moe_config.top_k = config.top_k;
    moe_config.expert_intermediate_size = config.moe_intermediate_size;
    moe_config.normalize_top_k = config.norm_topk_prob;
    moe_config.shared_expert_intermediate_size = config.moe_intermediate_size * config.num_shared_experts;
    moe_config.scoring = kernels::MoeScoring::kSigmoid;
    moe_config.correction_bias = true;
    moe_config.n_group = static_cast<int>(config.n_group);
    moe_config.topk_group = static_cast<int>(config.topk_group);
    moe_config.routed_scaling_factor = static_cast<float>(config.routed_scaling_factor);
    moe_config.swiglu_limit = limit;
    moe_config.shared_expert_prefix = "shared_experts.";
    moe_config.shared_expert_gated = false;
    return std::make_unique<Moe>(moe_config, weights, prefix + "mlp.");
  }
  RmsNorm norm(Weights& weights, const std::string& key) const {
    return RmsNorm::load(weights, key, config.hidden_size, config.rms_norm_eps, kernels::RmsNormKind::kPlain);
  }
};

// The MTP head from layer `config.num_layers` (§2.10): enorm, hnorm, eh_proj, a plain pre-norm DSA
// block with a full indexer and shared_head.norm as its final norm.
std::unique_ptr<MtpHead> build_mtp_head(Weights& weights, const LayerBuilder& build) {
  const Glm5NextConfig& config = build.config;
  Weights mtp = weights.with_prefix(weights.prefix() + "layers." + std::to_string(config.num_layers) + ".");
  const int64_t h = config.hidden_size;
  MtpHeadParts head;
  head.pre_fc_norm_embedding = build.norm(mtp, "enorm.weight");
  head.pre_fc_norm_hidden = build.norm(mtp, "hnorm.weight");
  head.fc = mtp.get_linear("eh_proj.weight", {h, 2 * h});
  DecoderLayer layer;
  layer.mixer = std::make_unique<DsaMixer>(build.dsa(), mtp, "self_attn.", nullptr, nullptr);
  layer.ffn = build.ffn(mtp, "", mtp.is_random() || mtp.has("mlp.gate.weight"));
  std::vector<RmsNorm> norms;
  norms.push_back(build.norm(mtp, "input_layernorm.weight"));
  norms.push_back(build.norm(mtp, "post_attention_layernorm.weight"));
  head.layers.push_back(std::move(layer));
  head.residual = std::make_unique<PreNormResidual>(std::move(norms), build.norm(mtp, "shared_head.norm.weight"));
  return std::make_unique<MtpHead>(std::move(head), mtp.take_device_buffers());
}

}  // namespace

std::unique_ptr<Model> build_glm5_next(const ModelConfig& model_config, Weights& weights) {
  const Glm5NextConfig config = parse_glm5_next_config(model_config);
  add_hub_aliases(weights);
  const LayerBuilder build{model_config, config};
  const int64_t n = config.hc_mult, d = config.hidden_size;

  DecoderParts parts;
  parts.embed_tokens = load_embedding(weights, model_config);
  std::vector<MhcSiteMaps> sites;
  std::vector<OwnedTensor> owned;
  std::shared_ptr<DsaSelectionLink> previous_link;
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const auto at = static_cast<size_t>(i);
    const bool dsa = config.mixers[at] == Glm5NextMixer::kDsa;
    const std::string prefix = "layers." + std::to_string(i) + ".";
    try {
      DecoderLayer layer;
      if (dsa) {
        const bool next_shared = i + 1 < config.num_layers && config.shared_indexer[at + 1];
        std::shared_ptr<DsaSelectionLink> shared_from = config.shared_indexer[at] ? previous_link : nullptr;
        std::shared_ptr<DsaSelectionLink> publish_to = next_shared ? std::make_shared<DsaSelectionLink>() : nullptr;
        layer.mixer = std::make_unique<DsaMixer>(build.dsa(), weights, prefix + "self_attn.", shared_from, publish_to);
        previous_link = publish_to;
      } else {
        layer.mixer = std::make_unique<KdaMixer>(build.kda(), weights, prefix + "self_attn.");
        previous_link = nullptr;
      }
      layer.ffn = build.ffn(weights, prefix, config.moe[at]);
      sites.push_back(MhcResidual::load_site(weights, prefix + "attn_hc.", n, d,
                                             build.norm(weights, prefix + "input_layernorm.weight"), owned));
      sites.push_back(MhcResidual::load_site(weights, prefix + "ffn_hc.", n, d,
                                             build.norm(weights, prefix + "post_attention_layernorm.weight"), owned));
      parts.layers.push_back(std::move(layer));
    } catch (const Error& e) {
      rethrow_with_context(e, "layer {} ({})", i, dsa ? "dsa" : "kda");
    }
  }
  kernels::MhcParams mhc;
  mhc.sinkhorn_iters = static_cast<int>(config.hc_sinkhorn_iters);
  mhc.hc_eps = static_cast<float>(config.hc_eps);
  mhc.norm_eps = static_cast<float>(config.rms_norm_eps);
  parts.residual = std::make_unique<MhcResidual>(std::move(sites), build.norm(weights, "norm.weight"), n, mhc,
                                                 std::move(owned), weights.device());
  parts.lm_head = load_lm_head(weights, model_config, parts.embed_tokens);

  const std::string mtp_key = "layers." + std::to_string(config.num_layers) + ".eh_proj.weight";
  if (weights.is_random() ? config.num_mtp_layers > 0 : weights.has(mtp_key)) {
    try {
      parts.mtp = build_mtp_head(weights, build);
    } catch (const Error& e) {
      METRALE_LOG_WARN("{}: the MTP head is not loaded: {}", model_config.source.string(), e.what());
    }
  }
  return std::make_unique<DecoderModel>(model_config, weights, std::move(parts));
}

bool glm5_next_ignores(const ModelConfig& config, std::string_view name) {
  const std::regex ignored("(.*\\.)?layers\\." + std::to_string(config.num_layers) +
                           "\\..*|.*\\.layers\\.[0-9]+\\.shared_head\\..*|model\\.visual\\..*");
  return std::regex_match(name.begin(), name.end(), ignored);
}

}  // namespace metrale::arch
