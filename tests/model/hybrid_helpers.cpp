// Tiny Qwen hybrid checkpoints (qwen3_next, qwen3_5, qwen3_5_moe) and their double-precision reference
// forward, written from shared/arch/qwen.md (§3.1 norms, §3.2 partial RoPE, §3.5 gated attention, §3.6
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

TinyWeights make_hybrid_weights(const TinySpec& spec, uint64_t seed) {
  TinyWeightMaker maker(seed);
  const int64_t h = spec.hidden_size, d = spec.head_dim;
  const int64_t hk = spec.linear_num_key_heads, hv = spec.linear_num_value_heads;
  const int64_t key_dim = hk * spec.linear_key_head_dim, value_dim = hv * spec.linear_value_head_dim;
  // Zero-centred norms hold weights near 0 (the scale is 1 + w).
  maker.add("embed_tokens.weight", {spec.vocab_size, h}, -1.0f, 1.0f);
  for (int64_t i = 0; i < spec.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    maker.add(p + "input_layernorm.weight", {h}, -0.3f, 0.3f);
    maker.add(p + "post_attention_layernorm.weight", {h}, -0.3f, 0.3f);
    if (spec.layer_is_linear(i)) {
      const std::string a = p + "linear_attn.";
      maker.add(a + "in_proj_qkv.weight", {2 * key_dim + value_dim, h}, -0.3f, 0.3f);
      maker.add(a + "in_proj_z.weight", {value_dim, h}, -0.3f, 0.3f);
      maker.add(a + "in_proj_b.weight", {hv, h}, -0.3f, 0.3f);
      maker.add(a + "in_proj_a.weight", {hv, h}, -0.3f, 0.3f);
      maker.add(a + "conv1d.weight", {2 * key_dim + value_dim, 1, spec.linear_conv_kernel_dim}, -0.6f, 0.6f);
      maker.add(a + "dt_bias", {hv}, -0.5f, 0.5f);
      maker.add(a + "A_log", {hv}, -1.0f, 0.5f);
      maker.add(a + "norm.weight", {spec.linear_value_head_dim}, 0.7f, 1.3f);
      maker.add(a + "out_proj.weight", {h, value_dim}, -0.25f, 0.25f);
    } else {
      maker.add(p + "self_attn.q_proj.weight", {2 * spec.num_heads * d, h}, -0.3f, 0.3f);
      maker.add(p + "self_attn.k_proj.weight", {spec.num_kv_heads * d, h}, -0.3f, 0.3f);
      maker.add(p + "self_attn.v_proj.weight", {spec.num_kv_heads * d, h}, -0.3f, 0.3f);
      maker.add(p + "self_attn.o_proj.weight", {h, spec.num_heads * d}, -0.25f, 0.25f);
      maker.add(p + "self_attn.q_norm.weight", {d}, -0.3f, 0.3f);
      maker.add(p + "self_attn.k_norm.weight", {d}, -0.3f, 0.3f);
    }
    if (spec.layer_is_moe(i)) {
      const int64_t shared = spec.shared_expert_intermediate_size;
      maker.add_routed_experts(spec, p);
      maker.add(p + "mlp.shared_expert.gate_proj.weight", {shared, h}, -0.3f, 0.3f);
      maker.add(p + "mlp.shared_expert.up_proj.weight", {shared, h}, -0.3f, 0.3f);
      maker.add(p + "mlp.shared_expert.down_proj.weight", {h, shared}, -0.3f, 0.3f);
      maker.add(p + "mlp.shared_expert_gate.weight", {1, h}, -0.5f, 0.5f);
    } else {
      maker.add_dense_mlp(spec, p);
    }
  }
  maker.add("norm.weight", {h}, -0.3f, 0.3f);
  if (!spec.tie_word_embeddings) maker.add("lm_head.weight", {spec.vocab_size, h}, -0.3f, 0.3f);
  return maker.take();
}

