// CPU Gated DeltaNet core (fp32): the gates, the chunked WY form (chunk 64, qwen.md §6.6, the reference
// the CUDA chunked kernel is tested against) and the token-by-token recurrent form (§6.5). Work is
// split over (sequence, value head) pairs; each pair runs its rows in order.
#include "kernels/gated_delta_rule.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

constexpr int64_t kChunk = 64;  // transformers' torch_chunk_gated_delta_rule chunk size

// values <- dtype(values) for the 16-bit activation dtypes (a no-op for f32).
float round_to(DType dtype, float value) {
  if (dtype == DType::kF32) return value;
  uint16_t bits = 0;
  convert_from_f32(dtype, &value, &bits, 1);
  float rounded = 0.0f;
  convert_to_f32(dtype, &bits, &rounded, 1);
  return rounded;
}

// The batch metadata and checked views shared by both forms.
struct DeltaRuleBatch {
  int64_t tokens = 0, num_seqs = 0, k_heads = 0, v_heads = 0, dk = 0, dv = 0, num_slots = 0;
  const int32_t* cu = nullptr;
  const int32_t* lens = nullptr;
  const int32_t* slots = nullptr;
};

DeltaRuleBatch check_delta_rule(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const Tensor& state, const Tensor& cu_q, const Tensor& kv_lens,
                                const Tensor& state_slots, const Tensor& out, const GatedDeltaRuleParams& params) {
  METRALE_CHECK(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3 && out.ndim() == 3, "{}: q {} k {} v {} out {}", op,
                q.describe(), k.describe(), v.describe(), out.describe());
  DeltaRuleBatch b;
  b.tokens = q.size(0);
  b.k_heads = q.size(1);
  b.dk = q.size(2);
  b.v_heads = v.size(1);
  b.dv = v.size(2);
  METRALE_CHECK(k.size(0) == b.tokens && k.size(1) == b.k_heads && k.size(2) == b.dk && v.size(0) == b.tokens &&
                    q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
                "{}: q {} k {} v {}", op, q.describe(), k.describe(), v.describe());
  METRALE_CHECK(b.k_heads > 0 && b.v_heads % b.k_heads == 0, "{}: {} value heads for {} key heads", op, b.v_heads,
                b.k_heads);
  METRALE_CHECK(out.is_contiguous() && out.size(0) == b.tokens && out.size(1) == b.v_heads && out.size(2) == b.dv,
                "{}: out {}", op, out.describe());
  for (const Tensor* gate : {&g, &beta}) {
    METRALE_CHECK(gate->dtype() == DType::kF32 && gate->is_contiguous() && gate->numel() == b.tokens * b.v_heads,
                  "{}: gates must be f32 [T, Hv], got {}", op, gate->describe());
  }
  METRALE_CHECK(state.dtype() == DType::kF32 && state.is_contiguous() && state.ndim() == 4 &&
                    state.size(1) == b.v_heads && state.size(2) == b.dk && state.size(3) == b.dv,
                "{}: state {} must be f32 [slots, {}, {}, {}]", op, state.describe(), b.v_heads, b.dk, b.dv);
  b.num_slots = state.size(0);
  b.num_seqs = kv_lens.numel();
  METRALE_CHECK(cu_q.numel() == b.num_seqs + 1 && state_slots.numel() == b.num_seqs, "{}: cu_q {} state_slots {}", op,
                cu_q.describe(), state_slots.describe());
  b.cu = cu_q.data_as<const int32_t>();
  b.lens = kv_lens.data_as<const int32_t>();
  b.slots = state_slots.data_as<const int32_t>();
  METRALE_CHECK(b.cu[b.num_seqs] == b.tokens, "{}: cu_q ends at {} for {} rows", op, b.cu[b.num_seqs], b.tokens);
  for (int64_t s = 0; s < b.num_seqs; ++s) {
    const int64_t q_len = b.cu[s + 1] - b.cu[s];
    METRALE_CHECK(q_len >= 0 && b.lens[s] >= q_len, "{}: sequence {} has q_len {} and kv_len {}", op, s, q_len,
                  b.lens[s]);
    METRALE_CHECK(b.slots[s] >= -1 && b.slots[s] < b.num_slots, "{}: state slot {} of {}", op, b.slots[s], b.num_slots);
    if (params.max_q_len > 0) {
      METRALE_CHECK(q_len <= params.max_q_len, "{}: q_len {} above max_q_len {}", op, q_len, params.max_q_len);
    }
  }
  return b;
}

