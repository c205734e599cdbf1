// CPU QSA ops (kernels/qsa.h): fp32 arithmetic with the reference's rounding points in the
// activation dtype (no-ops for f32, the CPU path); scores from fp64 dot products rounded once to fp32.
#include "kernels/qsa.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

// Shape checks and the batch metadata shared by the ops.
struct QsaBatch {
  int64_t num_seqs = 0, tokens = 0, table_width = 0;
  const int32_t* cu = nullptr;
  const int32_t* lens = nullptr;
  const int32_t* tables = nullptr;
  std::vector<int32_t> row_seq;  // [T]

  int64_t position(int64_t row) const {
    const int64_t s = row_seq[static_cast<size_t>(row)];
    return lens[s] - (cu[s + 1] - cu[s]) + (row - cu[s]);
  }
  // Cache slot (block * block_size + offset) of key `key` of sequence s.
  int64_t slot(int64_t s, int64_t key, int64_t block_size) const {
    METRALE_CHECK(key / block_size < table_width, "qsa: key {} beyond the block table of {} blocks", key, table_width);
    return static_cast<int64_t>(tables[s * table_width + key / block_size]) * block_size + key % block_size;
  }
};

QsaBatch make_batch(const Tensor& cu_q, const Tensor& kv_lens, const Tensor& block_tables, int64_t max_q_len,
                    int64_t max_kv_len, const char* op) {
  QsaBatch b;
  b.num_seqs = kv_lens.numel();
  METRALE_CHECK(cu_q.numel() == b.num_seqs + 1 && cu_q.dtype() == DType::kI32 && kv_lens.dtype() == DType::kI32,
                "{}: cu_q {} kv_lens {}", op, cu_q.describe(), kv_lens.describe());
  b.cu = cu_q.data_as<const int32_t>();
  b.lens = kv_lens.data_as<const int32_t>();
  b.tokens = b.cu[b.num_seqs];
  if (!block_tables.empty()) {
    METRALE_CHECK(block_tables.ndim() == 2 && block_tables.size(0) >= b.num_seqs && block_tables.is_contiguous(),
                  "{}: block_tables {}", op, block_tables.describe());
    b.tables = block_tables.data_as<const int32_t>();
    b.table_width = block_tables.size(1);
  }
  b.row_seq.resize(static_cast<size_t>(b.tokens));
  for (int64_t s = 0; s < b.num_seqs; ++s) {
    const int64_t q_len = b.cu[s + 1] - b.cu[s];
    METRALE_CHECK(q_len >= 0 && b.lens[s] >= q_len, "{}: sequence {} has {} queries and {} keys", op, s, q_len,
                  b.lens[s]);
    METRALE_CHECK(max_q_len <= 0 || q_len <= max_q_len, "{}: q_len {} over the bound {}", op, q_len, max_q_len);
    METRALE_CHECK(max_kv_len <= 0 || b.lens[s] <= max_kv_len, "{}: kv_len {} over the bound {}", op, b.lens[s],
                  max_kv_len);
    for (int64_t t = b.cu[s]; t < b.cu[s + 1]; ++t) b.row_seq[static_cast<size_t>(t)] = static_cast<int32_t>(s);
  }
  return b;
}

// row <- D(zc(row; w)) (zero-centred RMSNorm, fp64 sum of squares as cpu::rms_norm).
void zc_norm(float* row, const float* w, int64_t width, float eps, DType act) {
  double sum = 0.0;
  for (int64_t i = 0; i < width; ++i) sum += static_cast<double>(row[i]) * row[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(sum / static_cast<double>(width)) + eps);
  for (int64_t i = 0; i < width; ++i) row[i] = round_as(act, row[i] * inv * (1.0f + w[i]));
}

// row <- D(D(row * cos) + D(rotate_half(row) * sin)) on the first rotary_dim channels, with
// cos, sin = D(cos(p inv_freq) s), D(sin(p inv_freq) s) (qwen.md §3.2).
void rope_row(float* row, int64_t position, const float* inv_freq, const RopeParams& rope, DType act) {
  const int half = rope.rotary_dim / 2;
  for (int i = 0; i < half; ++i) {
    const float angle = static_cast<float>(position) * inv_freq[i];
    const float c = round_as(act, std::cos(angle) * rope.attention_scaling);
    const float s = round_as(act, std::sin(angle) * rope.attention_scaling);
    const float a = row[i], b = row[i + half];
    row[i] = round_as(act, round_as(act, a * c) - round_as(act, b * s));
    row[i + half] = round_as(act, round_as(act, b * c) + round_as(act, a * s));
  }
}

