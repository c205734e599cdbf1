#include "model/glm5_reference_helpers.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "model/reference_math_helpers.h"

namespace metrale::testing {
namespace {

using reference::matvec;
using reference::param;
using reference::sigmoid;
using reference::silu;
using Matrix = std::vector<std::vector<double>>;
using Selection = std::vector<std::vector<int64_t>>;  // per query: the attended token positions

std::vector<double> rms_norm(std::vector<double> x, const std::vector<float>& w, double eps) {
  reference::rms_norm_in_place(x, 0, x.size(), w, eps, 0.0);
  return x;
}

const std::vector<float>& p_(const TinyWeights& weights, const std::string& key) { return param(weights, key); }

// §2.5, the recurrence token by token.
Matrix kda(const TinyGlm5Spec& spec, const TinyWeights& w, const std::string& p, const Matrix& x) {
  const int64_t T = static_cast<int64_t>(x.size()), H = spec.linear_num_heads, d = spec.linear_head_dim;
  const int64_t P = spec.linear_dim(), K = spec.linear_conv_kernel, D = spec.hidden_size;
  Matrix u(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    const auto& xt = x[static_cast<size_t>(t)];
    std::vector<double> row;
    for (const char* name : {"q_proj.weight", "k_proj.weight", "v_proj.weight"}) {
      const auto part = matvec(p_(w, p + name), xt, P);
      row.insert(row.end(), part.begin(), part.end());
    }
    u[static_cast<size_t>(t)] = row;
  }
  const auto& conv = p_(w, p + "conv1d.weight");  // [3P, 1, K]
  const auto& dt_bias = p_(w, p + "forget_gate.dt_bias");
  const auto& a_log = p_(w, p + "forget_gate.A_log");
  std::vector<std::vector<std::vector<double>>> S(static_cast<size_t>(H),
                                                  std::vector<std::vector<double>>(static_cast<size_t>(d),
                                                                                   std::vector<double>(static_cast<size_t>(d), 0.0)));
  Matrix out(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    const auto& xt = x[static_cast<size_t>(t)];
    std::vector<double> c(static_cast<size_t>(3 * P));
    for (int64_t ch = 0; ch < 3 * P; ++ch) {
      double sum = 0.0;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t src = t - K + 1 + j;
        if (src >= 0) sum += conv[static_cast<size_t>(ch * K + j)] * u[static_cast<size_t>(src)][static_cast<size_t>(ch)];
      }
      c[static_cast<size_t>(ch)] = silu(sum);
    }
    const auto fa = matvec(p_(w, p + "forget_gate.f_a_proj.weight"), xt, d);
    const auto f = matvec(p_(w, p + "forget_gate.f_b_proj.weight"), fa, P);
    const auto b = matvec(p_(w, p + "b_proj.weight"), xt, H);
    const auto ga = matvec(p_(w, p + "g_a_proj.weight"), xt, d);
    const auto gamma = matvec(p_(w, p + "g_b_proj.weight"), ga, P);
    std::vector<double> y(static_cast<size_t>(P));
    for (int64_t h = 0; h < H; ++h) {
      const double A = std::exp(static_cast<double>(a_log[static_cast<size_t>(h)]));
      const double beta = sigmoid(b[static_cast<size_t>(h)]);
      std::vector<double> q(static_cast<size_t>(d)), k(static_cast<size_t>(d)), v(static_cast<size_t>(d)),
          g(static_cast<size_t>(d));
      double qq = 0.0, kk = 0.0;
      for (int64_t i = 0; i < d; ++i) {
        q[static_cast<size_t>(i)] = c[static_cast<size_t>(h * d + i)];
        k[static_cast<size_t>(i)] = c[static_cast<size_t>(P + h * d + i)];
        v[static_cast<size_t>(i)] = c[static_cast<size_t>(2 * P + h * d + i)];
        qq += q[static_cast<size_t>(i)] * q[static_cast<size_t>(i)];
        kk += k[static_cast<size_t>(i)] * k[static_cast<size_t>(i)];
        const double phi = f[static_cast<size_t>(h * d + i)] + dt_bias[static_cast<size_t>(h * d + i)];
        if (spec.linear_lower_bound) {
          g[static_cast<size_t>(i)] = *spec.linear_lower_bound * sigmoid(A * phi);
        } else {
          g[static_cast<size_t>(i)] = -A * (phi > 20.0 ? phi : std::log1p(std::exp(phi)));
        }
      }
      const double qs = 1.0 / std::sqrt(qq + 1e-6) / std::sqrt(static_cast<double>(d)), ks = 1.0 / std::sqrt(kk + 1e-6);
      for (auto& e : q) e *= qs;
      for (auto& e : k) e *= ks;
      auto& s = S[static_cast<size_t>(h)];
      for (int64_t i = 0; i < d; ++i)
        for (int64_t j = 0; j < d; ++j) s[static_cast<size_t>(i)][static_cast<size_t>(j)] *= std::exp(g[static_cast<size_t>(i)]);
      for (int64_t j = 0; j < d; ++j) {
        double pj = 0.0;
        for (int64_t i = 0; i < d; ++i) pj += s[static_cast<size_t>(i)][static_cast<size_t>(j)] * k[static_cast<size_t>(i)];
        const double delta = beta * (v[static_cast<size_t>(j)] - pj);
        for (int64_t i = 0; i < d; ++i) s[static_cast<size_t>(i)][static_cast<size_t>(j)] += k[static_cast<size_t>(i)] * delta;
      }
      std::vector<double> o(static_cast<size_t>(d), 0.0);
      double oo = 0.0;
      for (int64_t j = 0; j < d; ++j) {
        for (int64_t i = 0; i < d; ++i) o[static_cast<size_t>(j)] += s[static_cast<size_t>(i)][static_cast<size_t>(j)] * q[static_cast<size_t>(i)];
        oo += o[static_cast<size_t>(j)] * o[static_cast<size_t>(j)];
      }
      const double inv = 1.0 / std::sqrt(oo / static_cast<double>(d) + spec.rms_norm_eps);
      const auto& norm_w = p_(w, p + "o_norm.weight");
      for (int64_t j = 0; j < d; ++j) {
        y[static_cast<size_t>(h * d + j)] = norm_w[static_cast<size_t>(j)] * o[static_cast<size_t>(j)] * inv *
                                             sigmoid(gamma[static_cast<size_t>(h * d + j)]);
      }
    }
    out[static_cast<size_t>(t)] = matvec(p_(w, p + "o_proj.weight"), y, D);
  }
  return out;
}

// §2.6: the selection of every query (full indexer), tokens of the chosen pools plus the tail.
Selection dsa_select(const TinyGlm5Spec& spec, const TinyWeights& w, const std::string& p, const Matrix& x,
                     const Matrix& c_q) {
  const int64_t T = static_cast<int64_t>(x.size()), HI = spec.index_n_heads, dI = spec.index_head_dim;
  const int64_t kp = spec.index_kpool, K = spec.index_topk / kp, D = spec.hidden_size;
  (void)D;
  const std::string ip = p + "indexer.";
  Matrix k_index(static_cast<size_t>(T)), gate(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    auto k = matvec(p_(w, ip + "wk.weight"), x[static_cast<size_t>(t)], dI);
    double mean = std::accumulate(k.begin(), k.end(), 0.0) / static_cast<double>(dI), var = 0.0;
    for (const double e : k) var += (e - mean) * (e - mean);
    var /= static_cast<double>(dI);
    for (int64_t i = 0; i < dI; ++i) {
      k[static_cast<size_t>(i)] = (k[static_cast<size_t>(i)] - mean) / std::sqrt(var + 1e-6) *
                                      p_(w, ip + "k_norm.weight")[static_cast<size_t>(i)] +
                                  p_(w, ip + "k_norm.bias")[static_cast<size_t>(i)];
    }
    k_index[static_cast<size_t>(t)] = k;
    gate[static_cast<size_t>(t)] = matvec(p_(w, ip + "index_kpool_compress_gate"), x[static_cast<size_t>(t)], dI);
  }
  const auto& ape = p_(w, ip + "index_kpool_compress_ape");
  const int64_t pools = T / kp;
  Matrix pool_keys(static_cast<size_t>(pools), std::vector<double>(static_cast<size_t>(dI), 0.0));
  for (int64_t q = 0; q < pools; ++q) {
    for (int64_t i = 0; i < dI; ++i) {
      double mx = -INFINITY;
      std::vector<double> logits(static_cast<size_t>(kp));
      for (int64_t j = 0; j < kp; ++j) {
        logits[static_cast<size_t>(j)] =
            gate[static_cast<size_t>(q * kp + j)][static_cast<size_t>(i)] + ape[static_cast<size_t>(j * dI + i)];
        mx = std::max(mx, logits[static_cast<size_t>(j)]);
      }
      double denom = 0.0;
      for (auto& l : logits) denom += (l = std::exp(l - mx));
      for (int64_t j = 0; j < kp; ++j) {
        pool_keys[static_cast<size_t>(q)][static_cast<size_t>(i)] +=
            logits[static_cast<size_t>(j)] / denom * k_index[static_cast<size_t>(q * kp + j)][static_cast<size_t>(i)];
      }
    }
  }
  Selection selection(static_cast<size_t>(T));
  for (int64_t s = 0; s < T; ++s) {
    const auto q_index = matvec(p_(w, ip + "wq_b.weight"), c_q[static_cast<size_t>(s)], HI * dI);
    const auto omega = matvec(p_(w, ip + "weights_proj.weight"), x[static_cast<size_t>(s)], HI);
    const int64_t candidates = (s + 1) / kp;
    std::vector<std::pair<double, int64_t>> scored;
    for (int64_t q = 0; q < candidates; ++q) {
      double score = 0.0;
      for (int64_t h = 0; h < HI; ++h) {
        double dot = 0.0;
        for (int64_t i = 0; i < dI; ++i) dot += q_index[static_cast<size_t>(h * dI + i)] * pool_keys[static_cast<size_t>(q)][static_cast<size_t>(i)];
        score += omega[static_cast<size_t>(h)] / std::sqrt(static_cast<double>(HI)) *
                 std::max(0.0, dot / std::sqrt(static_cast<double>(dI)));
      }
      scored.emplace_back(score, q);
    }
    std::stable_sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    std::vector<int64_t>& attended = selection[static_cast<size_t>(s)];
    for (size_t i = 0; i < scored.size() && static_cast<int64_t>(i) < K; ++i) {
      for (int64_t j = 0; j < kp; ++j) attended.push_back(scored[i].second * kp + j);
    }
    for (int64_t t = candidates * kp; t <= s; ++t) attended.push_back(t);  // the tail
    std::sort(attended.begin(), attended.end());
  }
  return selection;
}

// §2.6.1 with the selection of each query; `selection` is filled (full) or read (shared).
Matrix dsa(const TinyGlm5Spec& spec, const TinyWeights& w, const std::string& p, const Matrix& x, bool shared,
           Selection& selection) {
  const int64_t T = static_cast<int64_t>(x.size()), H = spec.num_heads, dn = spec.qk_nope_head_dim;
  const int64_t dv = spec.v_head_dim, r = spec.kv_lora_rank, rq = spec.q_lora_rank, D = spec.hidden_size;
  Matrix c_q(static_cast<size_t>(T)), keys(static_cast<size_t>(T)), values(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    c_q[static_cast<size_t>(t)] = rms_norm(matvec(p_(w, p + "q_a_proj.weight"), x[static_cast<size_t>(t)], rq),
                                           p_(w, p + "q_a_layernorm.weight"), spec.rms_norm_eps);
    const auto c = rms_norm(matvec(p_(w, p + "kv_a_proj_with_mqa.weight"), x[static_cast<size_t>(t)], r),
                            p_(w, p + "kv_a_layernorm.weight"), spec.rms_norm_eps);
    const auto kv = matvec(p_(w, p + "kv_b_proj.weight"), c, H * (dn + dv));
    for (int64_t h = 0; h < H; ++h) {
      const auto at = kv.begin() + h * (dn + dv);
      keys[static_cast<size_t>(t)].insert(keys[static_cast<size_t>(t)].end(), at, at + dn);
      values[static_cast<size_t>(t)].insert(values[static_cast<size_t>(t)].end(), at + dn, at + dn + dv);
    }
  }
  if (!shared) selection = dsa_select(spec, w, p, x, c_q);
  Matrix out(static_cast<size_t>(T));
  for (int64_t s = 0; s < T; ++s) {
    const auto q = matvec(p_(w, p + "q_b_proj.weight"), c_q[static_cast<size_t>(s)], H * dn);
    std::vector<double> o(static_cast<size_t>(H * dv), 0.0);
    const auto& attended = selection[static_cast<size_t>(s)];
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> scores;
      double mx = -INFINITY;
      for (const int64_t t : attended) {
        double dot = 0.0;
        for (int64_t i = 0; i < dn; ++i) {
          dot += q[static_cast<size_t>(h * dn + i)] * keys[static_cast<size_t>(t)][static_cast<size_t>(h * dn + i)];
        }
        scores.push_back(dot / std::sqrt(static_cast<double>(dn)));
        mx = std::max(mx, scores.back());
      }
      double denom = 0.0;
      for (auto& e : scores) denom += (e = std::exp(e - mx));
      for (size_t a = 0; a < attended.size(); ++a) {
        for (int64_t i = 0; i < dv; ++i) {
          o[static_cast<size_t>(h * dv + i)] +=
              scores[a] / denom * values[static_cast<size_t>(attended[a])][static_cast<size_t>(h * dv + i)];
        }
      }
    }
    out[static_cast<size_t>(s)] = matvec(p_(w, p + "o_proj.weight"), o, D);
  }
  return out;
}

