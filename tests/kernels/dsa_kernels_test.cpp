// The DSA kernels on the CPU (dsa_latent_write, dsa_index_write with the pool keys, dsa_select,
// dsa_attention, mla_absorb) against a brute-force double-precision evaluation of glm_deepseek.md
// §2.6: pools rebuilt from every cached token, every candidate scored, the top pools chosen with
// ties toward the lower index, and full expanded attention (per-head K and V from the latents)
// under the selection mask.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <vector>

#include "kernels/dsa.h"
#include "kernels/kernel_helpers.h"
#include "kernels/ragged_batch.h"

namespace metrale {
namespace {

using testing::RaggedBatch;
using testing::Random;

// A small DSA layer and its paged caches.
struct DsaSetup {
  int64_t kp = 4, block_size = 8, top = 3;        // top = index_topk / kp
  int64_t d_index = 16, index_heads = 8, r = 32;  // d_I, H_I, kv_lora_rank
  int64_t heads = 3, head_dim = 8;                // H, qk_nope = v head dim
  int64_t num_blocks = 40;
  OwnedTensor latent_cache, index_cache, pool_cache;
  OwnedTensor ln_weight, ln_bias, ape, w_kv;  // w_kv [H, 2 * head_dim, r]: key rows then value rows
  std::vector<int32_t> tables;               // [S, max_blocks]
  int64_t max_blocks = 12;

  explicit DsaSetup(Random& rng, int64_t num_seqs)
      : latent_cache(DType::kF32, {num_blocks, block_size, r}),
        index_cache(DType::kF32, {num_blocks, block_size, 2 * d_index}),
        pool_cache(DType::kF32, {num_blocks, block_size / kp, d_index}),
        ln_weight(testing::random_tensor(DType::kF32, {d_index}, rng, 0.5f, 1.5f)),
        ln_bias(testing::random_tensor(DType::kF32, {d_index}, rng, -0.2f, 0.2f)),
        ape(testing::random_tensor(DType::kF32, {kp, d_index}, rng, -1.0f, 1.0f)),
        w_kv(testing::random_tensor(DType::kF32, {heads, 2 * head_dim, r}, rng, -0.5f, 0.5f)) {
    for (const Tensor* t : {&*latent_cache, &*index_cache, &*pool_cache}) testing::poison(*t);
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng.engine());
    tables.assign(static_cast<size_t>(num_seqs * max_blocks), -1);
    for (int64_t i = 0; i < num_seqs * max_blocks && i < num_blocks; ++i) tables[static_cast<size_t>(i)] = ids[static_cast<size_t>(i)];
  }
  Tensor block_tables(int64_t num_seqs) {
    return Tensor(tables.data(), DType::kI32, {num_seqs, max_blocks});
  }
  int32_t slot(int64_t s, int64_t pos) const {
    return tables[static_cast<size_t>(s * max_blocks + pos / block_size)] * static_cast<int32_t>(block_size) +
           static_cast<int32_t>(pos % block_size);
  }
  kernels::DsaIndexWriteParams write_params() const { return {kp, 1e-6f}; }
  kernels::DsaSelectParams select_params() const {
    kernels::DsaSelectParams p;
    p.kpool = kp;
    p.top_pools = top;
    p.score_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d_index)));
    p.weight_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(index_heads)));
    return p;
  }
};

// Every token's inputs of one sequence: k_raw, gate [L, d_I], latent c [L, r].
struct SeqTokens {
  std::vector<float> k_raw, gate, latent;
};

SeqTokens random_tokens(Random& rng, const DsaSetup& d, int64_t length) {
  return {rng.floats(static_cast<size_t>(length * d.d_index), -2.0f, 2.0f),
          rng.floats(static_cast<size_t>(length * d.d_index), -2.0f, 2.0f),
          rng.floats(static_cast<size_t>(length * d.r), -1.0f, 1.0f)};
}

