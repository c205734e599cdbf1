// The configuration of glm5_next (GLM-5.3-Flash, glm_deepseek.md §2.1) as its builder reads it:
// every field with the reference's default, and the per-layer schedules __post_init__ derives.
// Composite (`glm5_next`, text fields under text_config) and bare (`glm5_next_text`) configs parse
// alike; ModelConfig has already moved text_config up.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"

namespace metrale::arch {

enum class Glm5NextMixer { kKda, kDsa };

struct Glm5NextConfig {
  int64_t vocab_size = 154880;
  int64_t hidden_size = 4096;  // D
  int64_t num_layers = 45;     // L (the MTP layer, when stored, is layer L)
  double rms_norm_eps = 1e-5;  // every RMSNorm, the mHC input norm included
  bool tie_word_embeddings = false;

  // Feed-forward (§1, §2.7).
  int64_t intermediate_size = 12288;    // dense layers
  int64_t moe_intermediate_size = 2048;  // I, routed and shared experts
  int64_t num_experts = 288;            // n_routed_experts / num_local_experts
  int64_t top_k = 8;                    // num_experts_per_tok
  int64_t num_shared_experts = 1;
  double routed_scaling_factor = 2.5;
  bool norm_topk_prob = true;
  int64_t n_group = 1, topk_group = 1;
  double swiglu_limit = 10.0;  // every SwiGLU of the text model is clamped

  // DSA: NoPE MLA (§2.6.1) and the pooled lightning indexer (§2.6.2-§2.6.4).
  int64_t num_heads = 64;  // H (= num_key_value_heads)
  int64_t q_lora_rank = 1536;
  int64_t kv_lora_rank = 512;  // r: the cached latent width
  int64_t qk_nope_head_dim = 256;
  int64_t v_head_dim = 256;
  int64_t index_n_heads = 32, index_head_dim = 128, index_topk = 2048, index_kpool = 16;

  // KDA (§2.5), after the linear_attn_config override.
  int64_t linear_num_heads = 64, linear_head_dim = 128, linear_conv_kernel = 4;
  std::optional<double> linear_lower_bound = -5.0;  // nullopt: the softplus gate

  // mHC (§2.4).
  int64_t hc_mult = 4, hc_sinkhorn_iters = 20;
  double hc_eps = 1e-6;

  // Per layer [L].
  std::vector<Glm5NextMixer> mixers;
  std::vector<bool> moe;             // mlp_layer_types == "sparse"
  std::vector<bool> shared_indexer;  // DSA layers whose indexer_types entry is "shared"

  int64_t num_mtp_layers = 0;  // num_nextn_predict_layers (the checkpoint decides whether it holds one)

  int64_t linear_dim() const { return linear_num_heads * linear_head_dim; }  // P
};

// Reads and validates the fields and schedules; errors name the config file and the field.
Glm5NextConfig parse_glm5_next_config(const ModelConfig& config);

}  // namespace metrale::arch