std::vector<double> clamped_swiglu(const TinyGlm5Spec& spec, const std::vector<float>& gate, const std::vector<float>& up,
                                   const std::vector<float>& down, const std::vector<double>& x, int64_t inter) {
  const double L = spec.swiglu_limit;
  auto g = matvec(gate, x, inter), u = matvec(up, x, inter);
  std::vector<double> act(g.size());
  for (size_t i = 0; i < g.size(); ++i) act[i] = silu(std::min(g[i], L)) * std::clamp(u[i], -L, L);
  return matvec(down, act, static_cast<int64_t>(x.size()));
}

// §1: the DeepSeek-V3 router, routed experts and the shared expert.
std::vector<double> ffn(const TinyGlm5Spec& spec, const TinyWeights& w, const std::string& p, bool moe,
                        const std::vector<double>& x) {
  if (!moe) {
    return clamped_swiglu(spec, p_(w, p + "mlp.gate_proj.weight"), p_(w, p + "mlp.up_proj.weight"),
                          p_(w, p + "mlp.down_proj.weight"), x, spec.intermediate_size);
  }
  const int64_t E = spec.num_experts, k = spec.top_k, groups = spec.n_group, per_group = E / groups;
  const auto z = matvec(p_(w, p + "mlp.gate.weight"), x, E);
  const auto& bias = p_(w, p + "mlp.gate.e_score_correction_bias");
  std::vector<double> score(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    score[static_cast<size_t>(e)] = sigmoid(z[static_cast<size_t>(e)]);
    choice[static_cast<size_t>(e)] = score[static_cast<size_t>(e)] + bias[static_cast<size_t>(e)];
  }
  std::vector<std::pair<double, int64_t>> group_scores;
  for (int64_t g = 0; g < groups; ++g) {
    std::vector<double> members(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
    std::sort(members.rbegin(), members.rend());
    group_scores.emplace_back(members[0] + (members.size() > 1 ? members[1] : 0.0), g);
  }
  std::stable_sort(group_scores.begin(), group_scores.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::set<int64_t> kept_groups;
  for (int64_t g = 0; g < spec.topk_group; ++g) kept_groups.insert(group_scores[static_cast<size_t>(g)].second);
  std::vector<std::pair<double, int64_t>> candidates;
  for (int64_t e = 0; e < E; ++e) {
    if (kept_groups.count(e / per_group)) candidates.emplace_back(choice[static_cast<size_t>(e)], e);
  }
  std::stable_sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  double total = 0.0;
  for (int64_t j = 0; j < k; ++j) total += score[static_cast<size_t>(candidates[static_cast<size_t>(j)].second)];
  std::vector<double> y(x.size(), 0.0);
  for (int64_t j = 0; j < k; ++j) {
    const int64_t e = candidates[static_cast<size_t>(j)].second;
    double weight = score[static_cast<size_t>(e)];
    if (spec.norm_topk_prob) weight /= total + 1e-20;
    weight *= spec.routed_scaling_factor;
    const std::string key = p + "mlp.experts." + std::to_string(e) + ".";
    const auto out = clamped_swiglu(spec, p_(w, key + "gate_proj.weight"), p_(w, key + "up_proj.weight"),
                                    p_(w, key + "down_proj.weight"), x, spec.moe_intermediate_size);
    for (size_t i = 0; i < y.size(); ++i) y[i] += weight * out[i];
  }
  const auto shared = clamped_swiglu(spec, p_(w, p + "mlp.shared_experts.gate_proj.weight"),
                                     p_(w, p + "mlp.shared_experts.up_proj.weight"),
                                     p_(w, p + "mlp.shared_experts.down_proj.weight"), x,
                                     spec.moe_intermediate_size * spec.n_shared_experts);
  for (size_t i = 0; i < y.size(); ++i) y[i] += shared[i];
  return y;
}

// §2.4: the maps of one site for streams X [n][D].
struct HcMaps {
  std::vector<double> pre, post;
  Matrix M;  // [a][c]
};
HcMaps hc_maps(const TinyGlm5Spec& spec, const TinyWeights& w, const std::string& p, const Matrix& X) {
  const int64_t n = spec.hc_mult, D = spec.hidden_size;
  std::vector<double> f;
  for (const auto& stream : X) f.insert(f.end(), stream.begin(), stream.end());
  double ms = 0.0;
  for (const double v : f) ms += v * v;
  const double inv = 1.0 / std::sqrt(ms / static_cast<double>(n * D) + spec.rms_norm_eps);
  for (auto& v : f) v *= inv;
  const auto m = matvec(p_(w, p + "fn"), f, (2 + n) * n);
  const auto& base = p_(w, p + "base");
  const auto& scale = p_(w, p + "scale");
  HcMaps maps;
  for (int64_t j = 0; j < n; ++j) {
    maps.pre.push_back(sigmoid(m[static_cast<size_t>(j)] * scale[0] + base[static_cast<size_t>(j)]) + spec.hc_eps);
    maps.post.push_back(2.0 * sigmoid(m[static_cast<size_t>(n + j)] * scale[1] + base[static_cast<size_t>(n + j)]));
  }
  const double eps = spec.hc_eps;
  maps.M.assign(static_cast<size_t>(n), std::vector<double>(static_cast<size_t>(n)));
  for (int64_t a = 0; a < n; ++a) {
    double mx = -INFINITY;
    for (int64_t c = 0; c < n; ++c) {
      const size_t at = static_cast<size_t>(2 * n + a * n + c);
      maps.M[static_cast<size_t>(a)][static_cast<size_t>(c)] = m[at] * scale[2] + base[at];
      mx = std::max(mx, maps.M[static_cast<size_t>(a)][static_cast<size_t>(c)]);
    }
    double denom = 0.0;
    for (auto& v : maps.M[static_cast<size_t>(a)]) denom += (v = std::exp(v - mx));
    for (auto& v : maps.M[static_cast<size_t>(a)]) v = v / denom + eps;
  }
  const auto normalize_columns = [&] {
    for (int64_t c = 0; c < n; ++c) {
      double sum = 0.0;
      for (int64_t a = 0; a < n; ++a) sum += maps.M[static_cast<size_t>(a)][static_cast<size_t>(c)];
      for (int64_t a = 0; a < n; ++a) maps.M[static_cast<size_t>(a)][static_cast<size_t>(c)] /= sum + eps;
    }
  };
  normalize_columns();
  for (int64_t it = 1; it < spec.hc_sinkhorn_iters; ++it) {
    for (auto& row : maps.M) {
      const double sum = std::accumulate(row.begin(), row.end(), 0.0);
      for (auto& v : row) v /= sum + eps;
    }
    normalize_columns();
  }
  return maps;
}

// One site over all tokens: (post, M, h) = hc_pre; y = sublayer(norm(h)); X' = post y + M^T X.
template <typename Sublayer>
void hc_site(const TinyGlm5Spec& spec, const TinyWeights& w, const std::string& hc, const std::string& norm,
             std::vector<Matrix>& X, Sublayer&& sublayer) {
  const size_t T = X.size(), n = static_cast<size_t>(spec.hc_mult), D = static_cast<size_t>(spec.hidden_size);
  std::vector<HcMaps> maps;
  Matrix inputs;
  for (size_t t = 0; t < T; ++t) {
    maps.push_back(hc_maps(spec, w, hc, X[t]));
    std::vector<double> h(D, 0.0);
    for (size_t j = 0; j < n; ++j)
      for (size_t i = 0; i < D; ++i) h[i] += maps.back().pre[j] * X[t][j][i];
    inputs.push_back(rms_norm(h, p_(w, norm), spec.rms_norm_eps));
  }
  const Matrix y = sublayer(inputs);
  for (size_t t = 0; t < T; ++t) {
    Matrix next(n, std::vector<double>(D, 0.0));
    for (size_t c = 0; c < n; ++c) {
      for (size_t i = 0; i < D; ++i) {
        double v = maps[t].post[c] * y[t][i];
        for (size_t a = 0; a < n; ++a) v += maps[t].M[a][c] * X[t][a][i];
        next[c][i] = v;
      }
    }
    X[t] = next;
  }
}

std::vector<double> lm_head(const TinyGlm5Spec& spec, const TinyWeights& w, const std::vector<double>& h) {
  return matvec(p_(w, "lm_head.weight"), h, spec.vocab_size);
}

}  // namespace

Glm5Reference glm5_reference(const TinyGlm5Spec& spec, const TinyWeights& weights, const std::vector<int32_t>& tokens) {
  const size_t T = tokens.size(), n = static_cast<size_t>(spec.hc_mult), D = static_cast<size_t>(spec.hidden_size);
  const auto& embed = p_(weights, "embed_tokens.weight");
  std::vector<Matrix> X(T);
  for (size_t t = 0; t < T; ++t) {
    std::vector<double> e(embed.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(tokens[t]) * D),
                          embed.begin() + static_cast<ptrdiff_t>((static_cast<size_t>(tokens[t]) + 1) * D));
    X[t] = Matrix(n, e);
  }
  Glm5Reference result;
  Selection selection;
  bool counted = false;
  for (int64_t l = 0; l < spec.num_layers(); ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    hc_site(spec, weights, p + "attn_hc.", p + "input_layernorm.weight", X, [&](const Matrix& x) {
      if (!spec.is_dsa(l)) return kda(spec, weights, p + "self_attn.", x);
      Matrix out = dsa(spec, weights, p + "self_attn.", x, spec.shared_indexer(l), selection);
      if (!counted) {
        for (size_t s = 0; s < T; ++s) result.sparse_rows += selection[s].size() < s + 1 ? 1 : 0;
        counted = true;
      }
      return out;
    });
    hc_site(spec, weights, p + "ffn_hc.", p + "post_attention_layernorm.weight", X, [&](const Matrix& x) {
      Matrix out;
      for (const auto& row : x) out.push_back(ffn(spec, weights, p, spec.is_moe(l), row));
      return out;
    });
  }
  for (size_t t = 0; t < T; ++t) {
    std::vector<double> mean(D, 0.0);
    for (size_t j = 0; j < n; ++j)
      for (size_t i = 0; i < D; ++i) mean[i] += X[t][j][i] / static_cast<double>(n);
    result.hidden.push_back(rms_norm(mean, p_(weights, "norm.weight"), spec.rms_norm_eps));
    result.logits.push_back(lm_head(spec, weights, result.hidden.back()));
  }
  return result;
}