// Writes positions [begin, end) of every sequence through the ops, as one step.
void write_step(DsaSetup& d, const std::vector<SeqTokens>& seqs, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  std::vector<float> k_raw, gate, latent;
  std::vector<int32_t> slots;
  for (size_t s = 0; s < seqs.size(); ++s) {
    for (int64_t pos = ranges[s].first; pos < ranges[s].second; ++pos) {
      const auto at = [&](const std::vector<float>& v, int64_t width) {
        return std::vector<float>(v.begin() + pos * width, v.begin() + (pos + 1) * width);
      };
      for (const float x : at(seqs[s].k_raw, d.d_index)) k_raw.push_back(x);
      for (const float x : at(seqs[s].gate, d.d_index)) gate.push_back(x);
      for (const float x : at(seqs[s].latent, d.r)) latent.push_back(x);
      slots.push_back(d.slot(static_cast<int64_t>(s), pos));
    }
  }
  const auto rows = static_cast<int64_t>(slots.size());
  const Tensor slot_mapping(slots.data(), DType::kI32, {rows});
  kernels::dsa_latent_write(Tensor(latent.data(), DType::kF32, {rows, d.r}), slot_mapping, *d.latent_cache);
  kernels::dsa_index_write(Tensor(k_raw.data(), DType::kF32, {rows, d.d_index}),
                           Tensor(gate.data(), DType::kF32, {rows, d.d_index}), *d.ln_weight, *d.ln_bias, *d.ape,
                           slot_mapping, *d.index_cache, *d.pool_cache, d.write_params());
}

// Brute force, in double: k^I of every token, the pool keys, the scores of every candidate.
struct Reference {
  std::vector<std::vector<double>> pool_keys;  // per sequence [P, d_I]
};

std::vector<double> layer_norm(const float* x, int64_t n, const std::vector<double>& w, const std::vector<double>& b) {
  double mean = 0.0, var = 0.0;
  for (int64_t i = 0; i < n; ++i) mean += x[i];
  mean /= static_cast<double>(n);
  for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= static_cast<double>(n);
  std::vector<double> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) y[static_cast<size_t>(i)] = (x[i] - mean) / std::sqrt(var + 1e-6) * w[static_cast<size_t>(i)] + b[static_cast<size_t>(i)];
  return y;
}

std::vector<double> reference_pools(const DsaSetup& d, const SeqTokens& seq, int64_t length) {
  const std::vector<double> w = testing::to_doubles(*d.ln_weight), b = testing::to_doubles(*d.ln_bias);
  const std::vector<double> ape = testing::to_doubles(*d.ape);
  const int64_t pools = length / d.kp, dim = d.d_index;
  std::vector<double> keys(static_cast<size_t>(pools * dim));
  for (int64_t p = 0; p < pools; ++p) {
    std::vector<std::vector<double>> k;
    for (int64_t j = 0; j < d.kp; ++j) k.push_back(layer_norm(seq.k_raw.data() + (p * d.kp + j) * dim, dim, w, b));
    for (int64_t c = 0; c < dim; ++c) {
      std::vector<double> logits(static_cast<size_t>(d.kp));
      double mx = -1e300, sum = 0.0;
      for (int64_t j = 0; j < d.kp; ++j) {
        logits[static_cast<size_t>(j)] = seq.gate[static_cast<size_t>((p * d.kp + j) * dim + c)] + ape[static_cast<size_t>(j * dim + c)];
        mx = std::max(mx, logits[static_cast<size_t>(j)]);
      }
      for (double& l : logits) sum += (l = std::exp(l - mx));
      double key = 0.0;
      for (int64_t j = 0; j < d.kp; ++j) key += logits[static_cast<size_t>(j)] / sum * k[static_cast<size_t>(j)][static_cast<size_t>(c)];
      keys[static_cast<size_t>(p * dim + c)] = key;
    }
  }
  return keys;
}

struct Scored {
  std::vector<double> score;  // per candidate pool
};

Scored reference_scores(const DsaSetup& d, const std::vector<double>& keys, int64_t candidates, const float* q,
                        const float* w) {
  Scored scored;
  for (int64_t p = 0; p < candidates; ++p) {
    double total = 0.0;
    for (int64_t h = 0; h < d.index_heads; ++h) {
      double dot = 0.0;
      for (int64_t c = 0; c < d.d_index; ++c) dot += q[h * d.d_index + c] * keys[static_cast<size_t>(p * d.d_index + c)];
      total += w[h] / std::sqrt(static_cast<double>(d.index_heads)) * std::max(0.0, dot / std::sqrt(static_cast<double>(d.d_index)));
    }
    scored.score.push_back(total);
  }
  return scored;
}