void check_rope(const QsaParams& params, const Tensor& inv_freq, int64_t width, const char* op) {
  METRALE_CHECK(params.rope.rotary_dim % 2 == 0 && params.rope.rotary_dim <= width &&
                    inv_freq.numel() == params.rope.rotary_dim / 2 && inv_freq.dtype() == DType::kF32,
                "{}: rotary_dim {} inv_freq {} for width {}", op, params.rope.rotary_dim, inv_freq.describe(), width);
}

}  // namespace

void qsa_index_prologue(const Tensor& q_idx, const Tensor& k_tok, const Tensor& q_norm_weight,
                        const Tensor& positions, const Tensor& inv_freq, const Tensor& slot_mapping,
                        const Tensor& index_cache, const QsaParams& params) {
  METRALE_CHECK(q_idx.ndim() == 3 && q_idx.stride(2) == 1 && k_tok.ndim() == 2 && k_tok.stride(1) == 1,
                "qsa_index_prologue: q {} k {}", q_idx.describe(), k_tok.describe());
  const int64_t tokens = q_idx.size(0), heads = q_idx.size(1), width = q_idx.size(2);
  METRALE_CHECK(k_tok.size(0) == tokens && k_tok.size(1) == width && q_norm_weight.numel() == width &&
                    positions.numel() == tokens && slot_mapping.numel() == tokens,
                "qsa_index_prologue: k {} weight {} positions {} slots {}", k_tok.describe(),
                q_norm_weight.describe(), positions.describe(), slot_mapping.describe());
  METRALE_CHECK(index_cache.ndim() == 3 && index_cache.size(2) == width && index_cache.is_contiguous(),
                "qsa_index_prologue: index_cache {}", index_cache.describe());
  check_rope(params, inv_freq, width, "qsa_index_prologue");
  const std::vector<float> w = weights_f32(q_norm_weight);
  const auto* pos = positions.data_as<const int32_t>();
  const auto* slots = slot_mapping.data_as<const int32_t>();
  const auto* freq = inv_freq.data_as<const float>();
  const int64_t cache_slots = index_cache.size(0) * index_cache.size(1);
  const DType act = q_idx.dtype();
  cpu_pool().parallel_for(tokens, 4, [&](int64_t begin, int64_t end) {
    float* row = scratch_a(width);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        char* ptr = static_cast<char*>(q_idx.data()) +
                    (t * q_idx.stride(0) + h * q_idx.stride(1)) * static_cast<int64_t>(q_idx.element_size());
        convert_to_f32(act, ptr, row, static_cast<size_t>(width));
        zc_norm(row, w.data(), width, params.eps, act);
        rope_row(row, pos[t], freq, params.rope, act);
        store_f32(act, row, ptr, width);
      }
      if (slots[t] < 0) continue;
      METRALE_CHECK(slots[t] < cache_slots, "qsa_index_prologue: slot {} outside the cache of {}", slots[t],
                    cache_slots);
      convert_to_f32(k_tok.dtype(), row_ptr(k_tok, t), row, static_cast<size_t>(width));
      store_f32(index_cache.dtype(), row,
                static_cast<char*>(index_cache.data()) +
                    static_cast<int64_t>(slots[t]) * width * static_cast<int64_t>(index_cache.element_size()),
                width);
    }
  });
}

