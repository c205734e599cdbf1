// CPU DSA ops (fp32 arithmetic, glm_deepseek.md §2.6): the latent and indexer cache writes with the
// pool keys, the pool selection, the sparse attention over the latents in the absorbed form and the
// per-head absorption matmul. The reference the CUDA kernels are tested against.
#include "kernels/dsa.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

// A paged cache [num_blocks, rows_per_block, width] with contiguous rows.
struct PagedRows {
  const Tensor* cache = nullptr;
  int64_t blocks = 0, per_block = 0, width = 0;

  PagedRows(const char* op, const Tensor& t) : cache(&t) {
    METRALE_CHECK(t.ndim() == 3 && t.is_contiguous(), "{}: cache {} must be contiguous [blocks, rows, width]", op,
                  t.describe());
    blocks = t.size(0);
    per_block = t.size(1);
    width = t.size(2);
  }
  char* row(int64_t flat) const {
    return static_cast<char*>(cache->data()) + flat * width * static_cast<int64_t>(cache->element_size());
  }
  int64_t rows() const { return blocks * per_block; }
};

// Sequence metadata shared by the selection and the attention.
struct SeqBatch {
  int64_t num_seqs = 0, max_blocks = 0;
  const int32_t* cu = nullptr;
  const int32_t* lens = nullptr;
  const int32_t* tables = nullptr;
};

SeqBatch check_batch(const char* op, int64_t tokens, const Tensor& cu_q, const Tensor& kv_lens,
                     const Tensor& block_tables, int64_t block_size, int64_t num_blocks, int64_t max_kv_len) {
  SeqBatch b;
  b.num_seqs = kv_lens.numel();
  METRALE_CHECK(cu_q.numel() == b.num_seqs + 1 && block_tables.ndim() == 2 && block_tables.size(0) == b.num_seqs &&
                    block_tables.is_contiguous(),
                "{}: cu_q {} kv_lens {} block_tables {}", op, cu_q.describe(), kv_lens.describe(),
                block_tables.describe());
  b.max_blocks = block_tables.size(1);
  b.cu = cu_q.data_as<const int32_t>();
  b.lens = kv_lens.data_as<const int32_t>();
  b.tables = block_tables.data_as<const int32_t>();
  METRALE_CHECK(b.cu[0] == 0 && b.cu[b.num_seqs] == tokens, "{}: cu_q spans [{}, {}) for {} rows", op, b.cu[0],
                b.cu[b.num_seqs], tokens);
  for (int64_t s = 0; s < b.num_seqs; ++s) {
    const int64_t q_len = b.cu[s + 1] - b.cu[s];
    METRALE_CHECK(q_len >= 0 && b.lens[s] >= q_len && b.lens[s] <= b.max_blocks * block_size,
                  "{}: sequence {} has q_len {} and kv_len {} ({} blocks of {})", op, s, q_len, b.lens[s], b.max_blocks,
                  block_size);
    METRALE_CHECK(max_kv_len <= 0 || b.lens[s] <= max_kv_len, "{}: kv_len {} above max_kv_len {}", op, b.lens[s],
                  max_kv_len);
    for (int64_t blk = 0; blk * block_size < b.lens[s]; ++blk) {
      const int32_t id = b.tables[s * b.max_blocks + blk];
      METRALE_CHECK(id >= 0 && id < num_blocks, "{}: sequence {} block {} is {} of {}", op, s, blk, id, num_blocks);
    }
  }
  return b;
}

// Flat row of position `pos` of sequence s in a cache with `per_block` rows per block of `block_size`
// tokens (per_block = block_size for token caches, block_size / kp for the pool cache).
int64_t flat_row(const SeqBatch& b, int64_t s, int64_t pos, int64_t block_size, int64_t per_block,
                 int64_t tokens_per_row) {
  const int64_t block = b.tables[s * b.max_blocks + pos / block_size];
  return block * per_block + (pos % block_size) / tokens_per_row;
}

const char* head_ptr(const Tensor& t, int64_t token, int64_t head) {
  return static_cast<const char*>(t.data()) +
         (token * t.stride(0) + head * t.stride(1)) * static_cast<int64_t>(t.element_size());
}

