#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "model/qwen4_reference.h"
#include "model/reference_math_helpers.h"

namespace metrale::testing {
namespace {

using reference::Matrix, reference::matvec, reference::sigmoid, reference::silu;

const std::vector<float>& param(const Qwen4Weights& w, const std::string& key) {
  return reference::param(w.floats, key);
}

// Grouped zero-centred RMSNorm (qwen.md §3.1): each of the `groups` groups of `width` values has its
// own mean square; y = x * rsqrt(mean(x^2) + eps) * (1 + w).
std::vector<double> grouped_norm(const std::vector<double>& x, size_t groups, size_t width, const std::vector<float>& w,
                                 double eps) {
  std::vector<double> y = x;
  for (size_t g = 0; g < groups; ++g) {
    double sum = 0.0;
    for (size_t i = 0; i < width; ++i) sum += x[g * width + i] * x[g * width + i];
    const double inv = 1.0 / std::sqrt(sum / static_cast<double>(width) + eps);
    for (size_t i = 0; i < width; ++i) y[g * width + i] = x[g * width + i] * inv * (1.0 + w[g * width + i]);
  }
  return y;
}

struct Connection {
  std::vector<double> x;     // [H] the site input
  std::vector<double> beta;  // [N] injection weights (empty for the final mixer)
};

// A hyper-connection (qwen.md §7.1) on the streams R [N*H] of one token.
Connection hyper_connection(const Qwen4Spec& spec, const Qwen4Weights& w, const std::string& p,
                            const std::vector<double>& streams, bool inject) {
  const auto n = static_cast<size_t>(spec.hc_count), h = static_cast<size_t>(spec.base.hidden_size);
  const std::vector<double> normed = grouped_norm(streams, n, h, param(w, p + "hc_norm.weight"), spec.base.rms_norm_eps);
  std::vector<double> a = matvec(param(w, p + "input_mix_weight_down.weight"), normed, spec.hc_lowrank);
  for (auto& v : a) v = silu(v / static_cast<double>(n));
  std::vector<double> m = matvec(param(w, p + "input_mix_weight_up.weight"), a, static_cast<int64_t>(n * h));
  Connection out;
  out.x.assign(h, 0.0);
  for (size_t s = 0; s < n; ++s)
    for (size_t c = 0; c < h; ++c) out.x[c] += sigmoid(m[s * h + c]) * normed[s * h + c] / static_cast<double>(n);
  if (inject) {
    out.beta = matvec(param(w, p + "block_inject_weight.weight"), normed, static_cast<int64_t>(n));
    for (auto& b : out.beta) b = 2.0 * sigmoid(b / static_cast<double>(n));
  }
  return out;
}

std::vector<double> moe(const Qwen4Spec& spec, const Qwen4Weights& w, const std::string& p,
                        const std::vector<double>& x) {
  const TinySpec& b = spec.base;
  std::vector<double> out = reference::routed_experts(b, w.floats, p, x, b.norm_topk_prob);
  const std::vector<double> shared =
      reference::swiglu(param(w, p + "mlp.shared_expert.gate_proj.weight"), param(w, p + "mlp.shared_expert.up_proj.weight"),
                        param(w, p + "mlp.shared_expert.down_proj.weight"), x, b.shared_expert_intermediate_size);
  const double gate = sigmoid(matvec(param(w, p + "mlp.shared_expert_gate.weight"), x, 1)[0]);
  for (size_t c = 0; c < out.size(); ++c) out[c] += gate * shared[c];
  return out;
}


// Gated attention with the QSA indexer (qwen.md §3.5, §7.3) over one sequence.
Matrix qsa_attention(const Qwen4Spec& spec, const Qwen4Weights& w, const std::string& p, const Matrix& xs) {
  const TinySpec& b = spec.base;
  const size_t t_count = xs.size(), h = static_cast<size_t>(b.hidden_size), d = static_cast<size_t>(b.head_dim);
  const size_t heads = static_cast<size_t>(b.num_heads), kv_heads = static_cast<size_t>(b.num_kv_heads);
  const size_t rotary = static_cast<size_t>(static_cast<double>(d) * b.partial_rotary_factor);
  const size_t n_idx = static_cast<size_t>(spec.indexer_heads), d_idx = static_cast<size_t>(spec.indexer_head_dim);
  const size_t c = static_cast<size_t>(spec.compress_ratio);
  const auto block_topk = spec.indexer_budget / spec.compress_ratio;
  const double eps = b.rms_norm_eps;
  const std::string a = p + "self_attn.";
  Matrix q(t_count), gate(t_count), k(t_count), v(t_count), q_idx(t_count), k_tok(t_count);
  for (size_t t = 0; t < t_count; ++t) {
    const std::vector<double> qg = matvec(param(w, a + "q_proj.weight"), xs[t], static_cast<int64_t>(2 * heads * d));
    q[t].resize(heads * d);
    gate[t].resize(heads * d);
    for (size_t head = 0; head < heads; ++head)
      for (size_t i = 0; i < d; ++i) {
        q[t][head * d + i] = qg[head * 2 * d + i];
        gate[t][head * d + i] = qg[head * 2 * d + d + i];
      }
    k[t] = matvec(param(w, a + "k_proj.weight"), xs[t], static_cast<int64_t>(kv_heads * d));
    v[t] = matvec(param(w, a + "v_proj.weight"), xs[t], static_cast<int64_t>(kv_heads * d));
    for (size_t head = 0; head < heads; ++head) {
      reference::rms_norm_in_place(q[t], head * d, d, param(w, a + "q_norm.weight"), eps, 1.0);
      reference::rope_in_place(q[t], head * d, rotary, static_cast<int64_t>(t), b.rope_theta);
    }
    for (size_t head = 0; head < kv_heads; ++head) {
      reference::rms_norm_in_place(k[t], head * d, d, param(w, a + "k_norm.weight"), eps, 1.0);
      reference::rope_in_place(k[t], head * d, rotary, static_cast<int64_t>(t), b.rope_theta);
    }
    const std::vector<double> idx =
        matvec(param(w, a + "indexer.index_qk_proj.weight"), xs[t], static_cast<int64_t>((n_idx + 1) * d_idx));
    q_idx[t].assign(idx.begin(), idx.begin() + static_cast<ptrdiff_t>(n_idx * d_idx));
    k_tok[t].assign(idx.begin() + static_cast<ptrdiff_t>(n_idx * d_idx), idx.end());
    for (size_t head = 0; head < n_idx; ++head) {
      reference::rms_norm_in_place(q_idx[t], head * d_idx, d_idx, param(w, a + "indexer.q_layernorm.weight"), eps, 1.0);
      reference::rope_in_place(q_idx[t], head * d_idx, rotary, static_cast<int64_t>(t), b.rope_theta);
    }
  }
  // Block keys over complete blocks of c tokens, RoPE at the block's first position.
  Matrix block_keys(t_count / c);
  for (size_t j = 0; j < block_keys.size(); ++j) {
    std::vector<double> mean(d_idx, 0.0);
    for (size_t i = 0; i < c; ++i)
      for (size_t e = 0; e < d_idx; ++e) mean[e] += k_tok[j * c + i][e] / static_cast<double>(c);
    reference::rms_norm_in_place(mean, 0, d_idx, param(w, a + "indexer.k_layernorm.weight"), eps, 1.0);
    reference::rope_in_place(mean, 0, rotary, static_cast<int64_t>(j * c), b.rope_theta);
    block_keys[j] = mean;
  }
  const size_t group = heads / kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Matrix out(t_count);
  for (size_t t = 0; t < t_count; ++t) {
    const size_t nb = (t + 1) / c;
    std::vector<double> scores(nb);
    for (size_t j = 0; j < nb; ++j) {
      double sum = 0.0;
      for (size_t head = 0; head < n_idx; ++head) {
        double dot = 0.0;
        for (size_t e = 0; e < d_idx; ++e) dot += q_idx[t][head * d_idx + e] * block_keys[j][e];
        sum += std::max(dot, 0.0);
      }
      scores[j] = sum / std::sqrt(static_cast<double>(d_idx));
    }
    std::vector<size_t> keys;
    for (const int64_t j : qwen4_reference_select(scores, block_topk))
      for (size_t i = 0; i < c; ++i) keys.push_back(static_cast<size_t>(j) * c + i);
    for (size_t i = nb * c; i <= t; ++i) keys.push_back(i);
    std::vector<double> attn(heads * d, 0.0);
    for (size_t head = 0; head < heads; ++head) {
      const size_t kvh = head / group;
      std::vector<double> logits;
      double max_logit = -INFINITY;
      for (const size_t j : keys) {
        double dot = 0.0;
        for (size_t e = 0; e < d; ++e) dot += q[t][head * d + e] * k[j][kvh * d + e];
        logits.push_back(dot * scale);
        max_logit = std::max(max_logit, logits.back());
      }
      double total = 0.0;
      for (auto& l : logits) total += (l = std::exp(l - max_logit));
      for (size_t i = 0; i < keys.size(); ++i)
        for (size_t e = 0; e < d; ++e) attn[head * d + e] += logits[i] / total * v[keys[i]][kvh * d + e];
    }
    for (size_t e = 0; e < heads * d; ++e) attn[e] *= sigmoid(gate[t][e]);
    out[t] = matvec(param(w, a + "o_proj.weight"), attn, static_cast<int64_t>(h));
  }
  return out;
}

// PLE (qwen.md §7.2 e-h) on the streams of one sequence: returns PLE(R) [T][N*H].
Matrix ple(const Qwen4Spec& spec, const Qwen4Weights& w, const std::string& p, int64_t ple_index,
           const std::vector<int32_t>& tokens, const Matrix& streams) {
  const TinySpec& b = spec.base;
  const size_t t_count = tokens.size(), h = static_cast<size_t>(b.hidden_size), n = static_cast<size_t>(spec.hc_count);
  const size_t heads = static_cast<size_t>(spec.ngram_heads()), d_head = static_cast<size_t>(spec.ple_embed_dim) / heads;
  const size_t width = n * h, kernel = static_cast<size_t>(spec.ple_conv_kernel);
  const size_t dilation = static_cast<size_t>(spec.ngram_size);
  const double eps = b.rms_norm_eps;
  const auto& table = param(w, p + "ple_embedding.ngram_embedding.weight");
  const auto& conv_w = param(w, p + "conv1d.weight");
  const std::vector<std::vector<int64_t>> ids = qwen4_reference_ple_ids(spec, ple_index, tokens);
  Matrix gated(t_count), conv_in(t_count);
  for (size_t t = 0; t < t_count; ++t) {
    std::vector<double> e(static_cast<size_t>(spec.ple_embed_dim));
    for (size_t head = 0; head < heads; ++head)
      for (size_t i = 0; i < d_head; ++i)
        e[head * d_head + i] = table[static_cast<size_t>(ids[t][head]) * d_head + i];
    const std::vector<double> key =
        grouped_norm(matvec(param(w, p + "key_proj.weight"), e, static_cast<int64_t>(width)), n, h,
                     param(w, p + "norm_key.weight"), eps);
    const std::vector<double> value = matvec(param(w, p + "value_proj.weight"), e, static_cast<int64_t>(h));
    const std::vector<double> query = grouped_norm(streams[t], n, h, param(w, p + "norm_query.weight"), eps);
    gated[t].assign(width, 0.0);
    for (size_t s = 0; s < n; ++s) {
      double dot = 0.0;
      for (size_t c = 0; c < h; ++c) dot += key[s * h + c] * query[s * h + c];
      dot /= std::sqrt(static_cast<double>(h));
      const double root = dot == 0.0 ? 0.0 : std::copysign(std::sqrt(std::max(std::abs(dot), 1e-6)), dot);
      for (size_t c = 0; c < h; ++c) gated[t][s * h + c] = sigmoid(root) * value[c];
    }
    conv_in[t] = grouped_norm(gated[t], n, h, param(w, p + "norm_conv.weight"), eps);
  }
  Matrix out(t_count, std::vector<double>(width));
  for (size_t t = 0; t < t_count; ++t) {
    for (size_t c = 0; c < width; ++c) {
      double sum = 0.0;
      for (size_t j = 0; j < kernel; ++j) {
        const int64_t source = static_cast<int64_t>(t) - static_cast<int64_t>((kernel - 1 - j) * dilation);
        if (source >= 0) sum += conv_w[c * kernel + j] * conv_in[static_cast<size_t>(source)][c];
      }
      out[t][c] = gated[t][c] + silu(sum);
    }
  }
  return out;
}

}  // namespace

std::vector<int64_t> qwen4_reference_select(const std::vector<double>& scores, int64_t block_topk) {
  std::vector<int64_t> order(scores.size());
  std::iota(order.begin(), order.end(), 0);
  // Highest score first, the lower block among equals.
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return scores[static_cast<size_t>(x)] > scores[static_cast<size_t>(y)];
  });
  order.resize(std::min<size_t>(order.size(), static_cast<size_t>(block_topk)));
  std::sort(order.begin(), order.end());
  return order;
}