// The top pools by (score desc, index asc), ascending; `margin` receives the gap at the cut.
std::vector<int32_t> reference_topk(const std::vector<double>& score, int64_t top, double* margin) {
  std::vector<int32_t> order(score.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return score[static_cast<size_t>(a)] > score[static_cast<size_t>(b)]; });
  const auto keep = static_cast<size_t>(std::min<int64_t>(top, static_cast<int64_t>(score.size())));
  *margin = keep < order.size() ? score[static_cast<size_t>(order[keep - 1])] - score[static_cast<size_t>(order[keep])] : 1e300;
  std::vector<int32_t> picked(order.begin(), order.begin() + static_cast<ptrdiff_t>(keep));
  std::sort(picked.begin(), picked.end());
  return picked;
}

// Two steps over three sequences: every cached token written first (some pools left open), then the
// new rows (pools that straddle the steps complete in the second); then selection and attention
// for the new rows, against the brute force.
TEST(Dsa, PipelineMatchesBruteForceSelectionAndExpandedAttention) {
  Random rng(61);
  RaggedBatch batch;
  batch.add(9, 30, 0);   // sparse: 39 tokens, 9 complete pools > top
  batch.add(1, 41, 0);   // decode row, sparse
  batch.add(6, 3, 0);    // dense regime throughout
  const int64_t num_seqs = batch.size(), tokens = batch.tokens();
  DsaSetup d(rng, num_seqs);
  std::vector<SeqTokens> seqs;
  for (int64_t s = 0; s < num_seqs; ++s) seqs.push_back(random_tokens(rng, d, batch.kv_lens[static_cast<size_t>(s)]));
  std::vector<std::pair<int64_t, int64_t>> cached, fresh;
  for (int64_t s = 0; s < num_seqs; ++s) {
    cached.emplace_back(0, batch.ctx(s));
    fresh.emplace_back(batch.ctx(s), batch.kv_lens[static_cast<size_t>(s)]);
  }
  write_step(d, seqs, cached);
  write_step(d, seqs, fresh);

  // Pool keys: every complete pool matches the brute force; open pools were never written.
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t length = batch.kv_lens[static_cast<size_t>(s)];
    const std::vector<double> keys = reference_pools(d, seqs[static_cast<size_t>(s)], length);
    for (int64_t p = 0; p * d.kp < length + d.kp; ++p) {
      const int64_t pos = p * d.kp;
      if (pos >= d.max_blocks * d.block_size) break;
      const int32_t slot = d.slot(s, pos);
      const Tensor row = d.pool_cache->select(0, slot / d.block_size).select(0, (slot % d.block_size) / d.kp);
      if (pos + d.kp <= length) {
        const std::vector<double> expected(keys.begin() + p * d.d_index, keys.begin() + (p + 1) * d.d_index);
        EXPECT_TRUE(testing::close_rel_l2(row, expected, 1e-5)) << "sequence " << s << " pool " << p;
      } else {
        for (const double v : testing::to_doubles(row)) EXPECT_TRUE(std::isnan(v)) << "open pool " << p << " written";
      }
    }
  }

  // Selection.
  const OwnedTensor q_index = testing::random_tensor(DType::kF32, {tokens, d.index_heads, d.d_index}, rng, -1.0f, 1.0f);
  const OwnedTensor weights = testing::random_tensor(DType::kF32, {tokens, d.index_heads}, rng, -1.0f, 1.0f);
  OwnedTensor selected(DType::kI32, {tokens, d.top});
  kernels::dsa_select(*q_index, *weights, *d.pool_cache, batch.cu(), batch.lens(), d.block_tables(num_seqs), *selected,
                      d.select_params());
  const auto* picks = selected->data_as<const int32_t>();
  int compared = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const std::vector<double> keys = reference_pools(d, seqs[static_cast<size_t>(s)], batch.kv_lens[static_cast<size_t>(s)]);
    for (int64_t t = batch.cu_q[static_cast<size_t>(s)]; t < batch.cu_q[static_cast<size_t>(s) + 1]; ++t) {
      const int64_t pos = batch.ctx(s) + t - batch.cu_q[static_cast<size_t>(s)];
      const int64_t candidates = (pos + 1) / d.kp;
      const Scored scored = reference_scores(d, keys, candidates, q_index->data_as<const float>() + t * d.index_heads * d.d_index,
                                             weights->data_as<const float>() + t * d.index_heads);
      double margin = 0.0;
      const std::vector<int32_t> expected = reference_topk(scored.score, d.top, &margin);
      std::vector<int32_t> got(picks + t * d.top, picks + (t + 1) * d.top);
      std::vector<int32_t> expected_padded = expected;
      expected_padded.resize(static_cast<size_t>(d.top), -1);
      if (margin > 1e-5) {
        EXPECT_EQ(got, expected_padded) << "row " << t;
        ++compared;
      }
    }
  }
  EXPECT_GE(compared, static_cast<int>(tokens) - 2);

  // Attention in the absorbed form against expanded attention under the selection mask.
  const OwnedTensor q = testing::random_tensor(DType::kF32, {tokens, d.heads, d.head_dim}, rng, -1.0f, 1.0f);
  // W_uk,h^T [r, head_dim] per head (the transposed copy the loader makes) and W_uv,h [head_dim, r].
  OwnedTensor w_uk_t(DType::kF32, {d.heads, d.r, d.head_dim});
  const std::vector<double> wkv = testing::to_doubles(*d.w_kv);
  for (int64_t h = 0; h < d.heads; ++h)
    for (int64_t c = 0; c < d.r; ++c)
      for (int64_t i = 0; i < d.head_dim; ++i)
        w_uk_t->data_as<float>()[(h * d.r + c) * d.head_dim + i] =
            static_cast<float>(wkv[static_cast<size_t>((h * 2 * d.head_dim + i) * d.r + c)]);
  const Tensor w_uv(static_cast<float*>(d.w_kv->data()) + d.head_dim * d.r, DType::kF32, {d.heads, d.head_dim, d.r},
                    {2 * d.head_dim * d.r, d.r, 1}, Device::cpu());
  OwnedTensor q_latent(DType::kF32, {tokens, d.heads, d.r}), o_latent(DType::kF32, {tokens, d.heads, d.r});
  OwnedTensor o(DType::kF32, {tokens, d.heads, d.head_dim});
  for (const Tensor* t : {&*q_latent, &*o_latent, &*o}) testing::poison(*t);
  kernels::mla_absorb(*q, *w_uk_t, *q_latent);
  kernels::DsaAttentionParams attn;
  attn.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.head_dim)));
  attn.kpool = d.kp;
  kernels::dsa_attention(*q_latent, *d.latent_cache, *selected, batch.cu(), batch.lens(), d.block_tables(num_seqs),
                         *o_latent, attn);
  kernels::mla_absorb(*o_latent, w_uv, *o);
  std::vector<double> expected(static_cast<size_t>(tokens * d.heads * d.head_dim));
  const std::vector<double> qs = testing::to_doubles(*q);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const SeqTokens& seq = seqs[static_cast<size_t>(s)];
    for (int64_t t = batch.cu_q[static_cast<size_t>(s)]; t < batch.cu_q[static_cast<size_t>(s) + 1]; ++t) {
      const int64_t pos = batch.ctx(s) + t - batch.cu_q[static_cast<size_t>(s)];
      const int64_t candidates = (pos + 1) / d.kp;
      std::set<int64_t> mask;
      for (int64_t j = 0; j < d.top; ++j)
        if (picks[t * d.top + j] >= 0)
          for (int64_t i = 0; i < d.kp; ++i) mask.insert(picks[t * d.top + j] * d.kp + i);
      for (int64_t p = candidates * d.kp; p <= pos; ++p) mask.insert(p);
      if (candidates <= d.top) {
        EXPECT_EQ(static_cast<int64_t>(mask.size()), pos + 1) << "dense row " << t;
      }
      for (int64_t h = 0; h < d.heads; ++h) {
        // Expanded K and V of every masked token, full softmax over the mask.
        std::vector<double> logits, values;
        for (const int64_t key : mask) {
          double logit = 0.0;
          std::vector<double> v(static_cast<size_t>(d.head_dim), 0.0);
          for (int64_t i = 0; i < d.head_dim; ++i) {
            double k = 0.0;
            for (int64_t c = 0; c < d.r; ++c) {
              const double latent = seq.latent[static_cast<size_t>(key * d.r + c)];
              k += wkv[static_cast<size_t>((h * 2 * d.head_dim + i) * d.r + c)] * latent;
              v[static_cast<size_t>(i)] += wkv[static_cast<size_t>((h * 2 * d.head_dim + d.head_dim + i) * d.r + c)] * latent;
            }
            logit += qs[static_cast<size_t>((t * d.heads + h) * d.head_dim + i)] * k;
          }
          logits.push_back(logit * attn.scale);
          values.insert(values.end(), v.begin(), v.end());
        }
        ASSERT_FALSE(logits.empty());
        double mx = logits.front();
        for (const double l : logits) mx = std::max(mx, l);
        double sum = 0.0;
        for (double& l : logits) sum += (l = std::exp(l - mx));
        for (size_t m = 0; m < logits.size(); ++m)
          for (int64_t i = 0; i < d.head_dim; ++i)
            expected[static_cast<size_t>((t * d.heads + h) * d.head_dim + i)] += logits[m] / sum * values[m * static_cast<size_t>(d.head_dim) + static_cast<size_t>(i)];
      }
    }
  }
  EXPECT_TRUE(testing::close_rel_l2(*o, expected, 1e-5));
}