void check_slots(const char* op, const Tensor& slot_mapping, int64_t tokens, int64_t rows) {
  METRALE_CHECK(slot_mapping.dtype() == DType::kI32 && slot_mapping.numel() == tokens && slot_mapping.is_contiguous(),
                "{}: slot_mapping {} for {} rows", op, slot_mapping.describe(), tokens);
  const auto* slots = slot_mapping.data_as<const int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    METRALE_CHECK(slots[t] >= -1 && slots[t] < rows, "{}: slot {} of {}", op, slots[t], rows);
  }
}

std::vector<float> as_vector(const Tensor& t) {
  std::vector<float> values(static_cast<size_t>(t.numel()));
  METRALE_CHECK(t.is_contiguous(), "dsa: parameter {} must be contiguous", t.describe());
  convert_to_f32(t.dtype(), t.data(), values.data(), values.size());
  return values;
}

}  // namespace

void dsa_latent_write(const Tensor& rows, const Tensor& slot_mapping, const Tensor& cache) {
  const PagedRows paged("dsa_latent_write", cache);
  METRALE_CHECK(rows.ndim() == 2 && rows.size(1) == paged.width && rows.stride(1) == 1,
                "dsa_latent_write: rows {} for cache {}", rows.describe(), cache.describe());
  check_slots("dsa_latent_write", slot_mapping, rows.size(0), paged.rows());
  const auto* slots = slot_mapping.data_as<const int32_t>();
  std::vector<float> row(static_cast<size_t>(paged.width));
  for (int64_t t = 0; t < rows.size(0); ++t) {
    if (slots[t] < 0) continue;
    convert_to_f32(rows.dtype(), row_ptr(rows, t), row.data(), row.size());
    store_f32(cache.dtype(), row.data(), paged.row(slots[t]), paged.width);
  }
}

void dsa_index_write(const Tensor& k_raw, const Tensor& gate, const Tensor& ln_weight, const Tensor& ln_bias,
                     const Tensor& ape, const Tensor& slot_mapping, const Tensor& index_cache,
                     const Tensor& pool_cache, const DsaIndexWriteParams& params) {
  const char* op = "dsa_index_write";
  const PagedRows index(op, index_cache), pools(op, pool_cache);
  const int64_t kp = params.kpool, tokens = k_raw.size(0), dim = k_raw.size(1);
  METRALE_CHECK(kp >= 1 && index.per_block % kp == 0 && pools.per_block * kp == index.per_block &&
                    pools.blocks == index.blocks && index.width == 2 * dim && pools.width == dim,
                "{}: index cache {} and pool cache {} for d_I {} and kp {}", op, index_cache.describe(),
                pool_cache.describe(), dim, kp);
  METRALE_CHECK(k_raw.ndim() == 2 && k_raw.stride(1) == 1 && gate.ndim() == 2 && gate.size(0) == tokens &&
                    gate.size(1) == dim && gate.stride(1) == 1,
                "{}: k_raw {} gate {}", op, k_raw.describe(), gate.describe());
  METRALE_CHECK(ln_weight.numel() == dim && ln_bias.numel() == dim && ape.numel() == kp * dim,
                "{}: ln_weight {} ln_bias {} ape {}", op, ln_weight.describe(), ln_bias.describe(), ape.describe());
  check_slots(op, slot_mapping, tokens, index.rows());
  const std::vector<float> w = as_vector(ln_weight), bias = as_vector(ln_bias), pos_bias = as_vector(ape);
  const auto* slots = slot_mapping.data_as<const int32_t>();
  const DType cache_dtype = index_cache.dtype();
  std::vector<float> row(static_cast<size_t>(2 * dim));
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    convert_to_f32(k_raw.dtype(), row_ptr(k_raw, t), row.data(), static_cast<size_t>(dim));
    convert_to_f32(gate.dtype(), row_ptr(gate, t), row.data() + dim, static_cast<size_t>(dim));
    float mean = 0.0f;
    for (int64_t d = 0; d < dim; ++d) mean += row[static_cast<size_t>(d)];
    mean /= static_cast<float>(dim);
    float var = 0.0f;
    for (int64_t d = 0; d < dim; ++d) var += (row[static_cast<size_t>(d)] - mean) * (row[static_cast<size_t>(d)] - mean);
    const float inv = 1.0f / std::sqrt(var / static_cast<float>(dim) + params.ln_eps);
    for (int64_t d = 0; d < dim; ++d) {
      const auto i = static_cast<size_t>(d);
      row[i] = (row[i] - mean) * inv * w[i] + bias[i];
    }
    store_f32(cache_dtype, row.data(), index.row(slots[t]), 2 * dim);
  }
  // Pools completed by this step's tokens, from the cached rows (the earlier ones may predate the step).
  std::vector<float> members(static_cast<size_t>(kp * 2 * dim)), key(static_cast<size_t>(dim));
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot % kp != kp - 1) continue;
    for (int64_t j = 0; j < kp; ++j) {
      convert_to_f32(cache_dtype, index.row(slot - kp + 1 + j), members.data() + j * 2 * dim,
                     static_cast<size_t>(2 * dim));
    }
    for (int64_t d = 0; d < dim; ++d) {
      float logits[256];
      METRALE_CHECK(kp <= 256, "{}: kp {} above 256", op, kp);
      float max_logit = -INFINITY;
      for (int64_t j = 0; j < kp; ++j) {
        logits[j] = members[static_cast<size_t>(j * 2 * dim + dim + d)] + pos_bias[static_cast<size_t>(j * dim + d)];
        max_logit = std::max(max_logit, logits[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < kp; ++j) sum += (logits[j] = std::exp(logits[j] - max_logit));
      float pooled = 0.0f;
      for (int64_t j = 0; j < kp; ++j) {
        const float weight = round_as(cache_dtype, logits[j] / sum);
        pooled += round_as(cache_dtype, weight * members[static_cast<size_t>(j * 2 * dim + d)]);
      }
      key[static_cast<size_t>(d)] = pooled;
    }
    const int64_t block = slot / index.per_block, offset = slot % index.per_block;
    store_f32(pool_cache.dtype(), key.data(), pools.row(block * pools.per_block + offset / kp), dim);
  }
}

