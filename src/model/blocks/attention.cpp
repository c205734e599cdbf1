#include "model/blocks/attention.h"

#include <cmath>

#include "kernels/attention.h"
#include "kernels/linear.h"

namespace metrale {

Attention::Attention(const AttentionConfig& config, Weights& weights, const std::string& prefix,
                     std::shared_ptr<const RotaryEmbedding> rope)
    : config_(config), rope_(std::move(rope)), scale_(1.0f / std::sqrt(static_cast<float>(config.head_dim))) {
  const int64_t h = config.hidden_size, d = config.head_dim;
  q_proj_ = weights.get(prefix + "q_proj.weight", {config.num_heads * d, h});
  k_proj_ = weights.get(prefix + "k_proj.weight", {config.num_kv_heads * d, h});
  v_proj_ = weights.get(prefix + "v_proj.weight", {config.num_kv_heads * d, h});
  o_proj_ = weights.get(prefix + "o_proj.weight", {h, config.num_heads * d});
  if (config.qk_norm) {
    q_norm_ = RmsNorm::load(weights, prefix + "q_norm.weight", d, config.rms_norm_eps, config.norm_kind);
    k_norm_ = RmsNorm::load(weights, prefix + "k_norm.weight", d, config.rms_norm_eps, config.norm_kind);
  }
}

LayerCacheSpec Attention::cache_spec() const {
  return {LayerCacheKind::kPagedKv, config_.num_kv_heads, config_.head_dim};
}

void Attention::forward(const StepContext& step, const LayerCache& cache, const Tensor& x, const Tensor& out) {
  const ForwardBatch& batch = step.batch;
  const int64_t tokens = batch.num_tokens, d = config_.head_dim;
  const DType act = step.activation_dtype;
  const Tensor q = step.workspace.alloc(act, {tokens, config_.num_heads, d});      // [T, nH, D]
  const Tensor k = step.workspace.alloc(act, {tokens, config_.num_kv_heads, d});   // [T, nKV, D]
  const Tensor v = step.workspace.alloc(act, {tokens, config_.num_kv_heads, d});   // [T, nKV, D]
  kernels::linear(x, q_proj_, q.reshape({tokens, config_.num_heads * d}));
  kernels::linear(x, k_proj_, k.reshape({tokens, config_.num_kv_heads * d}));
  kernels::linear(x, v_proj_, v.reshape({tokens, config_.num_kv_heads * d}));
  // Qwen3 normalises q and k per head before RoPE; the cache holds post-norm, post-RoPE keys.
  if (q_norm_) q_norm_->apply(q, q);
  if (k_norm_) k_norm_->apply(k, k);
  rope_->apply(q, batch.positions);
  rope_->apply(k, batch.positions);
  kernels::kv_cache_write(k, v, batch.slot_mapping, cache.k_cache, cache.v_cache);
  const Tensor attn = step.workspace.alloc(act, {tokens, config_.num_heads, d});  // [T, nH, D]
  kernels::paged_attention(q, cache.k_cache, cache.v_cache, batch.cu_q, batch.kv_lens, batch.block_tables, attn,
                           {scale_, config_.window});
  kernels::linear(attn.reshape({tokens, config_.num_heads * d}), o_proj_, out);
}

}  // namespace metrale
