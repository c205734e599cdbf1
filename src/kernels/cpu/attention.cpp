#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {

namespace {

// Per-KV-head scales of an f8e4m3 cache as a host array (nullptr: not FP8, or scale 1).
const float* fp8_scales(const Tensor& cache, const Tensor& scales, int64_t kv_heads, const char* what) {
  if (cache.dtype() != DType::kF8E4M3 || scales.empty()) return nullptr;
  METRALE_CHECK(scales.dtype() == DType::kF32 && scales.numel() == kv_heads && scales.is_contiguous() &&
                    scales.device().is_cpu(),
                "{} scales {} for {} KV heads: [n_kv_heads] f32 on the CPU", what, scales.describe(), kv_heads);
  return scales.data_as<const float>();
}

}  // namespace

void kv_cache_write(const Tensor& k, const Tensor& v, const Tensor& slot_mapping, const Tensor& k_cache,
                    const Tensor& v_cache, const KvScales& scales) {
  METRALE_CHECK(k.ndim() == 3 && v.ndim() == 3 && k_cache.ndim() == 4 && v_cache.ndim() == 4, "kv_cache_write ranks");
  const int64_t tokens = k.size(0), kv_heads = k.size(1), head_dim = k.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t slots = k_cache.size(0) * block_size;
  METRALE_CHECK(k_cache.size(2) == kv_heads && k_cache.size(3) == head_dim && v.size(0) == tokens &&
                    slot_mapping.numel() == tokens && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "kv_cache_write shapes k {} cache {}", k.describe(), k_cache.describe());
  const float* k_scales = fp8_scales(k_cache, scales.k, kv_heads, "kv_cache_write key");
  const float* v_scales = fp8_scales(v_cache, scales.v, kv_heads, "kv_cache_write value");
  const auto* slot = slot_mapping.data_as<const int32_t>();
  const int64_t row = kv_heads * head_dim;
  // Quantises a row in place by its head's scale (FP8 caches store x / scale).
  const auto scaled = [&](const float* values, const float* head_scales, int64_t h, float* out) {
    if (head_scales == nullptr) return values;
    for (int64_t d = 0; d < head_dim; ++d) out[d] = values[d] / head_scales[h];
    return static_cast<const float*>(out);
  };
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    METRALE_CHECK(slot[t] < slots, "slot {} outside cache of {} slots", slot[t], slots);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const void* ks = static_cast<const char*>(k.data()) + (t * k.stride(0) + h * k.stride(1)) * static_cast<int64_t>(k.element_size());
      const void* vs = static_cast<const char*>(v.data()) + (t * v.stride(0) + h * v.stride(1)) * static_cast<int64_t>(v.element_size());
      const int64_t offset = slot[t] * row + h * head_dim;
      float* tmp = scratch_a(2 * head_dim);
      float* quantised = tmp + head_dim;
      const float* kf = scaled(as_f32(k.dtype(), ks, tmp, head_dim), k_scales, h, quantised);
      store_f32(k_cache.dtype(), kf, static_cast<char*>(k_cache.data()) + offset * static_cast<int64_t>(k_cache.element_size()), head_dim);
      const float* vf = scaled(as_f32(v.dtype(), vs, tmp, head_dim), v_scales, h, quantised);
      store_f32(v_cache.dtype(), vf, static_cast<char*>(v_cache.data()) + offset * static_cast<int64_t>(v_cache.element_size()), head_dim);
    }
  }
}