void dsa_select(const Tensor& q_index, const Tensor& weights, const Tensor& pool_cache, const Tensor& cu_q,
                const Tensor& kv_lens, const Tensor& block_tables, const Tensor& selected,
                const DsaSelectParams& params) {
  const char* op = "dsa_select";
  const PagedRows pools(op, pool_cache);
  METRALE_CHECK(q_index.ndim() == 3 && q_index.stride(2) == 1, "{}: q_index {}", op, q_index.describe());
  const int64_t tokens = q_index.size(0), heads = q_index.size(1), dim = q_index.size(2);
  const int64_t kp = params.kpool, top = params.top_pools, block_size = pools.per_block * kp;
  METRALE_CHECK(pools.width == dim && kp >= 1 && top >= 1, "{}: pool cache {} for q_index {}", op,
                pool_cache.describe(), q_index.describe());
  METRALE_CHECK(weights.ndim() == 2 && weights.size(0) == tokens && weights.size(1) == heads && weights.stride(1) == 1,
                "{}: weights {}", op, weights.describe());
  METRALE_CHECK(selected.ndim() == 2 && selected.size(0) == tokens && selected.size(1) == top &&
                    selected.dtype() == DType::kI32 && selected.is_contiguous(),
                "{}: selected {} must be i32 [T, {}]", op, selected.describe(), top);
  const SeqBatch b = check_batch(op, tokens, cu_q, kv_lens, block_tables, block_size, pools.blocks, params.max_kv_len);
  cpu_pool().parallel_for(tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(static_cast<size_t>(heads * dim)), w(static_cast<size_t>(heads)), key(static_cast<size_t>(dim));
    std::vector<float> scores;
    std::vector<int32_t> order;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = std::upper_bound(b.cu, b.cu + b.num_seqs + 1, static_cast<int32_t>(t)) - b.cu - 1;
      const int64_t pos = b.lens[s] - (b.cu[s + 1] - b.cu[s]) + (t - b.cu[s]);
      const int64_t candidates = (pos + 1) / kp;
      for (int64_t h = 0; h < heads; ++h) {
        convert_to_f32(q_index.dtype(), head_ptr(q_index, t, h), q.data() + h * dim, static_cast<size_t>(dim));
      }
      convert_to_f32(weights.dtype(), row_ptr(weights, t), w.data(), w.size());
      scores.assign(static_cast<size_t>(candidates), 0.0f);
      for (int64_t p = 0; p < candidates; ++p) {
        convert_to_f32(pool_cache.dtype(), pools.row(flat_row(b, s, p * kp, block_size, pools.per_block, kp)),
                       key.data(), key.size());
        float score = 0.0f;
        for (int64_t h = 0; h < heads; ++h) {
          const float dot = dot_f32(q.data() + h * dim, key.data(), dim);
          score += w[static_cast<size_t>(h)] * params.weight_scale * std::max(0.0f, dot * params.score_scale);
        }
        scores[static_cast<size_t>(p)] = score;
      }
      const int64_t keep = std::min(top, candidates);
      order.resize(static_cast<size_t>(candidates));
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + keep, order.end(), [&](int32_t x, int32_t y) {
        const float sx = scores[static_cast<size_t>(x)], sy = scores[static_cast<size_t>(y)];
        return sx > sy || (sx == sy && x < y);  // ties toward the lower pool index
      });
      std::sort(order.begin(), order.begin() + keep);
      int32_t* out = selected.data_as<int32_t>() + t * top;
      for (int64_t j = 0; j < top; ++j) out[j] = j < keep ? order[static_cast<size_t>(j)] : -1;
    }
  });
}