void qsa_block_keys(const Tensor& index_cache, const Tensor& k_norm_weight, const Tensor& inv_freq,
                    const Tensor& cu_q, const Tensor& kv_lens, const Tensor& block_tables, const Tensor& block_keys,
                    const QsaParams& params) {
  const int64_t c = params.compress_ratio;
  METRALE_CHECK(index_cache.ndim() == 3 && index_cache.is_contiguous() && block_keys.ndim() == 3 &&
                    block_keys.is_contiguous() && c >= 1,
                "qsa_block_keys: index_cache {} block_keys {} c {}", index_cache.describe(), block_keys.describe(), c);
  const int64_t block_size = index_cache.size(1), width = index_cache.size(2);
  METRALE_CHECK(block_size % c == 0 && block_keys.size(0) == index_cache.size(0) &&
                    block_keys.size(1) == block_size / c && block_keys.size(2) == width &&
                    k_norm_weight.numel() == width,
                "qsa_block_keys: block_keys {} for index_cache {} and c {}", block_keys.describe(),
                index_cache.describe(), c);
  check_rope(params, inv_freq, width, "qsa_block_keys");
  const QsaBatch b = make_batch(cu_q, kv_lens, block_tables, params.max_q_len, params.max_kv_len, "qsa_block_keys");
  const std::vector<float> w = weights_f32(k_norm_weight);
  const auto* freq = inv_freq.data_as<const float>();
  const DType act = block_keys.dtype();
  const auto in_size = static_cast<int64_t>(index_cache.element_size());
  const auto out_size = static_cast<int64_t>(block_keys.element_size());
  const int32_t* row_slots = nullptr;
  if (!params.row_slots.empty()) {
    METRALE_CHECK(params.row_slots.dtype() == DType::kI32 && params.row_slots.numel() >= b.tokens &&
                      params.row_slots.is_contiguous(),
                  "qsa_block_keys: row_slots {} for {} rows", params.row_slots.describe(), b.tokens);
    row_slots = params.row_slots.data_as<const int32_t>();
  }
  cpu_pool().parallel_for(b.num_seqs, 1, [&](int64_t begin, int64_t end) {
    float* sum = scratch_a(2 * width);
    float* key = sum + width;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t q_len = b.cu[s + 1] - b.cu[s], kv_len = b.lens[s];
      const int64_t ctx = kv_len - q_len;
      const int64_t first = params.all_blocks ? 0 : ctx / c;
      for (int64_t j = first; j < kv_len / c; ++j) {
        const int64_t last_token = j * c + c - 1;  // a row of this step when >= ctx
        if (row_slots != nullptr && last_token >= ctx && row_slots[b.cu[s] + last_token - ctx] < 0) continue;
        std::fill_n(sum, width, 0.0f);
        for (int64_t i = 0; i < c; ++i) {
          const int64_t slot = b.slot(s, j * c + i, block_size);
          convert_to_f32(index_cache.dtype(), static_cast<const char*>(index_cache.data()) + slot * width * in_size,
                         key, static_cast<size_t>(width));
          for (int64_t d = 0; d < width; ++d) sum[d] += key[d];  // fp32, in token order
        }
        for (int64_t d = 0; d < width; ++d) sum[d] = round_as(act, sum[d] / static_cast<float>(c));
        zc_norm(sum, w.data(), width, params.eps, act);
        rope_row(sum, j * c, freq, params.rope, act);
        // The block's first token's slot / c is the block key's slot in [num_blocks, block_size / c].
        const int64_t key_slot = b.slot(s, j * c, block_size) / c;
        store_f32(act, sum, static_cast<char*>(block_keys.data()) + key_slot * width * out_size, width);
      }
    }
  });
}

