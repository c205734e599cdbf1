#include "model/reference_math_helpers.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace metrale::testing::reference {

const std::vector<float>& param(const TinyWeights& weights, const std::string& key) {
  return weights.at(key).values;
}

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

void rms_norm_in_place(std::vector<double>& x, size_t begin, size_t width, const std::vector<float>& w, double eps,
                       double weight_offset) {
  double sum = 0.0;
  for (size_t i = 0; i < width; ++i) sum += x[begin + i] * x[begin + i];
  const double inv = 1.0 / std::sqrt(sum / static_cast<double>(width) + eps);
  for (size_t i = 0; i < width; ++i) x[begin + i] = x[begin + i] * inv * (weight_offset + w[i]);
}

void rope_in_place(std::vector<double>& x, size_t begin, size_t rotary, int64_t position, double theta) {
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

std::vector<double> causal_attention(const Matrix& q, const Matrix& k, const Matrix& v, size_t t, size_t heads,
                                     size_t kv_heads, size_t d, int window) {
  const size_t group = heads / kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const size_t first = window > 0 && t + 1 > static_cast<size_t>(window) ? t + 1 - static_cast<size_t>(window) : 0;
  std::vector<double> attn(heads * d, 0.0);
  for (size_t head = 0; head < heads; ++head) {
    const size_t kvh = head / group;
    std::vector<double> scores;
    double max_score = -INFINITY;
    for (size_t j = first; j <= t; ++j) {
      double dot = 0.0;
      for (size_t c = 0; c < d; ++c) dot += q[t][head * d + c] * k[j][kvh * d + c];
      scores.push_back(dot * scale);
      max_score = std::max(max_score, dot * scale);
    }
    double denom = 0.0;
    for (auto& s : scores) denom += (s = std::exp(s - max_score));
    for (size_t j = first; j <= t; ++j)
      for (size_t c = 0; c < d; ++c) attn[head * d + c] += scores[j - first] / denom * v[j][kvh * d + c];
  }
  return attn;
}

std::vector<double> swiglu(const std::vector<float>& gate, const std::vector<float>& up, const std::vector<float>& down,
                           const std::vector<double>& x, int64_t inter) {
  const std::vector<double> g = matvec(gate, x, inter), u = matvec(up, x, inter);
  std::vector<double> act(g.size());
  for (size_t i = 0; i < g.size(); ++i) act[i] = silu(g[i]) * u[i];
  return matvec(down, act, static_cast<int64_t>(x.size()));
}

std::vector<double> dense_mlp(const TinySpec& spec, const TinyWeights& weights, const std::string& p,
                              const std::vector<double>& x) {
  return swiglu(param(weights, p + "mlp.gate_proj.weight"), param(weights, p + "mlp.up_proj.weight"),
                param(weights, p + "mlp.down_proj.weight"), x, spec.intermediate_size);
}

std::vector<double> routed_experts(const TinySpec& spec, const TinyWeights& weights, const std::string& p,
                                   const std::vector<double>& x, bool renormalise) {
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
  std::vector<double> out(x.size(), 0.0);
  for (int64_t j = 0; j < spec.top_k; ++j) {
    const int64_t e = order[static_cast<size_t>(j)];
    const double weight = probs[static_cast<size_t>(e)] / (renormalise ? selected : 1.0);
    const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
    const std::vector<double> y = swiglu(param(weights, ep + "gate_proj.weight"), param(weights, ep + "up_proj.weight"),
                                         param(weights, ep + "down_proj.weight"), x, spec.moe_intermediate_size);
    for (size_t c = 0; c < out.size(); ++c) out[c] += weight * y[c];
  }
  return out;
}

Matrix embed(const TinySpec& spec, const TinyWeights& weights, const std::vector<int32_t>& tokens) {
  const size_t h = static_cast<size_t>(spec.hidden_size);
  const auto& table = param(weights, "embed_tokens.weight");
  Matrix hidden(tokens.size(), std::vector<double>(h));
  for (size_t t = 0; t < tokens.size(); ++t)
    for (size_t c = 0; c < h; ++c) hidden[t][c] = table[static_cast<size_t>(tokens[t]) * h + c];
  return hidden;
}

Matrix output_logits(const TinySpec& spec, const TinyWeights& weights, const Matrix& hidden,
                     double norm_weight_offset) {
  const auto& head = param(weights, spec.tie_word_embeddings ? "embed_tokens.weight" : "lm_head.weight");
  Matrix logits(hidden.size());
  for (size_t t = 0; t < hidden.size(); ++t) {
    std::vector<double> x = hidden[t];
    rms_norm_in_place(x, 0, x.size(), param(weights, "norm.weight"), spec.rms_norm_eps, norm_weight_offset);
    logits[t] = matvec(head, x, spec.vocab_size);
  }
  return logits;
}

namespace {
double softplus(double v) { return v > 20.0 ? v : std::log1p(std::exp(v)); }
}  // namespace

Matrix gated_delta_net(const TinySpec& spec, const TinyWeights& weights, const std::string& p, const Matrix& xs,
                       GdnOutputGate gate) {
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
      for (size_t c = 0; c < dv; ++c) {
        const double zc = z[t][head * dv + c];
        o[head * dv + c] = norm_w[c] * o[head * dv + c] * inv * (gate == GdnOutputGate::kSigmoid ? sigmoid(zc) : silu(zc));
      }
    }
    out[t] = matvec(param(weights, a + "out_proj.weight"), o, static_cast<int64_t>(h));
  }
  return out;
}

}  // namespace metrale::testing::reference
