// Tiny random glm5_next (GLM-5.3-Flash) checkpoints: the sizes, bf16-exact random weights in the HF
// layout (experts per expert), config.json (flat glm5_next_text or composite glm5_next) and the
// safetensors file in the HF layout (fused experts) or the hub layout (conversion_mapping.py's names:
// hc_attn_* / hc_ffn_*, the forget-gate tensors directly under self_attn., q/k/v_conv1d, per-expert
// MoE tensors), with the MTP layer at index num_layers. tools/demo_model and the model tests use it.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/tiny_checkpoint.h"

namespace metrale::testing {

struct TinyGlm5Spec {
  int64_t vocab_size = 53;
  int64_t hidden_size = 16;
  // KDA, DSA (full indexer), DSA (shared indexer), KDA; dense and sparse MLPs alternating.
  std::vector<std::string> layer_types = {"linear_attention", "deepseek_sparse_attention",
                                          "deepseek_sparse_attention", "linear_attention"};
  std::vector<std::string> mlp_layer_types = {"dense", "sparse", "dense", "sparse"};
  std::string index_topk_pattern = "FFSF";  // written as the index_topk_pattern string ("": not written)
  double rms_norm_eps = 1e-5;
  // DSA
  int64_t num_heads = 2, q_lora_rank = 12, kv_lora_rank = 8, qk_nope_head_dim = 6, v_head_dim = 5;
  int64_t index_n_heads = 8, index_head_dim = 4, index_topk = 8, index_kpool = 4;
  // KDA
  int64_t linear_num_heads = 2, linear_head_dim = 8, linear_conv_kernel = 4;
  std::optional<double> linear_lower_bound = -5.0;  // nullopt: written as null (the softplus gate)
  // mHC
  int64_t hc_mult = 4, hc_sinkhorn_iters = 20;
  double hc_eps = 1e-6;
  // FFN
  int64_t intermediate_size = 24, moe_intermediate_size = 10, num_experts = 6, top_k = 2, n_shared_experts = 1;
  int64_t n_group = 2, topk_group = 1;
  double routed_scaling_factor = 2.5, swiglu_limit = 0.6;
  bool norm_topk_prob = true;
  bool with_mtp = true;          // write layer num_layers (the MTP layer) and num_nextn_predict_layers 1
  bool composite_config = true;  // {model_type glm5_next, text_config {model_type glm5_next_text}}

  int64_t num_layers() const { return static_cast<int64_t>(layer_types.size()); }
  bool is_dsa(int64_t layer) const { return layer_types[static_cast<size_t>(layer)] != "linear_attention"; }
  bool is_moe(int64_t layer) const { return mlp_layer_types[static_cast<size_t>(layer)] == "sparse"; }
  bool shared_indexer(int64_t layer) const {
    return is_dsa(layer) && !index_topk_pattern.empty() && index_topk_pattern[static_cast<size_t>(layer)] == 'S';
  }
  int64_t linear_dim() const { return linear_num_heads * linear_head_dim; }
};

// HF-layout keys relative to the text model's root, experts per expert; "lm_head.weight" at the root.
TinyWeights make_glm5_weights(const TinyGlm5Spec& spec, uint64_t seed);
nlohmann::json glm5_config_json(const TinyGlm5Spec& spec);

enum class Glm5Layout { kHf, kHub };
struct Glm5CheckpointLayout {
  Glm5Layout layout = Glm5Layout::kHf;
  std::string prefix = "model.language_model.";
  DType storage = DType::kBF16;
};
void write_glm5_checkpoint(const std::filesystem::path& dir, const TinyGlm5Spec& spec, const TinyWeights& weights,
                           const Glm5CheckpointLayout& layout = {});
std::unique_ptr<LoadedTinyModel> load_glm5(const TinyGlm5Spec& spec, const TinyWeights& weights,
                                           const Glm5CheckpointLayout& layout = {});

}  // namespace metrale::testing