void qsa_scores(const Tensor& q_idx, const Tensor& block_keys, const Tensor& cu_q, const Tensor& kv_lens,
                const Tensor& block_tables, const Tensor& scores, const QsaParams& params) {
  const int64_t c = params.compress_ratio;
  METRALE_CHECK(q_idx.ndim() == 3 && q_idx.stride(2) == 1 && block_keys.ndim() == 3 && block_keys.is_contiguous() &&
                    scores.ndim() == 2 && scores.dtype() == DType::kF32 && scores.stride(1) == 1 && c >= 1,
                "qsa_scores: q {} block_keys {} scores {}", q_idx.describe(), block_keys.describe(), scores.describe());
  const int64_t heads = q_idx.size(1), width = q_idx.size(2), keys_per_block = block_keys.size(1);
  METRALE_CHECK(block_keys.size(2) == width && scores.size(0) == q_idx.size(0), "qsa_scores: shapes q {} keys {}",
                q_idx.describe(), block_keys.describe());
  const QsaBatch b = make_batch(cu_q, kv_lens, block_tables, params.max_q_len, params.max_kv_len, "qsa_scores");
  METRALE_CHECK(b.tokens == q_idx.size(0), "qsa_scores: cu_q ends at {} for {} rows", b.tokens, q_idx.size(0));
  const int64_t block_size = keys_per_block * c;
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(width));
  cpu_pool().parallel_for(b.tokens, 1, [&](int64_t begin, int64_t end) {
    float* q = scratch_a((heads + 1) * width);
    float* key = q + heads * width;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = b.row_seq[static_cast<size_t>(t)], nb = (b.position(t) + 1) / c;
      METRALE_CHECK(nb <= scores.size(1), "qsa_scores: row {} has {} blocks, scores hold {}", t, nb, scores.size(1));
      for (int64_t h = 0; h < heads; ++h) {
        const char* ptr = static_cast<const char*>(q_idx.data()) +
                          (t * q_idx.stride(0) + h * q_idx.stride(1)) * static_cast<int64_t>(q_idx.element_size());
        convert_to_f32(q_idx.dtype(), ptr, q + h * width, static_cast<size_t>(width));
      }
      float* out = static_cast<float*>(row_ptr_mut(scores, t));
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t key_slot = b.slot(s, j * c, block_size) / c;
        convert_to_f32(block_keys.dtype(),
                       static_cast<const char*>(block_keys.data()) +
                           key_slot * width * static_cast<int64_t>(block_keys.element_size()),
                       key, static_cast<size_t>(width));
        double total = 0.0;
        for (int64_t h = 0; h < heads; ++h) {
          double dot = 0.0;
          for (int64_t d = 0; d < width; ++d) dot += static_cast<double>(q[h * width + d]) * key[d];
          total += std::max(dot, 0.0);
        }
        out[j] = static_cast<float>(total * inv_sqrt_d);
      }
    }
  });
}

void qsa_topk(const Tensor& scores, const Tensor& cu_q, const Tensor& kv_lens, const Tensor& selected,
              const QsaParams& params) {
  const int64_t c = params.compress_ratio, k = params.block_topk;
  METRALE_CHECK(scores.ndim() == 2 && scores.dtype() == DType::kF32 && scores.stride(1) == 1 &&
                    selected.ndim() == 2 && selected.dtype() == DType::kI32 && selected.size(1) == k &&
                    selected.stride(1) == 1 && c >= 1 && k >= 1,
                "qsa_topk: scores {} selected {} k {}", scores.describe(), selected.describe(), k);
  const QsaBatch b = make_batch(cu_q, kv_lens, Tensor(), params.max_q_len, params.max_kv_len, "qsa_topk");
  METRALE_CHECK(b.tokens == scores.size(0) && b.tokens == selected.size(0), "qsa_topk: {} rows for {} scores",
                b.tokens, scores.size(0));
  cpu_pool().parallel_for(b.tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> order;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t nb = (b.position(t) + 1) / c;
      auto* out = static_cast<int32_t*>(row_ptr_mut(selected, t));
      order.resize(static_cast<size_t>(nb));
      std::iota(order.begin(), order.end(), 0);
      if (nb > k) {
        METRALE_CHECK(nb <= scores.size(1), "qsa_topk: row {} has {} blocks, scores hold {}", t, nb, scores.size(1));
        const auto* row = static_cast<const float*>(row_ptr(scores, t));
        // Higher score first; equal scores (float ==, so -0 == +0) by lower index.
        const auto better = [row](int32_t x, int32_t y) { return row[x] > row[y] || (row[x] == row[y] && x < y); };
        std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), better);
        order.resize(static_cast<size_t>(k));
        std::sort(order.begin(), order.end());
      }
      std::fill_n(out, k, -1);
      std::copy(order.begin(), order.end(), out);
    }
  });
}