std::vector<std::vector<int64_t>> qwen4_reference_ple_ids(const Qwen4Spec& spec, int64_t ple_index,
                                                          const std::vector<int32_t>& tokens) {
  const int64_t n_max = spec.ngram_size, heads = spec.ngram_heads(), eos = spec.eos_token_id;
  const std::vector<int64_t> m = reference_multipliers(spec.base.vocab_size, n_max, ple_index, spec.seed);
  const std::vector<int64_t> sizes = reference_head_sizes(spec.ngram_vocab_size_base, heads, ple_index);
  std::vector<int64_t> hist(static_cast<size_t>(n_max - 1), eos);
  hist.insert(hist.end(), tokens.begin(), tokens.end());
  std::vector<std::vector<int64_t>> ids(tokens.size(), std::vector<int64_t>(static_cast<size_t>(heads)));
  for (size_t i = 0; i < tokens.size(); ++i) {
    const auto pos = static_cast<int64_t>(i) + n_max - 1;
    std::vector<int64_t> shifted(static_cast<size_t>(n_max));
    for (int64_t s = 0; s < n_max; ++s) {
      bool crosses = pos - s < 0;
      for (int64_t q = pos - s; !crosses && q < pos; ++q) crosses = hist[static_cast<size_t>(q)] == eos;
      shifted[static_cast<size_t>(s)] = crosses ? eos : hist[static_cast<size_t>(pos - s)];
    }
    for (int64_t order = 2; order <= n_max; ++order) {
      uint64_t x = 0;
      for (int64_t s = 0; s < order; ++s)
        x ^= static_cast<uint64_t>(shifted[static_cast<size_t>(s)]) * static_cast<uint64_t>(m[static_cast<size_t>(s)]);
      for (int64_t j = 0; j < spec.heads_per_ngram; ++j) {
        const int64_t head = (order - 2) * spec.heads_per_ngram + j;
        int64_t offset = 0;
        for (int64_t q = 0; q < head; ++q) offset += sizes[static_cast<size_t>(q)];
        ids[i][static_cast<size_t>(head)] =
            static_cast<int64_t>(x % static_cast<uint64_t>(sizes[static_cast<size_t>(head)])) + offset;
      }
    }
  }
  return ids;
}

