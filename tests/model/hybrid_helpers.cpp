// Tiny Qwen hybrid checkpoints (qwen3_next, qwen3_5, qwen3_5_moe) and their double-precision reference
// forward, written from shared/arch/qwen.md (§3.1 norms, §3.2 partial RoPE, §3.5 gated attention, §3.6
// MoE with shared expert, §4.4-§4.5 keys, §6 Gated DeltaNet with the token-by-token recurrence).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/dtype.h"
#include "core/error.h"
#include "model/model_helpers.h"

namespace metrale::testing {
namespace {

using Matrix = std::vector<std::vector<double>>;  // [rows][cols]

const std::vector<float>& param(const TinyWeights& weights, const std::string& key) {
  return weights.at(key).values;
}

// y = x W^T with W [out, in] row-major.
std::vector<double> matvec(const std::vector<float>& w, const std::vector<double>& x, int64_t out) {
  const size_t in = x.size();
  std::vector<double> y(static_cast<size_t>(out), 0.0);
  for (size_t o = 0; o < y.size(); ++o)
    for (size_t i = 0; i < in; ++i) y[o] += static_cast<double>(w[o * in + i]) * x[i];
  return y;
}

double sigmoid(double v) {
  return 1.0 / (1.0 + std::exp(-v));
}
double silu(double v) {
  return v * sigmoid(v);
}
double softplus(double v) {
  return v > 20.0 ? v : std::log1p(std::exp(v));
}

// Zero-centred RMSNorm over `width` values at `begin`: x * rsqrt(mean(x^2) + eps) * (1 + w).
void zc_norm_in_place(std::vector<double>& x, size_t begin, size_t width, const std::vector<float>& w, double eps) {
  double sum = 0.0;
  for (size_t i = 0; i < width; ++i) sum += x[begin + i] * x[begin + i];
  const double inv = 1.0 / std::sqrt(sum / static_cast<double>(width) + eps);
  for (size_t i = 0; i < width; ++i) x[begin + i] = x[begin + i] * inv * (1.0 + w[i]);
}

// Rotate-half RoPE on the first `rotary` channels of the head at `begin` (channel j pairs with
// j + rotary/2, inv_freq_j = theta^(-2j/rotary)); the other channels pass through.
void partial_rope_in_place(std::vector<double>& x, size_t begin, size_t rotary, int64_t position, double theta) {
  const size_t half = rotary / 2;
  for (size_t j = 0; j < half; ++j) {
    const double angle =
        static_cast<double>(position) / std::pow(theta, static_cast<double>(2 * j) / static_cast<double>(rotary));
    const double c = std::cos(angle), s = std::sin(angle);
    const double a = x[begin + j], b = x[begin + j + half];
    x[begin + j] = a * c - b * s;
    x[begin + j + half] = b * c + a * s;
  }
}

std::vector<double> swiglu(const std::vector<float>& gate, const std::vector<float>& up, const std::vector<float>& down,
                           const std::vector<double>& x, int64_t inter) {
  const std::vector<double> g = matvec(gate, x, inter), u = matvec(up, x, inter);
  std::vector<double> act(g.size());
  for (size_t i = 0; i < g.size(); ++i) act[i] = silu(g[i]) * u[i];
  return matvec(down, act, static_cast<int64_t>(x.size()));
}

// Softmax router, top-k (renormalised when asked), SwiGLU experts, plus sigmoid(x . w_sg) * shared(x).
std::vector<double> moe_with_shared(const TinySpec& spec, const TinyWeights& weights, const std::string& p,
                                    const std::vector<double>& x) {
  const std::vector<double> logits = matvec(param(weights, p + "mlp.gate.weight"), x, spec.num_experts);
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  std::vector<double> probs(logits.size());
  double sum = 0.0;
  for (size_t e = 0; e < probs.size(); ++e) sum += (probs[e] = std::exp(logits[e] - max_logit));
  for (auto& prob : probs) prob /= sum;
  std::vector<int64_t> order(probs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return probs[static_cast<size_t>(a)] > probs[static_cast<size_t>(b)]; });
  double selected = 0.0;
  for (int64_t j = 0; j < spec.top_k; ++j) selected += probs[static_cast<size_t>(order[static_cast<size_t>(j)])];
  // qwen3_5_moe always renormalises; qwen3_next follows norm_topk_prob.
  const bool renormalise = spec.model_type == "qwen3_5_moe" || spec.norm_topk_prob;
  std::vector<double> out(x.size(), 0.0);
  for (int64_t j = 0; j < spec.top_k; ++j) {
    const int64_t e = order[static_cast<size_t>(j)];
    const double weight = probs[static_cast<size_t>(e)] / (renormalise ? selected : 1.0);
    const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
    const std::vector<double> y = swiglu(param(weights, ep + "gate_proj.weight"), param(weights, ep + "up_proj.weight"),
                                         param(weights, ep + "down_proj.weight"), x, spec.moe_intermediate_size);
    for (size_t c = 0; c < out.size(); ++c) out[c] += weight * y[c];
  }
  const std::vector<double> shared = swiglu(
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
  const size_t group = heads / kv_heads, rotary = static_cast<size_t>(spec.rotary_dim());
  const double eps = spec.rms_norm_eps, scale = 1.0 / std::sqrt(static_cast<double>(d));
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
      partial_rope_in_place(q[t], head * d, rotary, static_cast<int64_t>(t), spec.rope_theta);
    }
    for (size_t head = 0; head < kv_heads; ++head) {
      zc_norm_in_place(k[t], head * d, d, param(weights, p + "self_attn.k_norm.weight"), eps);
      partial_rope_in_place(k[t], head * d, rotary, static_cast<int64_t>(t), spec.rope_theta);
    }
  }
  Matrix out(t_count);
  for (size_t t = 0; t < t_count; ++t) {
    std::vector<double> attn(heads * d, 0.0);
    for (size_t head = 0; head < heads; ++head) {
      const size_t kvh = head / group;
      std::vector<double> scores(t + 1);
      double max_score = -INFINITY;
      for (size_t j = 0; j <= t; ++j) {
        double dot = 0.0;
        for (size_t c = 0; c < d; ++c) dot += q[t][head * d + c] * k[j][kvh * d + c];
        scores[j] = dot * scale;
        max_score = std::max(max_score, scores[j]);
      }
      double denom = 0.0;
      for (auto& s : scores) denom += (s = std::exp(s - max_score));
      for (size_t j = 0; j <= t; ++j)
        for (size_t c = 0; c < d; ++c) attn[head * d + c] += scores[j] / denom * v[j][kvh * d + c];
    }
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
  std::mt19937_64 rng(seed);
  TinyWeights weights;
  const auto add = [&](const std::string& key, std::vector<int64_t> shape, float lo, float hi) {
    std::uniform_real_distribution<float> dist(lo, hi);
    HostWeight w{std::move(shape), {}};
    const int64_t count = std::accumulate(w.shape.begin(), w.shape.end(), int64_t{1}, std::multiplies<>());
    w.values.resize(static_cast<size_t>(count));
    for (auto& v : w.values) {
      do v = round_to_bf16(dist(rng));
      while (v == 0.0f);
    }
    weights[key] = std::move(w);
  };
  const int64_t h = spec.hidden_size, d = spec.head_dim;
  const int64_t hk = spec.linear_num_key_heads, hv = spec.linear_num_value_heads;
  const int64_t key_dim = hk * spec.linear_key_head_dim, value_dim = hv * spec.linear_value_head_dim;
  // Zero-centred norms hold weights near 0 (the scale is 1 + w).
  add("embed_tokens.weight", {spec.vocab_size, h}, -1.0f, 1.0f);
  for (int64_t i = 0; i < spec.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {h}, -0.3f, 0.3f);
    add(p + "post_attention_layernorm.weight", {h}, -0.3f, 0.3f);
    if (spec.layer_is_linear(i)) {
      const std::string a = p + "linear_attn.";
      add(a + "in_proj_qkv.weight", {2 * key_dim + value_dim, h}, -0.3f, 0.3f);
      add(a + "in_proj_z.weight", {value_dim, h}, -0.3f, 0.3f);
      add(a + "in_proj_b.weight", {hv, h}, -0.3f, 0.3f);
      add(a + "in_proj_a.weight", {hv, h}, -0.3f, 0.3f);
      add(a + "conv1d.weight", {2 * key_dim + value_dim, 1, spec.linear_conv_kernel_dim}, -0.6f, 0.6f);
      add(a + "dt_bias", {hv}, -0.5f, 0.5f);
      add(a + "A_log", {hv}, -1.0f, 0.5f);
      add(a + "norm.weight", {spec.linear_value_head_dim}, 0.7f, 1.3f);
      add(a + "out_proj.weight", {h, value_dim}, -0.25f, 0.25f);
    } else {
      add(p + "self_attn.q_proj.weight", {2 * spec.num_heads * d, h}, -0.3f, 0.3f);
      add(p + "self_attn.k_proj.weight", {spec.num_kv_heads * d, h}, -0.3f, 0.3f);
      add(p + "self_attn.v_proj.weight", {spec.num_kv_heads * d, h}, -0.3f, 0.3f);
      add(p + "self_attn.o_proj.weight", {h, spec.num_heads * d}, -0.25f, 0.25f);
      add(p + "self_attn.q_norm.weight", {d}, -0.3f, 0.3f);
      add(p + "self_attn.k_norm.weight", {d}, -0.3f, 0.3f);
    }
    if (spec.layer_is_moe(i)) {
      const int64_t inter = spec.moe_intermediate_size, shared = spec.shared_expert_intermediate_size;
      add(p + "mlp.gate.weight", {spec.num_experts, h}, -0.5f, 0.5f);
      for (int64_t e = 0; e < spec.num_experts; ++e) {
        const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
        add(ep + "gate_proj.weight", {inter, h}, -0.3f, 0.3f);
        add(ep + "up_proj.weight", {inter, h}, -0.3f, 0.3f);
        add(ep + "down_proj.weight", {h, inter}, -0.3f, 0.3f);
      }
      add(p + "mlp.shared_expert.gate_proj.weight", {shared, h}, -0.3f, 0.3f);
      add(p + "mlp.shared_expert.up_proj.weight", {shared, h}, -0.3f, 0.3f);
      add(p + "mlp.shared_expert.down_proj.weight", {h, shared}, -0.3f, 0.3f);
      add(p + "mlp.shared_expert_gate.weight", {1, h}, -0.5f, 0.5f);
    } else {
      add(p + "mlp.gate_proj.weight", {spec.intermediate_size, h}, -0.3f, 0.3f);
      add(p + "mlp.up_proj.weight", {spec.intermediate_size, h}, -0.3f, 0.3f);
      add(p + "mlp.down_proj.weight", {h, spec.intermediate_size}, -0.25f, 0.25f);
    }
  }
  add("norm.weight", {h}, -0.3f, 0.3f);
  if (!spec.tie_word_embeddings) add("lm_head.weight", {spec.vocab_size, h}, -0.3f, 0.3f);
  return weights;
}