void qsa_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& cu_q,
                   const Tensor& kv_lens, const Tensor& block_tables, const Tensor& selected, const Tensor& out,
                   const QsaAttentionParams& params) {
  const int64_t c = params.compress_ratio, k = params.block_topk;
  METRALE_CHECK(q.ndim() == 3 && out.ndim() == 3 && k_cache.ndim() == 4 && q.stride(2) == 1 && out.stride(2) == 1 &&
                    k_cache.is_contiguous() && v_cache.is_contiguous() && c >= 1 && k >= 1,
                "qsa_attention: q {} out {} cache {}", q.describe(), out.describe(), k_cache.describe());
  const int64_t tokens = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  METRALE_CHECK(k_cache.size(3) == head_dim && heads % kv_heads == 0 && v_cache.shape() == k_cache.shape() &&
                    out.size(0) == tokens && out.size(1) == heads && out.size(2) == head_dim,
                "qsa_attention: heads {} kv {} out {}", heads, kv_heads, out.describe());
  METRALE_CHECK(selected.ndim() == 2 && selected.dtype() == DType::kI32 && selected.size(0) == tokens &&
                    selected.size(1) == k && selected.stride(1) == 1,
                "qsa_attention: selected {} for {} rows of {} blocks", selected.describe(), tokens, k);
  const QsaBatch b = make_batch(cu_q, kv_lens, block_tables, params.max_q_len, params.max_kv_len, "qsa_attention");
  METRALE_CHECK(b.tokens == tokens, "qsa_attention: cu_q ends at {} for {} rows", b.tokens, tokens);
  const int64_t group = heads / kv_heads, kv_row = kv_heads * head_dim;
  const auto key_ptr = [&](const Tensor& cache, int64_t slot, int64_t kvh) {
    return static_cast<const char*>(cache.data()) +
           (slot * kv_row + kvh * head_dim) * static_cast<int64_t>(cache.element_size());
  };
  cpu_pool().parallel_for(tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> keys;
    std::vector<float> scores;
    float* qf = scratch_a(3 * head_dim);
    float* kf = qf + head_dim;
    float* acc = kf + head_dim;
    float* vf = scratch_b(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = b.row_seq[static_cast<size_t>(t)], p = b.position(t), nb = (p + 1) / c;
      // The keys this row attends, as cache slots.
      keys.clear();
      if (nb <= k) {
        for (int64_t key = 0; key <= p; ++key) keys.push_back(b.slot(s, key, block_size));
      } else {
        const auto* sel = static_cast<const int32_t*>(row_ptr(selected, t));
        for (int64_t i = 0; i < k; ++i) {
          METRALE_CHECK(sel[i] >= 0 && sel[i] < nb && (i == 0 || sel[i] > sel[i - 1]),
                        "qsa_attention: row {} selects block {} (entry {}) of {}", t, sel[i], i, nb);
          for (int64_t j = 0; j < c; ++j) keys.push_back(b.slot(s, sel[i] * c + j, block_size));
        }
        for (int64_t key = nb * c; key <= p; ++key) keys.push_back(b.slot(s, key, block_size));
      }
      scores.resize(keys.size());
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t kvh = h / group;
        const char* q_ptr = static_cast<const char*>(q.data()) +
                            (t * q.stride(0) + h * q.stride(1)) * static_cast<int64_t>(q.element_size());
        const float* qv = as_f32(q.dtype(), q_ptr, qf, head_dim);
        float max_score = -INFINITY;
        for (size_t i = 0; i < keys.size(); ++i) {
          const float* kv = as_f32(k_cache.dtype(), key_ptr(k_cache, keys[i], kvh), kf, head_dim);
          scores[i] = dot_f32(qv, kv, head_dim) * params.scale;
          max_score = std::max(max_score, scores[i]);
        }
        double denom = 0.0;
        for (float& score : scores) {
          score = std::exp(score - max_score);
          denom += score;
        }
        std::fill_n(acc, head_dim, 0.0f);
        for (size_t i = 0; i < keys.size(); ++i) {
          const float* vv = as_f32(v_cache.dtype(), key_ptr(v_cache, keys[i], kvh), vf, head_dim);
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += scores[i] * vv[d];
        }
        const auto inv = static_cast<float>(1.0 / denom);
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= inv;
        store_f32(out.dtype(), acc,
                  static_cast<char*>(out.data()) +
                      (t * out.stride(0) + h * out.stride(1)) * static_cast<int64_t>(out.element_size()),
                  head_dim);
      }
    }
  });
}

}  // namespace metrale::kernels::cpu

#if !METRALE_WITH_CUDA
namespace metrale::kernels {

// Builds without CUDA run QSA on the CPU only, which needs no scratch (CUDA builds define this in
// kernels/cuda/qsa_attention.cu).
size_t qsa_attention_workspace_bytes(int64_t /*num_tokens*/, int64_t /*num_heads*/, int64_t /*num_kv_heads*/,
                                     int64_t /*head_dim*/, int64_t /*block_topk*/, int64_t /*compress_ratio*/) {
  return 0;
}

}  // namespace metrale::kernels
#endif
