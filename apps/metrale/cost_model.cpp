#include "cost_model.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace metrale::cli {

CostModel::CostModel(const ModelConfig& config) {
  const double h = static_cast<double>(config.hidden_size), d = static_cast<double>(config.head_dim);
  const double heads = static_cast<double>(config.num_heads), kv = static_cast<double>(config.num_kv_heads);
  hidden_ = h;
  q_dim_ = heads * d;
  kv_row_elements_ = 2.0 * kv * d;  // K and V per token per layer
  attention_params_ = h * heads * d + 2.0 * h * kv * d + heads * d * h + 2.0 * d + 2.0 * h;
  num_layers_ = config.num_layers;
  head_params_ = static_cast<double>(config.vocab_size) * h;
  dense_ffn_params_ = 3.0 * h * static_cast<double>(config.intermediate_size);
  if (config.model_type == "qwen3_moe") {
    num_experts_ = config.get_int("num_experts", config.get_int("num_local_experts", 128));
    top_k_ = config.get_int("num_experts_per_tok", 8);
    expert_params_ = 3.0 * h * static_cast<double>(config.get_int("moe_intermediate_size", 768));
    router_params_ = static_cast<double>(num_experts_) * h;
    const int64_t step = config.get_int("decoder_sparse_step", 1);
    const auto mlp_only = config.get_int_list("mlp_only_layers");
    for (int64_t i = 0; i < num_layers_; ++i) {
      if (std::find(mlp_only.begin(), mlp_only.end(), i) == mlp_only.end() && step > 0 && (i + 1) % step == 0)
        ++num_moe_layers_;
    }
  } else if (config.model_type != "qwen3") {
    raise(ErrorCode::kUnsupported, "bench has no cost model for model_type '{}'", config.model_type);
  }
  const double dense_layers = static_cast<double>(num_layers_ - num_moe_layers_);
  weight_bytes_ = 2.0 * (static_cast<double>(num_layers_) * attention_params_ + dense_layers * dense_ffn_params_ +
                         static_cast<double>(num_moe_layers_) * (router_params_ + static_cast<double>(num_experts_) * expert_params_) +
                         head_params_);
}

StepCost CostModel::decode(int64_t batch, int64_t context) const {
  StepCost cost;
  const double b = static_cast<double>(batch);
  const double layers = static_cast<double>(num_layers_), moe_layers = static_cast<double>(num_moe_layers_);
  // Experts a batch touches per MoE layer: E * (1 - (1 - k/E)^b) in expectation for uniform routing.
  double experts_read = 0;
  if (num_experts_ > 0) {
    const double e = static_cast<double>(num_experts_);
    experts_read = e * (1.0 - std::pow(1.0 - static_cast<double>(top_k_) / e, b));
  }
  const double weight_elements = layers * attention_params_ + (layers - moe_layers) * dense_ffn_params_ +
                                 moe_layers * (router_params_ + experts_read * expert_params_) + head_params_;
  const double kv_elements = b * static_cast<double>(context + 1) * layers * kv_row_elements_;
  cost.bytes = 2.0 * (weight_elements + kv_elements + b * hidden_);
  const double active = layers * attention_params_ + (layers - moe_layers) * dense_ffn_params_ +
                        moe_layers * (router_params_ + static_cast<double>(top_k_) * expert_params_) + head_params_;
  cost.flops = 2.0 * b * active + b * layers * 4.0 * q_dim_ * static_cast<double>(context + 1);
  return cost;
}

StepCost CostModel::prefill(int64_t tokens) const {
  StepCost cost;
  const double t = static_cast<double>(tokens);
  const double layers = static_cast<double>(num_layers_), moe_layers = static_cast<double>(num_moe_layers_);
  // Every row runs the per-token layers; only the last row reaches the LM head.
  const double per_token = layers * attention_params_ + (layers - moe_layers) * dense_ffn_params_ +
                           moe_layers * (router_params_ + static_cast<double>(top_k_) * expert_params_);
  // Causal attention: QK^T and PV over t(t+1)/2 query-key pairs, 2 FLOPs per multiply-add each.
  const double attention = layers * 4.0 * q_dim_ * t * (t + 1.0) / 2.0;
  cost.flops = 2.0 * t * per_token + 2.0 * head_params_ + attention;
  cost.bytes = weight_bytes_ + 2.0 * t * layers * kv_row_elements_;
  return cost;
}

}  // namespace metrale::cli