void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& cu_q,
                     const Tensor& kv_lens, const Tensor& block_tables, const Tensor& out,
                     const AttentionParams& params) {
  METRALE_CHECK(q.ndim() == 3 && out.ndim() == 3 && k_cache.ndim() == 4, "paged_attention ranks");
  const int64_t tokens = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  METRALE_CHECK(k_cache.size(3) == head_dim && heads % kv_heads == 0, "paged_attention heads {} kv {}", heads, kv_heads);
  METRALE_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "paged_attention layout");
  const int64_t num_seqs = kv_lens.numel();
  METRALE_CHECK(cu_q.numel() == num_seqs + 1, "cu_q has {} entries for {} sequences", cu_q.numel(), num_seqs);
  const auto* cu = cu_q.data_as<const int32_t>();
  const auto* lens = kv_lens.data_as<const int32_t>();
  const auto* tables = block_tables.data_as<const int32_t>();
  const int64_t max_blocks = block_tables.ndim() == 2 ? block_tables.size(1) : 0;
  const int64_t group = heads / kv_heads;
  const int64_t kv_row = kv_heads * head_dim;
  METRALE_CHECK(cu[num_seqs] == tokens, "cu_q ends at {} for {} query rows", cu[num_seqs], tokens);
  METRALE_CHECK(k_cache.dtype() == v_cache.dtype() && v_cache.shape() == k_cache.shape(),
                "paged_attention caches k {} v {}", k_cache.describe(), v_cache.describe());
  // FP8 caches: the key scale folds into the score, the value scale into the output.
  const float* k_scales = fp8_scales(k_cache, params.kv_scales.k, kv_heads, "paged_attention key");
  const float* v_scales = fp8_scales(v_cache, params.kv_scales.v, kv_heads, "paged_attention value");

  // Map each query row to its sequence once. The host bounds, when given, must hold: the CUDA
  // kernels size their grids from them.
  std::vector<int32_t> row_seq(static_cast<size_t>(tokens));
  for (int64_t s = 0; s < num_seqs; ++s) {
    METRALE_CHECK(lens[s] >= cu[s + 1] - cu[s], "sequence {} sees {} keys for {} queries", s, lens[s],
                  cu[s + 1] - cu[s]);
    METRALE_CHECK(params.max_q_len <= 0 || cu[s + 1] - cu[s] <= params.max_q_len,
                  "sequence {} has {} queries, over the bound max_q_len {}", s, cu[s + 1] - cu[s], params.max_q_len);
    METRALE_CHECK(params.max_kv_len <= 0 || lens[s] <= params.max_kv_len,
                  "sequence {} has {} keys, over the bound max_kv_len {}", s, lens[s], params.max_kv_len);
    METRALE_CHECK((lens[s] + block_size - 1) / block_size <= max_blocks, "sequence {} needs more blocks than its table", s);
    for (int32_t t = cu[s]; t < cu[s + 1]; ++t) row_seq[static_cast<size_t>(t)] = static_cast<int32_t>(s);
  }

  cpu_pool().parallel_for(tokens * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    float* qf = scratch_a(3 * head_dim);
    float* kf = qf + head_dim;
    float* acc = kf + head_dim;
    float* vf = scratch_b(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads;
      const int64_t s = row_seq[static_cast<size_t>(t)];
      const int64_t q_len = cu[s + 1] - cu[s];
      const int64_t position = lens[s] - q_len + (t - cu[s]);
      const int64_t first_key = params.window > 0 ? std::max<int64_t>(0, position - params.window + 1) : 0;
      const int64_t n_keys = position + 1 - first_key;
      const int64_t kvh = h / group;
      const float score_scale = params.scale * (k_scales != nullptr ? k_scales[kvh] : 1.0f);
      const int32_t* table = tables + s * max_blocks;
      const void* q_ptr = static_cast<const char*>(q.data()) + (t * q.stride(0) + h * q.stride(1)) * static_cast<int64_t>(q.element_size());
      const float* qv = as_f32(q.dtype(), q_ptr, qf, head_dim);
      scores.resize(static_cast<size_t>(n_keys));
      float max_score = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n_keys; ++j) {
        const int64_t key = first_key + j;
        const int64_t slot = static_cast<int64_t>(table[key / block_size]) * block_size + key % block_size;
        const void* k_ptr = static_cast<const char*>(k_cache.data()) + (slot * kv_row + kvh * head_dim) * static_cast<int64_t>(k_cache.element_size());
        const float* kv = as_f32(k_cache.dtype(), k_ptr, kf, head_dim);
        const float score = dot_f32(qv, kv, head_dim) * score_scale;
        scores[static_cast<size_t>(j)] = score;
        max_score = std::max(max_score, score);
      }
      double denom = 0.0;
      for (auto& score : scores) {
        score = std::exp(score - max_score);
        denom += score;
      }
      std::fill(acc, acc + head_dim, 0.0f);
      for (int64_t j = 0; j < n_keys; ++j) {
        const int64_t key = first_key + j;
        const int64_t slot = static_cast<int64_t>(table[key / block_size]) * block_size + key % block_size;
        const void* v_ptr = static_cast<const char*>(v_cache.data()) + (slot * kv_row + kvh * head_dim) * static_cast<int64_t>(v_cache.element_size());
        const float* vv = as_f32(v_cache.dtype(), v_ptr, vf, head_dim);
        const float p = scores[static_cast<size_t>(j)];
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * vv[d];
      }
      const float inv = static_cast<float>(1.0 / denom) * (v_scales != nullptr ? v_scales[kvh] : 1.0f);
      for (int64_t d = 0; d < head_dim; ++d) acc[d] *= inv;
      void* o_ptr = static_cast<char*>(out.data()) + (t * out.stride(0) + h * out.stride(1)) * static_cast<int64_t>(out.element_size());
      store_f32(out.dtype(), acc, o_ptr, head_dim);
    }
  });
}

}  // namespace metrale::kernels::cpu

#if !METRALE_WITH_CUDA
namespace metrale::kernels {

// Builds without CUDA run attention on the CPU only, which needs no scratch. (CUDA builds define
// this next to the kernels, in kernels/cuda/attention.cu and attention_split.cu.)
size_t paged_attention_workspace_bytes(int64_t /*num_seqs*/, int64_t /*num_tokens*/, int64_t /*num_heads*/,
                                       int64_t /*head_dim*/, int64_t /*max_kv_len*/) {
  return 0;
}

}  // namespace metrale::kernels
#endif