nlohmann::json hybrid_config_json(const TinySpec& spec) {
  const bool composite = spec.composite_config && spec.model_type != "qwen3_next";
  nlohmann::json text = common_config_json(spec);
  text["model_type"] = composite ? spec.model_type + "_text" : spec.model_type;
  text["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", spec.rope_theta}};
  text["max_position_embeddings"] = 512;
  text["linear_num_key_heads"] = spec.linear_num_key_heads;
  text["linear_num_value_heads"] = spec.linear_num_value_heads;
  text["linear_key_head_dim"] = spec.linear_key_head_dim;
  text["linear_value_head_dim"] = spec.linear_value_head_dim;
  text["linear_conv_kernel_dim"] = spec.linear_conv_kernel_dim;
  if (spec.layer_types.empty()) {
    text["full_attention_interval"] = spec.full_attention_interval;
  } else {
    text["layer_types"] = spec.layer_types;
  }
  if (spec.partial_rotary_factor > 0) text["rope_parameters"]["partial_rotary_factor"] = spec.partial_rotary_factor;
  if (spec.model_type == "qwen3_5_moe") {
    text["mrope_section"] = {1, 1, 0};  // ignored for text (equal position rows)
  }
  if (spec.model_type != "qwen3_5_moe") text["intermediate_size"] = spec.intermediate_size;
  if (spec.model_type != "qwen3_5") {
    text["num_experts"] = spec.num_experts;
    text["num_experts_per_tok"] = spec.top_k;
    text["moe_intermediate_size"] = spec.moe_intermediate_size;
    text["shared_expert_intermediate_size"] = spec.shared_expert_intermediate_size;
  }
  if (spec.model_type == "qwen3_next") {
    text["norm_topk_prob"] = spec.norm_topk_prob;
    text["decoder_sparse_step"] = 1;
    text["mlp_only_layers"] = spec.mlp_only_layers;
  }
  if (spec.model_type == "qwen3_5_moe") text["norm_topk_prob"] = false;  // not a qwen3_5_moe field: ignored
  if (!composite) {
    text["tie_word_embeddings"] = spec.tie_word_embeddings;
    return text;
  }
  return {{"model_type", spec.model_type},
          {"architectures",
           {spec.model_type == "qwen3_5" ? "Qwen3_5ForConditionalGeneration" : "Qwen3_5MoeForConditionalGeneration"}},
          {"text_config", text},
          {"vision_config", {{"depth", 1}}},
          {"tie_word_embeddings", spec.tie_word_embeddings}};
}

void group_gdn_projections(const TinySpec& spec, const std::string& prefix, std::vector<NamedValues>& tensors) {
  const int64_t hk = spec.linear_num_key_heads, hv = spec.linear_num_value_heads, dk = spec.linear_key_head_dim,
                dv = spec.linear_value_head_dim, ratio = hv / hk, key_dim = hk * dk;
  const int64_t h = spec.hidden_size;
  const auto take = [&](const std::string& name) {
    const auto it = std::find_if(tensors.begin(), tensors.end(), [&](const NamedValues& t) { return t.name == name; });
    METRALE_CHECK(it != tensors.end(), "no tensor {}", name);
    NamedValues taken = std::move(*it);
    tensors.erase(it);
    return taken;
  };
  const auto rows = [&](const NamedValues& t, int64_t begin, int64_t count, std::vector<float>& out) {
    out.insert(out.end(), t.values.begin() + begin * h, t.values.begin() + (begin + count) * h);
  };
  for (int64_t i = 0; i < spec.num_layers; ++i) {
    if (!spec.layer_is_linear(i)) continue;
    const std::string a = prefix + "layers." + std::to_string(i) + ".linear_attn.";
    const NamedValues qkv = take(a + "in_proj_qkv.weight"), z = take(a + "in_proj_z.weight");
    const NamedValues b = take(a + "in_proj_b.weight"), alpha = take(a + "in_proj_a.weight");
    // Per key head g: [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)] and [b_g (r) | a_g (r)] (qwen.md §6.1).
    NamedValues qkvz{a + "in_proj_qkvz.weight", {2 * key_dim + 2 * hv * dv, h}, {}};
    NamedValues ba{a + "in_proj_ba.weight", {2 * hv, h}, {}};
    for (int64_t g = 0; g < hk; ++g) {
      rows(qkv, g * dk, dk, qkvz.values);
      rows(qkv, key_dim + g * dk, dk, qkvz.values);
      rows(qkv, 2 * key_dim + g * ratio * dv, ratio * dv, qkvz.values);
      rows(z, g * ratio * dv, ratio * dv, qkvz.values);
      rows(b, g * ratio, ratio, ba.values);
      rows(alpha, g * ratio, ratio, ba.values);
    }
    tensors.push_back(std::move(qkvz));
    tensors.push_back(std::move(ba));
  }
}

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
