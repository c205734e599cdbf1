// The double-precision reference forward of the tiny Qwen hybrids (qwen3_next, qwen3_5, qwen3_5_moe),
// written from shared/arch/qwen.md (§3.1 norms, §3.2 partial RoPE, §3.5 gated attention, §3.6
// MoE with shared expert, §4.4-§4.5 keys, §6 Gated DeltaNet with the token-by-token recurrence).
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

double softplus(double v) {
  return v > 20.0 ? v : std::log1p(std::exp(v));
}

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

// Gated DeltaNet (qwen.md §6) over one sequence from zero state, token by token.
Matrix gated_delta_net(const TinySpec& spec, const TinyWeights& weights, const std::string& p, const Matrix& xs) {
  const size_t t_count = xs.size(), h = static_cast<size_t>(spec.hidden_size);
  const size_t hk = static_cast<size_t>(spec.linear_num_key_heads),
               hv = static_cast<size_t>(spec.linear_num_value_heads);
  const size_t dk = static_cast<size_t>(spec.linear_key_head_dim), dv = static_cast<size_t>(spec.linear_value_head_dim);
  const size_t kernel = static_cast<size_t>(spec.linear_conv_kernel_dim), ratio = hv / hk;
  const size_t key_dim = hk * dk, value_dim = hv * dv, conv_dim = 2 * key_dim + value_dim;
  const std::string a = p + "linear_attn.";
  const auto& conv_w = param(weights, a + "conv1d.weight");  // [conv_dim, 1, K]
  const auto& a_log = param(weights, a + "A_log");
  const auto& dt_bias = param(weights, a + "dt_bias");
  const auto& norm_w = param(weights, a + "norm.weight");
  Matrix qkv(t_count), z(t_count), b(t_count), ga(t_count);
  for (size_t t = 0; t < t_count; ++t) {
    qkv[t] = matvec(param(weights, a + "in_proj_qkv.weight"), xs[t], static_cast<int64_t>(conv_dim));
    z[t] = matvec(param(weights, a + "in_proj_z.weight"), xs[t], static_cast<int64_t>(value_dim));
    b[t] = matvec(param(weights, a + "in_proj_b.weight"), xs[t], static_cast<int64_t>(hv));
    ga[t] = matvec(param(weights, a + "in_proj_a.weight"), xs[t], static_cast<int64_t>(hv));
  }
  // State S[head] [dk][dv], starting at zero.
  std::vector<double> state(hv * dk * dv, 0.0);
  Matrix out(t_count);
  for (size_t t = 0; t < t_count; ++t) {
    // Causal depthwise conv with zero history, then silu.
    std::vector<double> u(conv_dim, 0.0);
    for (size_t c = 0; c < conv_dim; ++c) {
      double sum = 0.0;
      for (size_t j = 0; j < kernel; ++j) {
        const int64_t source = static_cast<int64_t>(t) - static_cast<int64_t>(kernel - 1) + static_cast<int64_t>(j);
        if (source >= 0) sum += conv_w[c * kernel + j] * qkv[static_cast<size_t>(source)][c];
      }
      u[c] = silu(sum);
    }
    std::vector<double> o(value_dim);
    for (size_t head = 0; head < hv; ++head) {
      const size_t key_head = head / ratio;
      std::vector<double> qn(dk), kn(dk);
      double q_sum = 0.0, k_sum = 0.0;
      for (size_t i = 0; i < dk; ++i) {
        qn[i] = u[key_head * dk + i];
        kn[i] = u[key_dim + key_head * dk + i];
        q_sum += qn[i] * qn[i];
        k_sum += kn[i] * kn[i];
      }
      for (size_t i = 0; i < dk; ++i) {
        qn[i] = qn[i] / std::sqrt(q_sum + 1e-6) / std::sqrt(static_cast<double>(dk));
        kn[i] /= std::sqrt(k_sum + 1e-6);
      }
      const double beta = sigmoid(b[t][head]);
      const double decay =
          std::exp(-std::exp(static_cast<double>(a_log[head])) * softplus(ga[t][head] + dt_bias[head]));
      double* S = state.data() + head * dk * dv;
      for (size_t i = 0; i < dk * dv; ++i) S[i] *= decay;
      for (size_t c = 0; c < dv; ++c) {
        double prediction = 0.0;
        for (size_t i = 0; i < dk; ++i) prediction += S[i * dv + c] * kn[i];
        const double delta = (u[2 * key_dim + head * dv + c] - prediction) * beta;
        for (size_t i = 0; i < dk; ++i) S[i * dv + c] += kn[i] * delta;
      }
      // o = S^T q, then the gated RMSNorm with z over dv.
      double sum = 0.0;
      for (size_t c = 0; c < dv; ++c) {
        double value = 0.0;
        for (size_t i = 0; i < dk; ++i) value += S[i * dv + c] * qn[i];
        o[head * dv + c] = value;
        sum += value * value;
      }
      const double inv = 1.0 / std::sqrt(sum / static_cast<double>(dv) + spec.rms_norm_eps);
      for (size_t c = 0; c < dv; ++c) o[head * dv + c] = norm_w[c] * o[head * dv + c] * inv * silu(z[t][head * dv + c]);
    }
    out[t] = matvec(param(weights, a + "out_proj.weight"), o, static_cast<int64_t>(h));
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
    const Matrix mixed = spec.layer_is_linear(layer) ? gated_delta_net(spec, weights, p, normed)
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