nlohmann::json hybrid_config_json(const TinySpec& spec) {
  const bool composite = spec.composite_config && spec.model_type != "qwen3_next";
  nlohmann::json text = {{"model_type", composite ? spec.model_type + "_text" : spec.model_type},
                         {"vocab_size", spec.vocab_size},
                         {"hidden_size", spec.hidden_size},
                         {"num_hidden_layers", spec.num_layers},
                         {"num_attention_heads", spec.num_heads},
                         {"num_key_value_heads", spec.num_kv_heads},
                         {"head_dim", spec.head_dim},
                         {"rms_norm_eps", spec.rms_norm_eps},
                         {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", spec.rope_theta}}},
                         {"max_position_embeddings", 512},
                         {"hidden_act", "silu"},
                         {"linear_num_key_heads", spec.linear_num_key_heads},
                         {"linear_num_value_heads", spec.linear_num_value_heads},
                         {"linear_key_head_dim", spec.linear_key_head_dim},
                         {"linear_value_head_dim", spec.linear_value_head_dim},
                         {"linear_conv_kernel_dim", spec.linear_conv_kernel_dim},
                         {"dtype", "bfloat16"},
                         {"bos_token_id", 1},
                         {"eos_token_id", 2}};
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
  Matrix hidden(t_count, std::vector<double>(h));
  const auto& embed = param(weights, "embed_tokens.weight");
  for (size_t t = 0; t < t_count; ++t)
    for (size_t c = 0; c < h; ++c) hidden[t][c] = embed[static_cast<size_t>(tokens[t]) * h + c];
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
          spec.layer_is_moe(layer)
              ? moe_with_shared(spec, weights, p, x)
              : swiglu(param(weights, p + "mlp.gate_proj.weight"), param(weights, p + "mlp.up_proj.weight"),
                       param(weights, p + "mlp.down_proj.weight"), x, spec.intermediate_size);
      for (size_t c = 0; c < h; ++c) hidden[t][c] += y[c];
    }
  }
  const auto& head = param(weights, spec.tie_word_embeddings ? "embed_tokens.weight" : "lm_head.weight");
  Matrix logits(t_count);
  for (size_t t = 0; t < t_count; ++t) {
    std::vector<double> x = hidden[t];
    zc_norm_in_place(x, 0, h, param(weights, "norm.weight"), eps);
    logits[t] = matvec(head, x, spec.vocab_size);
  }
  return logits;
}

}  // namespace metrale::testing