// x <- x * rsqrt(sum(x^2) + 1e-6) (transformers' l2norm, eps inside the root of the sum), then * scale.
void l2norm_scale(float* x, int64_t n, bool normalize, float scale) {
  if (normalize) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(sum + 1e-6f);
    for (int64_t i = 0; i < n; ++i) x[i] *= inv;
  }
  if (scale != 1.0f)
    for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

// The slot's state (or zeros for a sequence without cached tokens) into `S` [dk * dv].
void load_state(const Tensor& state, const DeltaRuleBatch& b, int64_t s, int64_t head, float* S) {
  const int64_t size = b.dk * b.dv;
  if (b.lens[s] == b.cu[s + 1] - b.cu[s] || b.slots[s] < 0) {  // fresh, or no state (slot -1)
    std::fill_n(S, size, 0.0f);
    return;
  }
  const float* src = state.data_as<const float>() + (static_cast<int64_t>(b.slots[s]) * b.v_heads + head) * size;
  std::copy_n(src, size, S);
}

void store_state(const Tensor& state, const DeltaRuleBatch& b, int64_t s, int64_t head, const float* S) {
  const int64_t size = b.dk * b.dv;
  if (b.slots[s] < 0) return;  // no state to keep
  std::copy_n(S, size, state.data_as<float>() + (static_cast<int64_t>(b.slots[s]) * b.v_heads + head) * size);
}

// y[dv] (+)= x[rows] . M[rows, dv] (row-major M): y_c = sum_a x_a M_ac.
void vec_mat(const float* x, const float* M, int64_t rows, int64_t dv, float* y, bool accumulate) {
  if (!accumulate) std::fill_n(y, dv, 0.0f);
  for (int64_t a = 0; a < rows; ++a) {
    const float xa = x[a];
    const float* row = M + a * dv;
    for (int64_t c = 0; c < dv; ++c) y[c] += xa * row[c];
  }
}

// Per-thread scratch of the chunked form, grown on demand.
struct ChunkScratch {
  std::vector<float> q, k, v, u, w, a, aqk, gamma, beta, S, tmp;
  void reserve(int64_t dk, int64_t dv) {
    q.resize(static_cast<size_t>(kChunk * dk));
    k.resize(static_cast<size_t>(kChunk * dk));
    v.resize(static_cast<size_t>(kChunk * dv));
    u.resize(static_cast<size_t>(kChunk * dv));
    w.resize(static_cast<size_t>(kChunk * dk));
    a.resize(static_cast<size_t>(kChunk * kChunk));
    aqk.resize(static_cast<size_t>(kChunk * kChunk));
    gamma.resize(static_cast<size_t>(kChunk));
    beta.resize(static_cast<size_t>(kChunk));
    S.resize(static_cast<size_t>(dk * dv));
    tmp.resize(static_cast<size_t>(std::max(dk, dv)));
  }
};
thread_local ChunkScratch tls_chunk;