void dsa_attention(const Tensor& q, const Tensor& latent_cache, const Tensor& selected, const Tensor& cu_q,
                   const Tensor& kv_lens, const Tensor& block_tables, const Tensor& out,
                   const DsaAttentionParams& params) {
  const char* op = "dsa_attention";
  const PagedRows latents(op, latent_cache);
  METRALE_CHECK(q.ndim() == 3 && q.stride(2) == 1 && out.ndim() == 3 && out.stride(2) == 1 &&
                    out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == q.size(2),
                "{}: q {} out {}", op, q.describe(), out.describe());
  const int64_t tokens = q.size(0), heads = q.size(1), r = q.size(2), kp = params.kpool;
  const int64_t block_size = latents.per_block;
  METRALE_CHECK(latents.width == r && kp >= 1 && block_size % kp == 0, "{}: latent cache {} for q {} and kp {}", op,
                latent_cache.describe(), q.describe(), kp);
  METRALE_CHECK(selected.ndim() == 2 && selected.size(0) == tokens && selected.dtype() == DType::kI32 &&
                    selected.is_contiguous(),
                "{}: selected {}", op, selected.describe());
  const int64_t top = selected.size(1);
  const SeqBatch b =
      check_batch(op, tokens, cu_q, kv_lens, block_tables, block_size, latents.blocks, params.max_kv_len);
  cpu_pool().parallel_for(tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    std::vector<float> cached, qh(static_cast<size_t>(r)), logits, acc(static_cast<size_t>(r));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = std::upper_bound(b.cu, b.cu + b.num_seqs + 1, static_cast<int32_t>(t)) - b.cu - 1;
      const int64_t pos = b.lens[s] - (b.cu[s + 1] - b.cu[s]) + (t - b.cu[s]);
      const int64_t candidates = (pos + 1) / kp;
      // The attended tokens: the selected pools (ascending), then the tail.
      std::vector<int64_t> positions;
      const int32_t* picks = selected.data_as<const int32_t>() + t * top;
      int64_t previous = -1;
      for (int64_t j = 0; j < top; ++j) {
        if (picks[j] < 0) continue;
        METRALE_CHECK(picks[j] < candidates && picks[j] > previous,
                      "{}: row {} selects pool {} (candidates {}, previous {})", op, t, picks[j], candidates, previous);
        previous = picks[j];
        for (int64_t i = 0; i < kp; ++i) positions.push_back(picks[j] * kp + i);
      }
      for (int64_t p = candidates * kp; p <= pos; ++p) positions.push_back(p);
      const auto n = static_cast<int64_t>(positions.size());
      cached.resize(static_cast<size_t>(n * r));
      for (int64_t i = 0; i < n; ++i) {
        const int64_t flat = flat_row(b, s, positions[static_cast<size_t>(i)], block_size, block_size, 1);
        convert_to_f32(latent_cache.dtype(), latents.row(flat), cached.data() + i * r, static_cast<size_t>(r));
      }
      logits.resize(static_cast<size_t>(n));
      for (int64_t h = 0; h < heads; ++h) {
        convert_to_f32(q.dtype(), head_ptr(q, t, h), qh.data(), qh.size());
        float max_logit = -INFINITY;
        for (int64_t i = 0; i < n; ++i) {
          logits[static_cast<size_t>(i)] = dot_f32(qh.data(), cached.data() + i * r, r) * params.scale;
          max_logit = std::max(max_logit, logits[static_cast<size_t>(i)]);
        }
        float sum = 0.0f;
        for (int64_t i = 0; i < n; ++i) sum += (logits[static_cast<size_t>(i)] = std::exp(logits[static_cast<size_t>(i)] - max_logit));
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t i = 0; i < n; ++i) {
          const float p = logits[static_cast<size_t>(i)] / sum;
          const float* c = cached.data() + i * r;
          for (int64_t d = 0; d < r; ++d) acc[static_cast<size_t>(d)] += p * c[d];
        }
        char* dst = static_cast<char*>(out.data()) +
                    (t * out.stride(0) + h * out.stride(1)) * static_cast<int64_t>(out.element_size());
        store_f32(out.dtype(), acc.data(), dst, r);
      }
    }
  });
}

