// CPU Kimi Delta Attention core (fp32, glm_deepseek.md §2.5): the gates, the chunked WY form with
// per-channel decay (chunk 64, the form of the reference's chunk_kimi_delta_attention: every decay
// exp(G_i - G_j) is taken of the difference, never as a ratio of two exponentials, so long chunks
// cannot overflow) and the token-by-token recurrent form. Work is split over (sequence, head)
// pairs; each pair runs its rows in order. This is the reference the CUDA kernels are tested against.
#include "kernels/kda.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

constexpr int64_t kKdaChunk = 64;  // transformers' chunk_kimi_delta_attention chunk size

struct KdaBatch {
  int64_t tokens = 0, num_seqs = 0, heads = 0, dk = 0, dv = 0, num_slots = 0;
  const int32_t* cu = nullptr;
  const int32_t* lens = nullptr;
  const int32_t* slots = nullptr;
};

// Checks the gate inputs: f [T, H*dk], b [T, H] (rows strided), A_log [H], dt_bias [H*dk].
void check_gate_inputs(const char* op, const Tensor& f, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias,
                       int64_t tokens, int64_t heads, int64_t dk) {
  METRALE_CHECK(f.ndim() == 2 && f.size(0) == tokens && f.size(1) == heads * dk && f.stride(1) == 1, "{}: f {}",
                op, f.describe());
  METRALE_CHECK(b.ndim() == 2 && b.size(0) == tokens && b.size(1) == heads && b.stride(1) == 1, "{}: b {}", op,
                b.describe());
  METRALE_CHECK(A_log.numel() == heads && A_log.is_contiguous() && dt_bias.numel() == heads * dk &&
                    dt_bias.is_contiguous(),
                "{}: A_log {} dt_bias {}", op, A_log.describe(), dt_bias.describe());
}

KdaBatch check_kda(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f,
                   const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, const Tensor& state,
                   const Tensor& cu_q, const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out,
                   const KdaParams& params) {
  METRALE_CHECK(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3 && out.ndim() == 3, "{}: q {} k {} v {} out {}", op,
                q.describe(), k.describe(), v.describe(), out.describe());
  KdaBatch batch;
  batch.tokens = q.size(0);
  batch.heads = q.size(1);
  batch.dk = q.size(2);
  batch.dv = v.size(2);
  METRALE_CHECK(k.size(0) == batch.tokens && k.size(1) == batch.heads && k.size(2) == batch.dk &&
                    v.size(0) == batch.tokens && v.size(1) == batch.heads && q.stride(2) == 1 && k.stride(2) == 1 &&
                    v.stride(2) == 1,
                "{}: q {} k {} v {}", op, q.describe(), k.describe(), v.describe());
  METRALE_CHECK(out.size(0) == batch.tokens && out.size(1) == batch.heads && out.size(2) == batch.dv &&
                    out.stride(2) == 1,
                "{}: out {}", op, out.describe());
  check_gate_inputs(op, f, b, A_log, dt_bias, batch.tokens, batch.heads, batch.dk);
  METRALE_CHECK(state.dtype() == DType::kF32 && state.is_contiguous() && state.ndim() == 4 &&
                    state.size(1) == batch.heads && state.size(2) == batch.dk && state.size(3) == batch.dv,
                "{}: state {} must be f32 [slots, {}, {}, {}]", op, state.describe(), batch.heads, batch.dk, batch.dv);
  batch.num_slots = state.size(0);
  batch.num_seqs = kv_lens.numel();
  METRALE_CHECK(cu_q.numel() == batch.num_seqs + 1 && state_slots.numel() == batch.num_seqs,
                "{}: cu_q {} state_slots {}", op, cu_q.describe(), state_slots.describe());
  batch.cu = cu_q.data_as<const int32_t>();
  batch.lens = kv_lens.data_as<const int32_t>();
  batch.slots = state_slots.data_as<const int32_t>();
  METRALE_CHECK(batch.cu[0] == 0 && batch.cu[batch.num_seqs] == batch.tokens, "{}: cu_q spans [{}, {}) for {} rows",
                op, batch.cu[0], batch.cu[batch.num_seqs], batch.tokens);
  for (int64_t s = 0; s < batch.num_seqs; ++s) {
    const int64_t q_len = batch.cu[s + 1] - batch.cu[s];
    METRALE_CHECK(q_len >= 0 && batch.lens[s] >= q_len, "{}: sequence {} has q_len {} and kv_len {}", op, s, q_len,
                  batch.lens[s]);
    METRALE_CHECK(batch.slots[s] >= -1 && batch.slots[s] < batch.num_slots, "{}: state slot {} of {}", op,
                  batch.slots[s], batch.num_slots);
    if (params.max_q_len > 0) {
      METRALE_CHECK(q_len <= params.max_q_len, "{}: q_len {} above max_q_len {}", op, q_len, params.max_q_len);
    }
  }
  METRALE_CHECK(!params.has_lower_bound || params.lower_bound < 0.0f, "{}: lower bound {} must be negative", op,
                params.lower_bound);
  return batch;
}