// One (sequence, value head) through the chunked form (qwen.md §6.6), chunks starting at the
// sequence's first row of this call. The last chunk is shorter rather than zero-padded: padded rows
// (q = k = v = 0, beta = g = 0) contribute exact zeros to every sum and leave gamma unchanged.
void chunked_head(const Tensor& q, const Tensor& k, const Tensor& v, const float* g, const float* beta,
                  const Tensor& state, const Tensor& out, const DeltaRuleBatch& b, const GatedDeltaRuleParams& params,
                  int64_t s, int64_t head) {
  const int64_t dk = b.dk, dv = b.dv, hv = b.v_heads, key_head = head / (b.v_heads / b.k_heads);
  const int64_t first = b.cu[s], q_len = b.cu[s + 1] - b.cu[s];
  ChunkScratch& sc = tls_chunk;
  sc.reserve(dk, dv);
  float* S = sc.S.data();
  load_state(state, b, s, head, S);
  for (int64_t c0 = 0; c0 < q_len; c0 += kChunk) {
    const int64_t n = std::min(kChunk, q_len - c0);
    float *Q = sc.q.data(), *K = sc.k.data(), *V = sc.v.data(), *U = sc.u.data(), *W = sc.w.data();
    float *A = sc.a.data(), *Aqk = sc.aqk.data(), *gamma = sc.gamma.data(), *bt = sc.beta.data();
    float cumulative = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = first + c0 + i;
      load_head(q, t, key_head, Q + i * dk);
      load_head(k, t, key_head, K + i * dk);
      load_head(v, t, head, V + i * dv);
      l2norm_scale(Q + i * dk, dk, params.qk_l2norm, params.scale);
      l2norm_scale(K + i * dk, dk, params.qk_l2norm, 1.0f);
      cumulative += g[t * hv + head];
      gamma[i] = cumulative;  // cumsum(g) within the chunk
      bt[i] = beta[t * hv + head];
    }
    // A_ij = (K_beta K^T)_ij exp(gamma_i - gamma_j) for j < i (the strict lower part M - I);
    // Aqk_ij = (Q K^T)_ij exp(gamma_i - gamma_j) for j <= i.
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j <= i; ++j) {
        const float decay = std::exp(gamma[i] - gamma[j]);
        const float kk = dot_f32(K + i * dk, K + j * dk, dk);
        A[i * kChunk + j] = j < i ? bt[i] * kk * decay : 0.0f;
        Aqk[i * kChunk + j] = dot_f32(Q + i * dk, K + j * dk, dk) * decay;
      }
    }
    // Forward substitution with M = I + strict_lower(A): U = M^-1 V_beta, W = M^-1 (K_beta * exp(gamma)).
    for (int64_t i = 0; i < n; ++i) {
      float* u = U + i * dv;
      float* w = W + i * dk;
      const float scale_w = bt[i] * std::exp(gamma[i]);
      for (int64_t c = 0; c < dv; ++c) u[c] = V[i * dv + c] * bt[i];
      for (int64_t c = 0; c < dk; ++c) w[c] = K[i * dk + c] * scale_w;
      for (int64_t j = 0; j < i; ++j) {
        const float aij = A[i * kChunk + j];
        const float* uj = U + j * dv;
        const float* wj = W + j * dk;
        for (int64_t c = 0; c < dv; ++c) u[c] -= aij * uj[c];
        for (int64_t c = 0; c < dk; ++c) w[c] -= aij * wj[c];
      }
    }
    // V' = U - W S (into U); O = (Q exp(gamma)) S + Aqk V'.
    float* tmp = sc.tmp.data();
    for (int64_t i = 0; i < n; ++i) {
      vec_mat(W + i * dk, S, dk, dv, tmp, false);
      for (int64_t c = 0; c < dv; ++c) U[i * dv + c] -= tmp[c];
    }
    const DType out_dtype = out.dtype();
    for (int64_t i = 0; i < n; ++i) {
      const float decay = std::exp(gamma[i]);
      for (int64_t a = 0; a < dk; ++a) Q[i * dk + a] *= decay;
      vec_mat(Q + i * dk, S, dk, dv, tmp, false);
      for (int64_t j = 0; j <= i; ++j) {
        const float weight = Aqk[i * kChunk + j];
        const float* vj = U + j * dv;
        for (int64_t c = 0; c < dv; ++c) tmp[c] += weight * vj[c];
      }
      const int64_t t = first + c0 + i;
      store_f32(out_dtype, tmp,
                static_cast<char*>(out.data()) + (t * hv + head) * dv * static_cast<int64_t>(out.element_size()), dv);
    }
    // S <- exp(gamma_C) S + K'^T V' with K' = K exp(gamma_C - gamma).
    const float gamma_last = gamma[n - 1];
    const float total_decay = std::exp(gamma_last);
    for (int64_t a = 0; a < dk * dv; ++a) S[a] *= total_decay;
    for (int64_t i = 0; i < n; ++i) {
      const float decay = std::exp(gamma_last - gamma[i]);
      const float* vi = U + i * dv;
      for (int64_t a = 0; a < dk; ++a) {
        const float ka = K[i * dk + a] * decay;
        float* row = S + a * dv;
        for (int64_t c = 0; c < dv; ++c) row[c] += ka * vi[c];
      }
    }
  }
  store_state(state, b, s, head, S);
}

