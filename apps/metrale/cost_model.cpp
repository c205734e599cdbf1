#include "cost_model.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "model/arch/glm5_next.h"

namespace metrale::cli {

namespace {

// Chunk length of the chunked delta rule (qwen.md §6.6).
constexpr double kGdnChunk = 64.0;

bool is_hybrid(const std::string& type) {
  return type == "qwen3_next" || type == "qwen3_5" || type == "qwen3_5_moe" || type == "qwen4_exp";
}

// Whether layer `i` is a full-attention layer of a hybrid model: config.layer_types when given
// (legacy "attention" counts too), else every full_attention_interval-th layer.
bool hybrid_attention_layer(const ModelConfig& config, int64_t i) {
  const auto types = config.get_string_list("layer_types");
  if (!types.empty()) {
    const std::string& type = types.at(static_cast<size_t>(i));
    return type == "full_attention" || type == "attention" || type == "qwen_sparse_attention";
  }
  const int64_t interval = config.get_int("full_attention_interval", 4);
  return interval > 0 && (i + 1) % interval == 0;
}

}  // namespace

CostModel::CostModel(const ModelConfig& config, bool fp8_weights) : body_byte_width_(fp8_weights ? 1.0 : 2.0) {
  std::string type = config.model_type;
  if (type.size() > 5 && type.ends_with("_text")) type.resize(type.size() - 5);
  if (type == "glm5_next") {
    init_glm5_next(config);
    return;
  }
  if (type != "qwen3" && type != "qwen3_moe" && !is_hybrid(type))
    raise(ErrorCode::kUnsupported, "bench has no cost model for model_type '{}'", config.model_type);
  const bool hybrid = is_hybrid(type);

  const double h = static_cast<double>(config.hidden_size), d = static_cast<double>(config.head_dim);
  const double heads = static_cast<double>(config.num_heads), kv = static_cast<double>(config.num_kv_heads);
  hidden_ = h;
  q_dim_ = heads * d;
  kv_row_elements_ = 2.0 * kv * d;  // K and V per token per attention layer
  // Gated attention (hybrids) projects a query and a gate per head.
  const double q_proj = (hybrid ? 2.0 : 1.0) * h * heads * d;
  attention_params_ = q_proj + 2.0 * h * kv * d + heads * d * h + 2.0 * d + 2.0 * h;
  num_layers_ = config.num_layers;
  head_params_ = static_cast<double>(config.vocab_size) * h;
  dense_ffn_params_ = 3.0 * h * static_cast<double>(config.get_int("intermediate_size", 0));

  if (hybrid) {
    gdn_value_heads_ = static_cast<double>(config.get_int("linear_num_value_heads", 32));
    gdn_key_dim_ = static_cast<double>(config.get_int("linear_key_head_dim", 128));
    gdn_value_dim_ = static_cast<double>(config.get_int("linear_value_head_dim", 128));
    const double key_heads = static_cast<double>(config.get_int("linear_num_key_heads", 16));
    const double conv_kernel = static_cast<double>(config.get_int("linear_conv_kernel_dim", 4));
    const double key_dim = key_heads * gdn_key_dim_, value_dim = gdn_value_heads_ * gdn_value_dim_;
    const double conv_dim = 2.0 * key_dim + value_dim;
    // in_proj (q, k, v, z, b, a), the depthwise conv, out_proj, A_log, dt_bias and the gated norm.
    gdn_params_ = h * (conv_dim + value_dim + 2.0 * gdn_value_heads_) + conv_dim * conv_kernel + value_dim * h +
                  2.0 * gdn_value_heads_ + gdn_value_dim_ + 2.0 * h;
    // Per sequence: the fp32 state matrices and the bf16 conv window, read and written once per step.
    gdn_state_bytes_ = 4.0 * gdn_value_heads_ * gdn_key_dim_ * gdn_value_dim_ + 2.0 * (conv_kernel - 1.0) * conv_dim;
    for (int64_t i = 0; i < num_layers_; ++i) (hybrid_attention_layer(config, i) ? num_attention_layers_ : num_gdn_layers_)++;
  } else {
    num_attention_layers_ = num_layers_;
  }

  if (type == "qwen4_exp") qwen4_exp_terms(config);
  if (type == "qwen3_moe" || type == "qwen3_next" || type == "qwen3_5_moe" || type == "qwen4_exp") {
    num_experts_ = config.get_int("num_experts", config.get_int("num_local_experts", 128));
    top_k_ = config.get_int("num_experts_per_tok", 8);
    expert_params_ = 3.0 * h * static_cast<double>(config.get_int("moe_intermediate_size", 768));
    router_params_ = static_cast<double>(num_experts_) * h;
    const double shared = static_cast<double>(config.get_int("shared_expert_intermediate_size", 0));
    if (shared > 0) shared_expert_params_ = 3.0 * h * shared + h;  // + its sigmoid gate
    if (type == "qwen3_5_moe" || type == "qwen4_exp") {
      num_moe_layers_ = num_layers_;  // every layer, whatever the config says
    } else {
      const int64_t step = config.get_int("decoder_sparse_step", 1);
      const auto mlp_only = config.get_int_list("mlp_only_layers");
      for (int64_t i = 0; i < num_layers_; ++i) {
        if (std::find(mlp_only.begin(), mlp_only.end(), i) == mlp_only.end() && step > 0 && (i + 1) % step == 0)
          ++num_moe_layers_;
      }
    }
  }
  weight_bytes_ = weight_bytes_of(static_cast<double>(num_experts_));
}

void CostModel::qwen4_exp_terms(const ModelConfig& config) {
  const double h = hidden_, n = static_cast<double>(config.get_int("hc_count", 4));
  const double r = static_cast<double>(config.get_int("hc_lowrank", 320));
  // Per site: hc_norm, W_down, W_up, W_inj; the final mixer has no W_inj.
  const double site = n * h + 2.0 * r * n * h + n * n * h;
  hc_params_ = 2.0 * static_cast<double>(num_layers_) * site + (site - n * n * h);
  const double ple_layers = static_cast<double>(config.get_int_list("ple_layer_ids").size());
  const double embed = static_cast<double>(config.get_int("ple_embed_dim", config.hidden_size));
  const double taps = static_cast<double>(config.get_int("ple_conv_kernel_size", 4));
  const double dilation = static_cast<double>(config.get_int("ngram_size", 3));
  ple_params_ = ple_layers * (n * h * embed + h * embed + 3.0 * n * h + n * h * taps);
  ple_row_elements_ = ple_layers * embed;
  ple_state_bytes_ = ple_layers * 2.0 * (taps - 1.0) * dilation * n * h;
  index_heads_ = static_cast<double>(config.get_int("indexer_n_heads", 0));
  index_dim_ = static_cast<double>(config.get_int("indexer_head_dim", 0));
  compress_ratio_ = static_cast<double>(std::max<int64_t>(1, config.get_int("indexer_compress_ratio", 1)));
  budget_ = static_cast<double>(config.get_int("indexer_budget", 0));
  index_params_ = (index_heads_ + 1.0) * index_dim_ * h + 2.0 * index_dim_;
}

double CostModel::attended_keys(double visible) const {
  if (budget_ <= 0 || visible <= budget_ + compress_ratio_ - 1.0) return visible;
  return budget_ + std::fmod(visible, compress_ratio_);  // the selected blocks and the tail
}

// glm5_next (glm_deepseek.md §2): KDA layers take the GDN terms (the same recurrence cost per head,
// d_L x d_L fp32 state), DSA layers the attention terms with the absorbed MLA (queries of H r
// values against the r-wide latent of the attended tokens only: at most index_topk + kp - 1) and the
// indexer reading every cached pool key; the mHC maps count as mixer weights.
void CostModel::init_glm5_next(const ModelConfig& config) {
  const arch::Glm5NextConfig c = arch::parse_glm5_next_config(config);
  const double h = static_cast<double>(c.hidden_size), n = static_cast<double>(c.hc_mult);
  const double heads = static_cast<double>(c.num_heads), r = static_cast<double>(c.kv_lora_rank);
  const double rq = static_cast<double>(c.q_lora_rank), dn = static_cast<double>(c.qk_nope_head_dim);
  const double dv = static_cast<double>(c.v_head_dim), hi = static_cast<double>(c.index_n_heads);
  const double di = static_cast<double>(c.index_head_dim), kp = static_cast<double>(c.index_kpool);
  const double p = static_cast<double>(c.linear_dim()), dl = static_cast<double>(c.linear_head_dim);
  const double hl = static_cast<double>(c.linear_num_heads), k = static_cast<double>(c.linear_conv_kernel);
  hidden_ = h;
  num_layers_ = c.num_layers;
  head_params_ = static_cast<double>(c.vocab_size) * h;
  const double mhc = 2.0 * ((2.0 + n) * n * n * h + (2.0 + n) * n + 3.0) + 2.0 * h;
  attention_params_ = mhc + rq * h + rq + heads * dn * rq + r * h + r + heads * (dn + dv) * r + h * heads * dv +
                      hi * di * rq + 2.0 * di * h + 2.0 * di + hi * h + kp * di;
  gdn_params_ = mhc + 3.0 * p * h + 3.0 * p * k + 2.0 * (dl * h + p * dl) + p + hl + hl * h + dl + h * p;
  gdn_value_heads_ = hl;
  gdn_key_dim_ = dl;
  gdn_value_dim_ = dl;
  gdn_state_bytes_ = 4.0 * hl * dl * dl + 2.0 * (k - 1.0) * 3.0 * p;
  q_dim_ = heads * r;  // absorbed queries: each head scores and mixes r-wide latents
  kv_row_elements_ = r + 2.0 * di;  // written per token: the latent and [k^I | gamma]
  dsa_latent_ = r;
  dsa_pool_key_ = di;
  dsa_kpool_ = kp;
  dsa_attended_max_ = static_cast<double>(c.index_topk) + kp - 1.0;
  for (const auto mixer : c.mixers) (mixer == arch::Glm5NextMixer::kDsa ? num_attention_layers_ : num_gdn_layers_)++;
  dense_ffn_params_ = 3.0 * h * static_cast<double>(c.intermediate_size);
  num_experts_ = c.num_experts;
  top_k_ = c.top_k;
  expert_params_ = 3.0 * h * static_cast<double>(c.moe_intermediate_size);
  router_params_ = static_cast<double>(num_experts_) * h;
  shared_expert_params_ = 3.0 * h * static_cast<double>(c.moe_intermediate_size * c.num_shared_experts);
  for (const bool moe : c.moe) num_moe_layers_ += moe ? 1 : 0;
  weight_bytes_ = weight_bytes_of(static_cast<double>(num_experts_));
}

double CostModel::attended(int64_t context) const {
  const double visible = static_cast<double>(context + 1);
  return dsa_attended_max_ > 0 ? std::min(visible, dsa_attended_max_) : attended_keys(visible);
}

double CostModel::decode_kv_elements(int64_t context) const {
  if (dsa_attended_max_ <= 0) return attended(context) * kv_row_elements_;
  // The attended latents, every cached pool key (the indexer scores them all) and the rows written.
  return attended(context) * dsa_latent_ + std::floor(static_cast<double>(context + 1) / dsa_kpool_) * dsa_pool_key_ +
         kv_row_elements_;
}

double CostModel::weight_bytes_of(double experts_per_layer) const {
  return body_byte_width_ * (mixer_params() + ffn_params(experts_per_layer)) + 2.0 * head_params_;
}

double CostModel::mixer_params() const {
  return static_cast<double>(num_attention_layers_) * (attention_params_ + index_params_) +
         static_cast<double>(num_gdn_layers_) * gdn_params_ + hc_params_ + ple_params_;
}

double CostModel::ffn_params(double experts_per_layer) const {
  const double moe_layers = static_cast<double>(num_moe_layers_);
  return static_cast<double>(num_layers_ - num_moe_layers_) * dense_ffn_params_ +
         moe_layers * (router_params_ + experts_per_layer * expert_params_ + shared_expert_params_);
}

StepCost CostModel::decode(int64_t batch, int64_t context) const {
  StepCost cost;
  const double b = static_cast<double>(batch);
  const double attention_layers = static_cast<double>(num_attention_layers_);
  const double gdn_layers = static_cast<double>(num_gdn_layers_);
  // Experts a batch touches per MoE layer: E * (1 - (1 - k/E)^b) in expectation for uniform routing.
  double experts_read = 0;
  if (num_experts_ > 0) {
    const double e = static_cast<double>(num_experts_);
    experts_read = e * (1.0 - std::pow(1.0 - static_cast<double>(top_k_) / e, b));
  }

  // Sparse attention reads only the selected keys (QSA: the budget's blocks and the tail; DSA: the
  // selected latents and every cached pool key); the QSA indexer scores every complete block key.
  const double visible = static_cast<double>(context + 1);
  const double kv_elements = b * attention_layers * decode_kv_elements(context);
  const double block_keys = budget_ > 0 ? std::floor(visible / compress_ratio_) : 0.0;
  const double index_elements = b * attention_layers * block_keys * index_dim_;
  cost.bytes = weight_bytes_of(experts_read) +
               2.0 * (kv_elements + index_elements + b * (hidden_ + ple_row_elements_)) +
               2.0 * b * (gdn_layers * gdn_state_bytes_ + ple_state_bytes_);
  const double active = mixer_params() + ffn_params(static_cast<double>(top_k_)) + head_params_;
  // Recurrent decode per value head: decay, S^T k, the rank-1 update and S^T q, about 6 dk dv FLOPs.
  const double gdn_flops = gdn_layers * gdn_value_heads_ * 6.0 * gdn_key_dim_ * gdn_value_dim_;
  const double index_flops = attention_layers * 2.0 * index_heads_ * index_dim_ * block_keys;
  cost.flops = 2.0 * b * active + b * attention_layers * 4.0 * q_dim_ * attended(context) + b * gdn_flops +
               b * index_flops;
  return cost;
}

StepCost CostModel::prefill(int64_t tokens) const {
  StepCost cost;
  const double t = static_cast<double>(tokens);
  const double attention_layers = static_cast<double>(num_attention_layers_);
  const double gdn_layers = static_cast<double>(num_gdn_layers_);
  // Every row runs the per-token layers; only the last row reaches the LM head.
  const double per_token = mixer_params() + ffn_params(static_cast<double>(top_k_));
  // Causal attention: QK^T and PV over t(t+1)/2 query-key pairs, 2 FLOPs per multiply-add each
  // (QSA: the attended keys of each query, and the indexer's scores of its complete blocks; DSA:
  // each query attends to at most index_topk + kp - 1 tokens).
  double pairs = t * (t + 1.0) / 2.0, scored_blocks = 0.0;
  if (budget_ > 0) {
    pairs = 0.0;
    for (int64_t i = 1; i <= tokens; ++i) {
      pairs += attended_keys(static_cast<double>(i));
      scored_blocks += std::floor(static_cast<double>(i) / compress_ratio_);
    }
  } else if (dsa_attended_max_ > 0 && t > dsa_attended_max_) {
    pairs = dsa_attended_max_ * (dsa_attended_max_ + 1.0) / 2.0 + (t - dsa_attended_max_) * dsa_attended_max_;
  }
  const double attention = attention_layers * (4.0 * q_dim_ * pairs + 2.0 * index_heads_ * index_dim_ * scored_blocks);
  // Chunked delta rule per token and value head: the intra-chunk products (K K^T, Q K^T and the
  // two products with the chunk's values, 2 C (dk + dv) each pair) and the state terms (Q S, W S,
  // K'^T V': 6 dk dv).
  const double gdn = gdn_layers * t * gdn_value_heads_ *
                     (4.0 * kGdnChunk * (gdn_key_dim_ + gdn_value_dim_) + 6.0 * gdn_key_dim_ * gdn_value_dim_);
  cost.flops = 2.0 * t * per_token + 2.0 * head_params_ + attention + gdn;
  cost.bytes = weight_bytes_ + 2.0 * t * (attention_layers * (kv_row_elements_ + index_dim_) + ple_row_elements_) +
               gdn_layers * gdn_state_bytes_ + ple_state_bytes_;
  return cost;
}

}  // namespace metrale::cli