// The fp32 gate parameters of one head.
struct HeadGates {
  std::vector<float> dt_bias;  // [dk]
  float decay_rate = 0.0f;     // A_h = exp(A_log[h])
};

HeadGates head_gates(const Tensor& A_log, const Tensor& dt_bias, int64_t head, int64_t dk) {
  HeadGates gates;
  gates.dt_bias.resize(static_cast<size_t>(dk));
  const char* bias = static_cast<const char*>(dt_bias.data()) + head * dk * static_cast<int64_t>(dt_bias.element_size());
  convert_to_f32(dt_bias.dtype(), bias, gates.dt_bias.data(), gates.dt_bias.size());
  gates.decay_rate = std::exp(load_as_f32(A_log.dtype(), A_log.data(), static_cast<size_t>(head)));
  return gates;
}

// g[d] for token t of head h (Glm5NextTextForgetGate, fp32).
void forget_gate(const Tensor& f, int64_t t, int64_t head, const HeadGates& gates, const KdaParams& params,
                 float* g) {
  const int64_t dk = static_cast<int64_t>(gates.dt_bias.size());
  const char* row = static_cast<const char*>(row_ptr(f, t)) + head * dk * static_cast<int64_t>(f.element_size());
  convert_to_f32(f.dtype(), row, g, static_cast<size_t>(dk));
  for (int64_t d = 0; d < dk; ++d) {
    const float phi = g[d] + gates.dt_bias[static_cast<size_t>(d)];
    if (params.has_lower_bound) {
      g[d] = params.lower_bound * (1.0f / (1.0f + std::exp(-(gates.decay_rate * phi))));
    } else {
      const float softplus = phi > 20.0f ? phi : std::log(1.0f + std::exp(phi));
      g[d] = -gates.decay_rate * softplus;
    }
  }
}

// beta = D(sigmoid(b[t, h])) with D the dtype of b.
float beta_of(const Tensor& b, int64_t t, int64_t head) {
  const float logit = load_as_f32(b.dtype(), row_ptr(b, t), static_cast<size_t>(head));
  return round_as(b.dtype(), 1.0f / (1.0f + std::exp(-logit)));
}

void store_head(const Tensor& t, int64_t token, int64_t head, const float* src) {
  char* at = static_cast<char*>(t.data()) +
             (token * t.stride(0) + head * t.stride(1)) * static_cast<int64_t>(t.element_size());
  store_f32(t.dtype(), src, at, t.size(2));
}

// x <- x / sqrt(sum(x^2) + 1e-6) * scale (the reference's l2norm: the eps inside the root, a division).
void l2norm_scale(float* x, int64_t n, float scale) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float norm = std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] / norm * scale;
}

bool fresh(const KdaBatch& batch, int64_t s) {
  return batch.lens[s] == batch.cu[s + 1] - batch.cu[s] || batch.slots[s] < 0;
}

void load_state(const Tensor& state, const KdaBatch& batch, int64_t s, int64_t head, float* S) {
  const int64_t size = batch.dk * batch.dv;
  if (fresh(batch, s)) {
    std::fill_n(S, size, 0.0f);
    return;
  }
  std::copy_n(state.data_as<const float>() + (static_cast<int64_t>(batch.slots[s]) * batch.heads + head) * size, size,
              S);
}