std::vector<std::vector<double>> qwen4_reference_logits(const Qwen4Spec& spec, const Qwen4Weights& w,
                                                        const std::vector<int32_t>& tokens) {
  const TinySpec& b = spec.base;
  const size_t t_count = tokens.size(), h = static_cast<size_t>(b.hidden_size), n = static_cast<size_t>(spec.hc_count);
  const Matrix embedded = reference::embed(b, w.floats, tokens);
  Matrix streams(t_count, std::vector<double>(n * h));
  for (size_t t = 0; t < t_count; ++t)
    for (size_t s = 0; s < n; ++s) std::copy(embedded[t].begin(), embedded[t].end(), streams[t].begin() + static_cast<ptrdiff_t>(s * h));
  const auto inject = [&](size_t t, const std::vector<double>& beta, const std::vector<double>& u) {
    for (size_t s = 0; s < n; ++s)
      for (size_t c = 0; c < h; ++c) streams[t][s * h + c] += beta[s] * u[c];
  };
  for (int64_t layer = 0; layer < b.num_layers; ++layer) {
    const std::string p = "layers." + std::to_string(layer) + ".";
    if (const int64_t ple_index = spec.ple_index(layer); ple_index >= 0) {
      const Matrix added = ple(spec, w, p + "ple.", ple_index, tokens, streams);
      for (size_t t = 0; t < t_count; ++t)
        for (size_t c = 0; c < n * h; ++c) streams[t][c] += added[t][c];
    }
    Matrix xs(t_count), betas(t_count);
    for (size_t t = 0; t < t_count; ++t) {
      Connection connection = hyper_connection(spec, w, p + "attn_hyper_connection.", streams[t], true);
      xs[t] = std::move(connection.x);
      betas[t] = std::move(connection.beta);
    }
    const Matrix mixed = spec.layer_is_attention(layer) ? qsa_attention(spec, w, p, xs) : reference::gated_delta_net(spec.base, w.floats, p, xs,
                                                                         spec.output_gate_type == "sigmoid"
                                                                             ? reference::GdnOutputGate::kSigmoid
                                                                             : reference::GdnOutputGate::kSilu);
    for (size_t t = 0; t < t_count; ++t) inject(t, betas[t], mixed[t]);
    for (size_t t = 0; t < t_count; ++t) {
      const Connection connection = hyper_connection(spec, w, p + "mlp_hyper_connection.", streams[t], true);
      inject(t, connection.beta, moe(spec, w, p, connection.x));
    }
  }
  const auto& head = param(w, b.tie_word_embeddings ? "embed_tokens.weight" : "lm_head.weight");
  Matrix logits(t_count);
  for (size_t t = 0; t < t_count; ++t) {
    const Connection final_mix = hyper_connection(spec, w, "hyper_connection_mixer.", streams[t], false);
    logits[t] = matvec(head, final_mix.x, b.vocab_size);
  }
  return logits;
}

}  // namespace metrale::testing