// One (sequence, value head) token by token (qwen.md §6.5).
void recurrent_head(const Tensor& q, const Tensor& k, const Tensor& v, const float* g, const float* beta,
                    const Tensor& state, const Tensor& out, const DeltaRuleBatch& b, const GatedDeltaRuleParams& params,
                    int64_t s, int64_t head) {
  const int64_t dk = b.dk, dv = b.dv, hv = b.v_heads, key_head = head / (b.v_heads / b.k_heads);
  const int64_t first = b.cu[s], q_len = b.cu[s + 1] - b.cu[s];
  float* S = scratch_a(dk * dv);
  float* vec = scratch_b(2 * dk + 2 * dv);
  float *qv = vec, *kv = vec + dk, *vv = vec + 2 * dk, *delta = vec + 2 * dk + dv;
  load_state(state, b, s, head, S);
  for (int64_t i = 0; i < q_len; ++i) {
    const int64_t t = first + i;
    load_head(q, t, key_head, qv);
    load_head(k, t, key_head, kv);
    load_head(v, t, head, vv);
    l2norm_scale(qv, dk, params.qk_l2norm, params.scale);
    l2norm_scale(kv, dk, params.qk_l2norm, 1.0f);
    const float decay = std::exp(g[t * hv + head]), bt = beta[t * hv + head];
    for (int64_t a = 0; a < dk * dv; ++a) S[a] *= decay;
    // delta = (v - S^T k) * beta; S += k delta^T; o = S^T q.
    vec_mat(kv, S, dk, dv, delta, false);
    for (int64_t c = 0; c < dv; ++c) delta[c] = (vv[c] - delta[c]) * bt;
    for (int64_t a = 0; a < dk; ++a) {
      float* row = S + a * dv;
      const float ka = kv[a];
      for (int64_t c = 0; c < dv; ++c) row[c] += ka * delta[c];
    }
    vec_mat(qv, S, dk, dv, delta, false);
    store_f32(out.dtype(), delta,
              static_cast<char*>(out.data()) + (t * hv + head) * dv * static_cast<int64_t>(out.element_size()), dv);
    if (!params.row_states.empty()) {
      std::copy_n(S, dk * dv, params.row_states.data_as<float>() + (t * hv + head) * dk * dv);
    }
  }
  if (params.write_state) store_state(state, b, s, head, S);
}

}  // namespace

void gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, const Tensor& g,
               const Tensor& beta) {
  METRALE_CHECK(a.ndim() == 2 && b.ndim() == 2 && a.stride(1) == 1 && b.stride(1) == 1, "gdn_gates: a {} b {}",
                a.describe(), b.describe());
  const int64_t tokens = a.size(0), heads = a.size(1);
  METRALE_CHECK(b.size(0) == tokens && b.size(1) == heads && A_log.numel() == heads && dt_bias.numel() == heads,
                "gdn_gates: a {} b {} A_log {} dt_bias {}", a.describe(), b.describe(), A_log.describe(),
                dt_bias.describe());
  for (const Tensor* gate : {&g, &beta}) {
    METRALE_CHECK(gate->dtype() == DType::kF32 && gate->is_contiguous() && gate->numel() == tokens * heads,
                  "gdn_gates: outputs must be f32 [T, Hv], got {}", gate->describe());
  }
  std::vector<float> neg_a(static_cast<size_t>(heads)), bias(static_cast<size_t>(heads));
  convert_to_f32(A_log.dtype(), A_log.data(), neg_a.data(), neg_a.size());
  convert_to_f32(dt_bias.dtype(), dt_bias.data(), bias.data(), bias.size());
  for (auto& value : neg_a) value = -std::exp(value);
  const DType act = b.dtype();
  cpu_pool().parallel_for(tokens, 64, [&](int64_t begin, int64_t end) {
    float* a_row = scratch_a(heads);
    float* b_row = scratch_b(heads);
    for (int64_t t = begin; t < end; ++t) {
      convert_to_f32(a.dtype(), row_ptr(a, t), a_row, static_cast<size_t>(heads));
      convert_to_f32(b.dtype(), row_ptr(b, t), b_row, static_cast<size_t>(heads));
      float* g_out = g.data_as<float>() + t * heads;
      float* beta_out = beta.data_as<float>() + t * heads;
      for (int64_t h = 0; h < heads; ++h) {
        const float x = a_row[h] + bias[static_cast<size_t>(h)];
        const float softplus = x > 20.0f ? x : std::log1p(std::exp(x));
        g_out[h] = neg_a[static_cast<size_t>(h)] * softplus;
        beta_out[h] = round_to(act, 1.0f / (1.0f + std::exp(-b_row[h])));
      }
    }
  });
}

void gated_delta_rule_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                              const Tensor& state, const Tensor& cu_q, const Tensor& kv_lens, const Tensor& state_slots,
                              const Tensor& out, const GatedDeltaRuleParams& params) {
  const DeltaRuleBatch b =
      check_delta_rule("gated_delta_rule_chunked", q, k, v, g, beta, state, cu_q, kv_lens, state_slots, out, params);
  METRALE_CHECK(params.write_state, "gated_delta_rule_chunked always writes the final state");
  const float* gates = g.data_as<const float>();
  const float* betas = beta.data_as<const float>();
  cpu_pool().parallel_for(b.num_seqs * b.v_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      chunked_head(q, k, v, gates, betas, state, out, b, params, task / b.v_heads, task % b.v_heads);
    }
  });
}

void gated_delta_rule_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                const Tensor& state, const Tensor& cu_q, const Tensor& kv_lens,
                                const Tensor& state_slots, const Tensor& out, const GatedDeltaRuleParams& params) {
  const DeltaRuleBatch b =
      check_delta_rule("gated_delta_rule_recurrent", q, k, v, g, beta, state, cu_q, kv_lens, state_slots, out, params);
  if (!params.row_states.empty()) {
    const Tensor& rows = params.row_states;
    METRALE_CHECK(
        rows.dtype() == DType::kF32 && rows.is_contiguous() && rows.numel() == b.tokens * b.v_heads * b.dk * b.dv,
        "gated_delta_rule_recurrent: row_states {} must be f32 [T, Hv, dk, dv]", rows.describe());
  }
  const float* gates = g.data_as<const float>();
  const float* betas = beta.data_as<const float>();
  cpu_pool().parallel_for(b.num_seqs * b.v_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      recurrent_head(q, k, v, gates, betas, state, out, b, params, task / b.v_heads, task % b.v_heads);
    }
  });
}

}  // namespace metrale::kernels::cpu