void store_state(const Tensor& state, const KdaBatch& batch, int64_t s, int64_t head, const float* S) {
  if (batch.slots[s] < 0) return;
  const int64_t size = batch.dk * batch.dv;
  std::copy_n(S, size, state.data_as<float>() + (static_cast<int64_t>(batch.slots[s]) * batch.heads + head) * size);
}

// y[dv] = x[rows] . M[rows, dv] (row-major M).
void vec_mat(const float* x, const float* M, int64_t rows, int64_t dv, float* y) {
  std::fill_n(y, dv, 0.0f);
  for (int64_t a = 0; a < rows; ++a) {
    const float xa = x[a];
    const float* row = M + a * dv;
    for (int64_t c = 0; c < dv; ++c) y[c] += xa * row[c];
  }
}

// Per-thread scratch of the chunked form.
struct KdaChunkScratch {
  std::vector<float> q, k, v, G, u, w, akk, aqk, beta, S, tmp, decay;
  void reserve(int64_t dk, int64_t dv) {
    for (auto* rows_dk : {&q, &k, &G, &w}) rows_dk->resize(static_cast<size_t>(kKdaChunk * dk));
    for (auto* rows_dv : {&v, &u}) rows_dv->resize(static_cast<size_t>(kKdaChunk * dv));
    akk.resize(static_cast<size_t>(kKdaChunk * kKdaChunk));
    aqk.resize(static_cast<size_t>(kKdaChunk * kKdaChunk));
    beta.resize(static_cast<size_t>(kKdaChunk));
    S.resize(static_cast<size_t>(dk * dv));
    tmp.resize(static_cast<size_t>(std::max(dk, dv)));
    decay.resize(static_cast<size_t>(dk));
  }
};
thread_local KdaChunkScratch tls_kda_chunk;

// One (sequence, head) through the chunked form, chunks starting at the sequence's first row of this
// call. The last chunk is shorter rather than zero-padded: padded rows (beta = g = 0, k = 0) add exact
// zeros to every sum and leave G unchanged.
void chunked_head(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f, const Tensor& b,
                  const HeadGates& gates, const Tensor& state, const Tensor& out, const KdaBatch& batch,
                  const KdaParams& params, int64_t s, int64_t head) {
  const int64_t dk = batch.dk, dv = batch.dv;
  const int64_t first = batch.cu[s], q_len = batch.cu[s + 1] - batch.cu[s];
  KdaChunkScratch& sc = tls_kda_chunk;
  sc.reserve(dk, dv);
  float* S = sc.S.data();
  load_state(state, batch, s, head, S);
  for (int64_t c0 = 0; c0 < q_len; c0 += kKdaChunk) {
    const int64_t n = std::min(kKdaChunk, q_len - c0);
    float *Q = sc.q.data(), *K = sc.k.data(), *V = sc.v.data(), *G = sc.G.data(), *U = sc.u.data(),
          *W = sc.w.data();
    float *Akk = sc.akk.data(), *Aqk = sc.aqk.data(), *bt = sc.beta.data(), *tmp = sc.tmp.data();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = first + c0 + i;
      load_head(q, t, head, Q + i * dk);
      load_head(k, t, head, K + i * dk);
      load_head(v, t, head, V + i * dv);
      l2norm_scale(Q + i * dk, dk, params.scale);
      l2norm_scale(K + i * dk, dk, 1.0f);
      forget_gate(f, t, head, gates, params, G + i * dk);
      if (i > 0) {
        for (int64_t d = 0; d < dk; ++d) G[i * dk + d] += G[(i - 1) * dk + d];  // cumsum within the chunk
      }
      bt[i] = beta_of(b, t, head);
    }
    // Akk_ij = beta_i sum_d k_id k_jd exp(G_id - G_jd) (j < i); Aqk_ij = sum_d q_id k_jd exp(G_id - G_jd) (j <= i).
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j <= i; ++j) {
        float kk = 0.0f, qk = 0.0f;
        for (int64_t d = 0; d < dk; ++d) {
          const float decay = std::exp(G[i * dk + d] - G[j * dk + d]);
          kk += K[i * dk + d] * K[j * dk + d] * decay;
          qk += Q[i * dk + d] * K[j * dk + d] * decay;
        }
        Akk[i * kKdaChunk + j] = j < i ? bt[i] * kk : 0.0f;
        Aqk[i * kKdaChunk + j] = qk;
      }
    }
    // Forward substitution with (I + Akk): U = (I + Akk)^-1 (beta V), W = (I + Akk)^-1 (beta K exp(G)).
    for (int64_t i = 0; i < n; ++i) {
      float* u = U + i * dv;
      float* w = W + i * dk;
      for (int64_t c = 0; c < dv; ++c) u[c] = V[i * dv + c] * bt[i];
      for (int64_t d = 0; d < dk; ++d) w[d] = K[i * dk + d] * bt[i] * std::exp(G[i * dk + d]);
      for (int64_t j = 0; j < i; ++j) {
        const float aij = Akk[i * kKdaChunk + j];
        const float* uj = U + j * dv;
        const float* wj = W + j * dk;
        for (int64_t c = 0; c < dv; ++c) u[c] -= aij * uj[c];
        for (int64_t d = 0; d < dk; ++d) w[d] -= aij * wj[d];
      }
    }
    // V' = U - W S (into U).
    for (int64_t i = 0; i < n; ++i) {
      vec_mat(W + i * dk, S, dk, dv, tmp);
      for (int64_t c = 0; c < dv; ++c) U[i * dv + c] -= tmp[c];
    }
    // O = (Q exp(G)) S + Aqk V'.
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < dk; ++d) Q[i * dk + d] *= std::exp(G[i * dk + d]);
      vec_mat(Q + i * dk, S, dk, dv, tmp);
      for (int64_t j = 0; j <= i; ++j) {
        const float weight = Aqk[i * kKdaChunk + j];
        const float* vj = U + j * dv;
        for (int64_t c = 0; c < dv; ++c) tmp[c] += weight * vj[c];
      }
      store_head(out, first + c0 + i, head, tmp);
    }
    // S <- diag(exp(G_last)) S + (K exp(G_last - G))^T V'.
    const float* G_last = G + (n - 1) * dk;
    for (int64_t d = 0; d < dk; ++d) {
      const float decay = std::exp(G_last[d]);
      for (int64_t c = 0; c < dv; ++c) S[d * dv + c] *= decay;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* vi = U + i * dv;
      for (int64_t d = 0; d < dk; ++d) {
        const float kd = K[i * dk + d] * std::exp(G_last[d] - G[i * dk + d]);
        float* row = S + d * dv;
        for (int64_t c = 0; c < dv; ++c) row[c] += kd * vi[c];
      }
    }
  }
  store_state(state, batch, s, head, S);
}