std::vector<std::vector<double>> glm5_mtp_reference(const TinyGlm5Spec& spec, const TinyWeights& weights,
                                                    const std::vector<int32_t>& next, const Matrix& hidden) {
  const std::string p = "layers." + std::to_string(spec.num_layers()) + ".";
  const size_t R = next.size(), D = static_cast<size_t>(spec.hidden_size);
  const auto& embed = p_(weights, "embed_tokens.weight");
  Matrix u;
  for (size_t t = 0; t < R; ++t) {
    std::vector<double> e(embed.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(next[t]) * D),
                          embed.begin() + static_cast<ptrdiff_t>((static_cast<size_t>(next[t]) + 1) * D));
    std::vector<double> joined = rms_norm(e, p_(weights, p + "enorm.weight"), spec.rms_norm_eps);
    const auto h = rms_norm(hidden[t], p_(weights, p + "hnorm.weight"), spec.rms_norm_eps);
    joined.insert(joined.end(), h.begin(), h.end());
    u.push_back(matvec(p_(weights, p + "eh_proj.weight"), joined, spec.hidden_size));
  }
  Matrix normed;
  for (const auto& row : u) normed.push_back(rms_norm(row, p_(weights, p + "input_layernorm.weight"), spec.rms_norm_eps));
  Selection selection;
  const Matrix attn = dsa(spec, weights, p + "self_attn.", normed, false, selection);
  Matrix logits;
  for (size_t t = 0; t < R; ++t) {
    for (size_t i = 0; i < D; ++i) u[t][i] += attn[t][i];
    const auto x = rms_norm(u[t], p_(weights, p + "post_attention_layernorm.weight"), spec.rms_norm_eps);
    const auto y = ffn(spec, weights, p, true, x);
    for (size_t i = 0; i < D; ++i) u[t][i] += y[i];
    logits.push_back(lm_head(spec, weights, rms_norm(u[t], p_(weights, p + "shared_head.norm.weight"), spec.rms_norm_eps)));
  }
  return logits;
}

}  // namespace metrale::testing