// Exact ties (all head weights zero: every score is +-0) go to the lowest pool indices, and a row of
// fewer candidates than K selects them all with -1 padding.
TEST(Dsa, SelectBreaksTiesTowardLowerPools) {
  Random rng(62);
  RaggedBatch batch;
  batch.add(2, 38, 0);  // 9 and 10 candidates
  batch.add(1, 6, 0);   // 1 candidate
  const int64_t num_seqs = batch.size(), tokens = batch.tokens();
  DsaSetup d(rng, num_seqs);
  std::vector<SeqTokens> seqs;
  std::vector<std::pair<int64_t, int64_t>> all;
  for (int64_t s = 0; s < num_seqs; ++s) {
    seqs.push_back(random_tokens(rng, d, batch.kv_lens[static_cast<size_t>(s)]));
    all.emplace_back(0, batch.kv_lens[static_cast<size_t>(s)]);
  }
  write_step(d, seqs, all);
  const OwnedTensor q_index = testing::random_tensor(DType::kF32, {tokens, d.index_heads, d.d_index}, rng);
  OwnedTensor weights(DType::kF32, {tokens, d.index_heads});
  std::vector<float> signed_zeros(static_cast<size_t>(tokens * d.index_heads));
  for (size_t i = 0; i < signed_zeros.size(); ++i) signed_zeros[i] = i % 2 ? -0.0f : 0.0f;
  testing::fill(*weights, signed_zeros);
  OwnedTensor selected(DType::kI32, {tokens, d.top});
  kernels::dsa_select(*q_index, *weights, *d.pool_cache, batch.cu(), batch.lens(), d.block_tables(num_seqs), *selected,
                      d.select_params());
  const auto* picks = selected->data_as<const int32_t>();
  for (int64_t t = 0; t < 2; ++t) {
    EXPECT_EQ(std::vector<int32_t>(picks + t * d.top, picks + (t + 1) * d.top), (std::vector<int32_t>{0, 1, 2}));
  }
  EXPECT_EQ(std::vector<int32_t>(picks + 2 * d.top, picks + 3 * d.top), (std::vector<int32_t>{0, -1, -1}));
}

TEST(Dsa, AbsorbIsPerHeadMatmul) {
  Random rng(63);
  const int64_t tokens = 5, heads = 3, K = 12, N = 7;
  const OwnedTensor xbuf = testing::random_tensor(DType::kF32, {tokens, heads * K + 4}, rng);
  const Tensor x = testing::split_heads(xbuf->slice(1, 4, 4 + heads * K), heads, K);
  const OwnedTensor w = testing::random_tensor(DType::kBF16, {heads, N, K}, rng);
  OwnedTensor out(DType::kF32, {tokens, heads, N});
  testing::poison(*out);
  kernels::mla_absorb(x, *w, *out);
  const std::vector<double> xs = testing::to_doubles(x), ws = testing::to_doubles(*w);
  std::vector<double> expected;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t n = 0; n < N; ++n) {
        double sum = 0.0;
        for (int64_t k = 0; k < K; ++k) sum += xs[static_cast<size_t>((t * heads + h) * K + k)] * ws[static_cast<size_t>((h * N + n) * K + k)];
        expected.push_back(sum);
      }
  EXPECT_TRUE(testing::close_rel_l2(*out, expected, testing::kF32Tolerance));
}

}  // namespace
}  // namespace metrale