// One (sequence, head) token by token (recurrent_kimi_delta_attention).
void recurrent_head(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f, const Tensor& b,
                    const HeadGates& gates, const Tensor& state, const Tensor& out, const KdaBatch& batch,
                    const KdaParams& params, int64_t s, int64_t head) {
  const int64_t dk = batch.dk, dv = batch.dv, heads = batch.heads;
  const int64_t first = batch.cu[s], q_len = batch.cu[s + 1] - batch.cu[s];
  float* S = scratch_a(dk * dv);
  float* vec = scratch_b(3 * dk + 2 * dv);
  float *qv = vec, *kv = vec + dk, *g = vec + 2 * dk, *vv = vec + 3 * dk, *delta = vec + 3 * dk + dv;
  load_state(state, batch, s, head, S);
  for (int64_t i = 0; i < q_len; ++i) {
    const int64_t t = first + i;
    load_head(q, t, head, qv);
    load_head(k, t, head, kv);
    load_head(v, t, head, vv);
    l2norm_scale(qv, dk, params.scale);
    l2norm_scale(kv, dk, 1.0f);
    forget_gate(f, t, head, gates, params, g);
    const float bt = beta_of(b, t, head);
    for (int64_t d = 0; d < dk; ++d) {
      const float decay = std::exp(g[d]);
      for (int64_t c = 0; c < dv; ++c) S[d * dv + c] *= decay;
    }
    vec_mat(kv, S, dk, dv, delta);
    for (int64_t c = 0; c < dv; ++c) delta[c] = (vv[c] - delta[c]) * bt;
    for (int64_t d = 0; d < dk; ++d) {
      float* row = S + d * dv;
      for (int64_t c = 0; c < dv; ++c) row[c] += kv[d] * delta[c];
    }
    vec_mat(qv, S, dk, dv, delta);
    store_head(out, t, head, delta);
    if (!params.row_states.empty()) {
      std::copy_n(S, dk * dv, params.row_states.data_as<float>() + (t * heads + head) * dk * dv);
    }
  }
  if (params.write_state) store_state(state, batch, s, head, S);
}

