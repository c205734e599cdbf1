#include "model/model_helpers.h"

#include <string>

#include "model/reference_math_helpers.h"

namespace metrale::testing {

// Reference forward (double precision, one sequence at positions 0..T-1).
std::vector<std::vector<double>> reference_logits(const TinySpec& spec, const TinyWeights& weights,
                                                  const std::vector<int32_t>& tokens) {
  using reference::Matrix, reference::matvec, reference::param, reference::rms_norm_in_place, reference::rope_in_place;
  if (spec.is_hybrid()) return hybrid_reference_logits(spec, weights, tokens);
  const size_t t_count = tokens.size(), h = static_cast<size_t>(spec.hidden_size),
               d = static_cast<size_t>(spec.head_dim);
  const size_t heads = static_cast<size_t>(spec.num_heads), kv_heads = static_cast<size_t>(spec.num_kv_heads);
  const double eps = spec.rms_norm_eps;
  constexpr double kPlainNorm = 0.0;  // qwen3's RMSNorms scale by w, not 1 + w

  Matrix hidden = reference::embed(spec, weights, tokens);
  for (int64_t layer = 0; layer < spec.num_layers; ++layer) {
    const std::string p = "layers." + std::to_string(layer) + ".";
    // Attention: q/k/v projections, per-head q/k RMSNorm, RoPE, causal GQA softmax attention, o_proj.
    Matrix q(t_count), k(t_count), v(t_count);
    for (size_t t = 0; t < t_count; ++t) {
      std::vector<double> x = hidden[t];
      rms_norm_in_place(x, 0, h, param(weights, p + "input_layernorm.weight"), eps, kPlainNorm);
      q[t] = matvec(param(weights, p + "self_attn.q_proj.weight"), x, static_cast<int64_t>(heads * d));
      k[t] = matvec(param(weights, p + "self_attn.k_proj.weight"), x, static_cast<int64_t>(kv_heads * d));
      v[t] = matvec(param(weights, p + "self_attn.v_proj.weight"), x, static_cast<int64_t>(kv_heads * d));
      for (size_t head = 0; head < heads; ++head) {
        rms_norm_in_place(q[t], head * d, d, param(weights, p + "self_attn.q_norm.weight"), eps, kPlainNorm);
        rope_in_place(q[t], head * d, d, static_cast<int64_t>(t), spec.rope_theta);
      }
      for (size_t head = 0; head < kv_heads; ++head) {
        rms_norm_in_place(k[t], head * d, d, param(weights, p + "self_attn.k_norm.weight"), eps, kPlainNorm);
        rope_in_place(k[t], head * d, d, static_cast<int64_t>(t), spec.rope_theta);
      }
    }
    for (size_t t = 0; t < t_count; ++t) {
      const std::vector<double> attn =
          reference::causal_attention(q, k, v, t, heads, kv_heads, d, spec.layer_window(layer));
      const std::vector<double> o =
          matvec(param(weights, p + "self_attn.o_proj.weight"), attn, static_cast<int64_t>(h));
      for (size_t c = 0; c < h; ++c) hidden[t][c] += o[c];
    }
    // FFN: SwiGLU MLP or MoE on the post-attention-normalised residual.
    for (size_t t = 0; t < t_count; ++t) {
      std::vector<double> x = hidden[t];
      rms_norm_in_place(x, 0, h, param(weights, p + "post_attention_layernorm.weight"), eps, kPlainNorm);
      const std::vector<double> y = spec.layer_is_moe(layer)
                                        ? reference::routed_experts(spec, weights, p, x, spec.norm_topk_prob)
                                        : reference::dense_mlp(spec, weights, p, x);
      for (size_t c = 0; c < h; ++c) hidden[t][c] += y[c];
    }
  }
  return reference::output_logits(spec, weights, hidden, kPlainNorm);
}

}  // namespace metrale::testing
