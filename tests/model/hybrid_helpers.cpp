// The double-precision reference forward of the tiny Qwen hybrids (qwen3_next, qwen3_5, qwen3_5_moe),
// written from shared/arch/qwen.md (§3.1 norms, §3.2 partial RoPE, §3.5 gated attention, §3.6
// MoE with shared expert, §4.4-§4.5 keys; §6 Gated DeltaNet in reference_math_helpers).
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "model/model_helpers.h"
#include "model/reference_math_helpers.h"

namespace metrale::testing {
namespace {

using reference::Matrix, reference::matvec, reference::param, reference::sigmoid, reference::silu;

// The hybrids' RMSNorms are zero-centred: x * rsqrt(mean(x^2) + eps) * (1 + w).
constexpr double kZeroCentredNorm = 1.0;

void zc_norm_in_place(std::vector<double>& x, size_t begin, size_t width, const std::vector<float>& w, double eps) {
  reference::rms_norm_in_place(x, begin, width, w, eps, kZeroCentredNorm);
}

// Softmax router, top-k (renormalised when asked), SwiGLU experts, plus sigmoid(x . w_sg) * shared(x).
std::vector<double> moe_with_shared(const TinySpec& spec, const TinyWeights& weights, const std::string& p,
                                    const std::vector<double>& x) {
  // qwen3_5_moe always renormalises; qwen3_next follows norm_topk_prob.
  const bool renormalise = spec.model_type == "qwen3_5_moe" || spec.norm_topk_prob;
  std::vector<double> out = reference::routed_experts(spec, weights, p, x, renormalise);
  const std::vector<double> shared = reference::swiglu(
      param(weights, p + "mlp.shared_expert.gate_proj.weight"), param(weights, p + "mlp.shared_expert.up_proj.weight"),
      param(weights, p + "mlp.shared_expert.down_proj.weight"), x, spec.shared_expert_intermediate_size);
  const double gate = sigmoid(matvec(param(weights, p + "mlp.shared_expert_gate.weight"), x, 1)[0]);
  for (size_t c = 0; c < out.size(); ++c) out[c] += gate * shared[c];
  return out;
}

// Gated attention (qwen.md §3.5) over the normalised inputs `xs` of one sequence at positions 0..T-1.
Matrix gated_attention(const TinySpec& spec, const TinyWeights& weights, const std::string& p, const Matrix& xs) {
  const size_t t_count = xs.size(), h = static_cast<size_t>(spec.hidden_size), d = static_cast<size_t>(spec.head_dim);
  const size_t heads = static_cast<size_t>(spec.num_heads), kv_heads = static_cast<size_t>(spec.num_kv_heads);
  const size_t rotary = static_cast<size_t>(spec.rotary_dim());
  const double eps = spec.rms_norm_eps;
  Matrix q(t_count), gate(t_count), k(t_count), v(t_count);
  for (size_t t = 0; t < t_count; ++t) {
    // q_proj: per head [query (d) | gate (d)].
    const std::vector<double> qg =
        matvec(param(weights, p + "self_attn.q_proj.weight"), xs[t], static_cast<int64_t>(2 * heads * d));
    q[t].resize(heads * d);
    gate[t].resize(heads * d);
    for (size_t head = 0; head < heads; ++head)
      for (size_t c = 0; c < d; ++c) {
        q[t][head * d + c] = qg[head * 2 * d + c];
        gate[t][head * d + c] = qg[head * 2 * d + d + c];
      }
    k[t] = matvec(param(weights, p + "self_attn.k_proj.weight"), xs[t], static_cast<int64_t>(kv_heads * d));
    v[t] = matvec(param(weights, p + "self_attn.v_proj.weight"), xs[t], static_cast<int64_t>(kv_heads * d));
    for (size_t head = 0; head < heads; ++head) {
      zc_norm_in_place(q[t], head * d, d, param(weights, p + "self_attn.q_norm.weight"), eps);
      reference::rope_in_place(q[t], head * d, rotary, static_cast<int64_t>(t), spec.rope_theta);
    }
    for (size_t head = 0; head < kv_heads; ++head) {
      zc_norm_in_place(k[t], head * d, d, param(weights, p + "self_attn.k_norm.weight"), eps);
      reference::rope_in_place(k[t], head * d, rotary, static_cast<int64_t>(t), spec.rope_theta);
    }
  }
  Matrix out(t_count);
  for (size_t t = 0; t < t_count; ++t) {
    std::vector<double> attn = reference::causal_attention(q, k, v, t, heads, kv_heads, d, /*window=*/0);
    for (size_t c = 0; c < heads * d; ++c) attn[c] *= sigmoid(gate[t][c]);
    out[t] = matvec(param(weights, p + "self_attn.o_proj.weight"), attn, static_cast<int64_t>(h));
  }
  return out;
}


}  // namespace

std::vector<std::vector<double>> hybrid_reference_logits(const TinySpec& spec, const TinyWeights& weights,
                                                         const std::vector<int32_t>& tokens) {
  const size_t t_count = tokens.size(), h = static_cast<size_t>(spec.hidden_size);
  const double eps = spec.rms_norm_eps;
  Matrix hidden = reference::embed(spec, weights, tokens);
  for (int64_t layer = 0; layer < spec.num_layers; ++layer) {
    const std::string p = "layers." + std::to_string(layer) + ".";
    Matrix normed = hidden;
    for (auto& row : normed) zc_norm_in_place(row, 0, h, param(weights, p + "input_layernorm.weight"), eps);
    const Matrix mixed = spec.layer_is_linear(layer) ? reference::gated_delta_net(spec, weights, p, normed, reference::GdnOutputGate::kSilu)
                                                     : gated_attention(spec, weights, p, normed);
    for (size_t t = 0; t < t_count; ++t)
      for (size_t c = 0; c < h; ++c) hidden[t][c] += mixed[t][c];
    for (size_t t = 0; t < t_count; ++t) {
      std::vector<double> x = hidden[t];
      zc_norm_in_place(x, 0, h, param(weights, p + "post_attention_layernorm.weight"), eps);
      const std::vector<double> y =
          spec.layer_is_moe(layer) ? moe_with_shared(spec, weights, p, x) : reference::dense_mlp(spec, weights, p, x);
      for (size_t c = 0; c < h; ++c) hidden[t][c] += y[c];
    }
  }
  return reference::output_logits(spec, weights, hidden, kZeroCentredNorm);
}

}  // namespace metrale::testing