template <typename HeadFn>
void for_each_head(const KdaBatch& batch, const Tensor& A_log, const Tensor& dt_bias, HeadFn&& fn) {
  std::vector<HeadGates> gates;
  for (int64_t h = 0; h < batch.heads; ++h) gates.push_back(head_gates(A_log, dt_bias, h, batch.dk));
  cpu_pool().parallel_for(batch.num_seqs * batch.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head = task % batch.heads;
      fn(gates[static_cast<size_t>(head)], task / batch.heads, head);
    }
  });
}

}  // namespace

void kda_gates(const Tensor& f, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias, const Tensor& g,
               const Tensor& beta, const KdaParams& params) {
  METRALE_CHECK(g.ndim() == 3 && g.dtype() == DType::kF32 && g.is_contiguous(), "kda_gates: g {} must be f32 [T, H, dk]",
                g.describe());
  const int64_t tokens = g.size(0), heads = g.size(1), dk = g.size(2);
  check_gate_inputs("kda_gates", f, b, A_log, dt_bias, tokens, heads, dk);
  METRALE_CHECK(beta.dtype() == DType::kF32 && beta.is_contiguous() && beta.numel() == tokens * heads,
                "kda_gates: beta {} must be f32 [T, H]", beta.describe());
  METRALE_CHECK(!params.has_lower_bound || params.lower_bound < 0.0f, "kda_gates: lower bound {} must be negative",
                params.lower_bound);
  std::vector<HeadGates> gates;
  for (int64_t h = 0; h < heads; ++h) gates.push_back(head_gates(A_log, dt_bias, h, dk));
  cpu_pool().parallel_for(tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        forget_gate(f, t, h, gates[static_cast<size_t>(h)], params, g.data_as<float>() + (t * heads + h) * dk);
        beta.data_as<float>()[t * heads + h] = beta_of(b, t, h);
      }
    }
  });
}

void kda_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f, const Tensor& b,
                 const Tensor& A_log, const Tensor& dt_bias, const Tensor& state, const Tensor& cu_q,
                 const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out, const KdaParams& params) {
  const KdaBatch batch =
      check_kda("kda_chunked", q, k, v, f, b, A_log, dt_bias, state, cu_q, kv_lens, state_slots, out, params);
  METRALE_CHECK(params.write_state, "kda_chunked always writes the final state");
  for_each_head(batch, A_log, dt_bias, [&](const HeadGates& gates, int64_t s, int64_t head) {
    chunked_head(q, k, v, f, b, gates, state, out, batch, params, s, head);
  });
}

void kda_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& f, const Tensor& b,
                   const Tensor& A_log, const Tensor& dt_bias, const Tensor& state, const Tensor& cu_q,
                   const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out, const KdaParams& params) {
  const KdaBatch batch =
      check_kda("kda_recurrent", q, k, v, f, b, A_log, dt_bias, state, cu_q, kv_lens, state_slots, out, params);
  if (!params.row_states.empty()) {
    const Tensor& rows = params.row_states;
    METRALE_CHECK(rows.dtype() == DType::kF32 && rows.is_contiguous() &&
                      rows.numel() == batch.tokens * batch.heads * batch.dk * batch.dv,
                  "kda_recurrent: row_states {} must be f32 [T, H, dk, dv]", rows.describe());
  }
  for_each_head(batch, A_log, dt_bias, [&](const HeadGates& gates, int64_t s, int64_t head) {
    recurrent_head(q, k, v, f, b, gates, state, out, batch, params, s, head);
  });
}

}  // namespace metrale::kernels::cpu

#if !METRALE_WITH_CUDA
namespace metrale::kernels {

// Builds without CUDA run KDA on the CPU only, which needs no scratch.
size_t kda_workspace_bytes(Device /*device*/, int64_t /*num_tokens*/, int64_t /*num_seqs*/, int64_t /*num_heads*/,
                           int64_t /*key_head_dim*/, int64_t /*value_head_dim*/) {
  return 0;
}

}  // namespace metrale::kernels
#endif