void mla_absorb(const Tensor& x, const Tensor& weight, const Tensor& out) {
  METRALE_CHECK(x.ndim() == 3 && weight.ndim() == 3 && out.ndim() == 3 && x.stride(2) == 1 && weight.stride(2) == 1 &&
                    out.stride(2) == 1 && weight.stride(1) == weight.size(2),
                "mla_absorb: x {} weight {} out {}", x.describe(), weight.describe(), out.describe());
  const int64_t tokens = x.size(0), heads = x.size(1), K = x.size(2), N = weight.size(1);
  METRALE_CHECK(weight.size(0) == heads && weight.size(2) == K && out.size(0) == tokens && out.size(1) == heads &&
                    out.size(2) == N,
                "mla_absorb: x {} weight {} out {}", x.describe(), weight.describe(), out.describe());
  cpu_pool().parallel_for(heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(static_cast<size_t>(N * K)), xs(static_cast<size_t>(K)), ys(static_cast<size_t>(N));
    for (int64_t h = begin; h < end; ++h) {
      const char* base = static_cast<const char*>(weight.data()) +
                         h * weight.stride(0) * static_cast<int64_t>(weight.element_size());
      convert_to_f32(weight.dtype(), base, w.data(), w.size());
      for (int64_t t = 0; t < tokens; ++t) {
        convert_to_f32(x.dtype(), head_ptr(x, t, h), xs.data(), xs.size());
        for (int64_t n = 0; n < N; ++n) ys[static_cast<size_t>(n)] = dot_f32(xs.data(), w.data() + n * K, K);
        char* dst = static_cast<char*>(out.data()) +
                    (t * out.stride(0) + h * out.stride(1)) * static_cast<int64_t>(out.element_size());
        store_f32(out.dtype(), ys.data(), dst, N);
      }
    }
  });
}

}  // namespace metrale::kernels::cpu

#if !METRALE_WITH_CUDA
namespace metrale::kernels {

size_t dsa_select_workspace_bytes(Device /*device*/, int64_t /*num_tokens*/, int64_t /*max_kv_len*/,
                                  int64_t /*kpool*/) {
  return 0;
}
int dsa_attention_splits(Device /*device*/, int64_t /*num_tokens*/, int64_t /*num_heads*/, int64_t /*top_pools*/) {
  return 1;
}
size_t dsa_attention_workspace_bytes(Device /*device*/, int64_t /*num_tokens*/, int64_t /*num_heads*/,
                                     int64_t /*latent_dim*/, int /*num_splits*/) {
  return 0;
}

}  // namespace metrale::kernels
#endif
