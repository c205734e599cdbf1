// What a step must move and compute at minimum, from the model's shapes: the numerators of the
// roofline fractions `metrale bench` reports. Bytes count each weight read once per step (the
// embedding only for the rows gathered) and the keys/values each decode row reads; FLOPs count
// the matrix products (2 per multiply-add), causal attention and, for hybrid models, the Gated
// DeltaNet (or KDA) recurrence with its per-sequence state traffic (fp32 state read and written each
// step); for qwen4_exp also the hyper-connection and PLE weights, the PLE rows and conv window, the
// QSA indexer (its weights, the block keys each query scores) and sparse attention over at most the
// budget's keys; glm5_next's DSA layers read only the attended latents and the pooled indexer keys.
#pragma once

#include <cstdint>

#include "model/config.h"

namespace metrale::cli {

struct StepCost {
  double bytes = 0;  // minimum bytes read from device memory
  double flops = 0;  // floating-point operations
};

class CostModel {
 public:
  // fp8_weights: the mixer and FFN weights count 1 byte per element (FP8; their block scales and the
  // few plain norms, routers and convs are left out), the embedding and LM head 2.
  explicit CostModel(const ModelConfig& config, bool fp8_weights = false);

  // `batch` sequences each decoding one token after `context` cached tokens.
  StepCost decode(int64_t batch, int64_t context) const;
  // One sequence prefilling `tokens` tokens from an empty cache.
  StepCost prefill(int64_t tokens) const;

  double weight_bytes() const { return weight_bytes_; }

 private:
  void init_glm5_next(const ModelConfig& config);
  // Tokens a decode row of an attention layer attends to after `context` cached tokens (all of
  // them, the QSA budget's keys, or at most the DSA selection), and the cache elements it reads and
  // writes.
  double attended(int64_t context) const;
  double decode_kv_elements(int64_t context) const;

  // Bytes of the weights a step reads with `experts_per_layer` experts of each MoE layer.
  double weight_bytes_of(double experts_per_layer) const;
  // Parameters per layer kind (elements).
  double mixer_params() const;                          // every layer's attention or GDN weights
  double ffn_params(double experts_per_moe_layer) const;  // every layer's FFN weights
  void qwen4_exp_terms(const ModelConfig& config);        // the qwen4_exp members below

  double attention_params_ = 0;  // per attention layer: q (+ gate), k, v, o projections and norms
  double gdn_params_ = 0;        // per GDN layer: in/out projections, conv, gates, norms
  double gdn_state_bytes_ = 0;   // per GDN layer and sequence
  double gdn_value_heads_ = 0, gdn_key_dim_ = 0, gdn_value_dim_ = 0;
  double dense_ffn_params_ = 0;  // per dense layer
  double expert_params_ = 0;     // one expert
  double shared_expert_params_ = 0;
  double router_params_ = 0;
  int64_t num_layers_ = 0, num_attention_layers_ = 0, num_gdn_layers_ = 0;
  int64_t num_moe_layers_ = 0, num_experts_ = 0, top_k_ = 0;
  // qwen4_exp (zero otherwise).
  double hc_params_ = 0;          // all hyper-connection sites and the final mixer
  double ple_params_ = 0;         // all PLE layers' projections, norms and convs
  double ple_row_elements_ = 0;   // gathered table values per token (all PLE layers)
  double ple_state_bytes_ = 0;    // per sequence: the PLE conv windows
  double index_params_ = 0;       // per attention layer: index_qk_proj and its norms
  double index_heads_ = 0, index_dim_ = 0, compress_ratio_ = 0, budget_ = 0;
  // Keys a query at `visible` keys attends (all of them, or the budget's blocks plus the tail).
  double attended_keys(double visible) const;
  double head_params_ = 0;       // lm_head
  double hidden_ = 0, kv_row_elements_ = 0, q_dim_ = 0;
  double weight_bytes_ = 0;
  double body_byte_width_ = 2.0;  // bytes per mixer / FFN weight element
  // DSA layers (glm5_next): latent and pool-key widths, kp, and the most tokens a query attends to
  // (0: dense attention).
  double dsa_latent_ = 0, dsa_pool_key_ = 0, dsa_kpool_ = 1, dsa_attended_max_ = 0;
};

}  // namespace metrale::cli
