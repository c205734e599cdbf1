// QSA ops on the CPU (qwen.md §7.3) against direct double-precision formulas: the index prologue,
// block keys (recomputed every step vs computed once as blocks complete, over chunked steps), the
// scores, the top-k selection against a sort with designed ties (zeros, -0, equal values, the
// cut-off inside a tie), and sparse attention against full attention with a mask built from the
// selection. A brute-force pass runs §7.3 steps 4-8 from the raw keys of a whole sequence and must
// make the same selection and output as the ops fed in prefill chunks and decode steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/kernel_helpers.h"
#include "kernels/qsa.h"

namespace metrale {
namespace {

using kernels::QsaAttentionParams;
using kernels::QsaParams;
using testing::Random;

// A paged cache geometry: sequence s owns blocks tables[s][0..], drawn from a shuffled pool.
struct Pages {
  int64_t block_size = 16, num_blocks = 0, width = 0;  // width: blocks per table
  std::vector<int32_t> tables;
  Pages(int64_t block_size_, int64_t num_seqs, int64_t max_len, uint64_t seed) : block_size(block_size_) {
    width = (max_len + block_size - 1) / block_size;
    num_blocks = num_seqs * width + 3;
    std::vector<int32_t> pool(static_cast<size_t>(num_blocks));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), std::mt19937_64(seed));
    tables.assign(pool.begin(), pool.begin() + num_seqs * width);
  }
  Tensor table_tensor() { return Tensor(tables.data(), DType::kI32, {static_cast<int64_t>(tables.size()) / width, width}); }
  int64_t slot(int64_t s, int64_t key) const {
    return static_cast<int64_t>(tables[static_cast<size_t>(s * width + key / block_size)]) * block_size + key % block_size;
  }
};

struct Step {
  std::vector<int32_t> cu_q{0}, kv_lens;
  void add(int32_t q_len, int32_t ctx) {
    cu_q.push_back(cu_q.back() + q_len);
    kv_lens.push_back(ctx + q_len);
  }
  Tensor cu() { return Tensor(cu_q.data(), DType::kI32, {static_cast<int64_t>(cu_q.size())}); }
  Tensor lens() { return Tensor(kv_lens.data(), DType::kI32, {static_cast<int64_t>(kv_lens.size())}); }
  int64_t tokens() const { return cu_q.back(); }
};


std::vector<float> inv_freq_of(int64_t rotary_dim, double theta) {
  std::vector<float> f;
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    f.push_back(static_cast<float>(1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim))));
  }
  return f;
}

// zc then partial RoPE at `position`, in double.
std::vector<double> norm_rope(std::vector<double> x, const std::vector<double>& w, int64_t position,
                              const std::vector<float>& inv_freq) {
  const auto width = static_cast<int64_t>(x.size());
  double sum = 0.0;
  for (double v : x) sum += v * v;
  const double inv = 1.0 / std::sqrt(sum / static_cast<double>(width) + 1e-6);
  for (int64_t i = 0; i < width; ++i) x[static_cast<size_t>(i)] *= inv * (1.0 + w[static_cast<size_t>(i)]);
  const auto half = static_cast<int64_t>(inv_freq.size());
  for (int64_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(static_cast<float>(position) * inv_freq[static_cast<size_t>(i)]);
    const double a = x[static_cast<size_t>(i)], b = x[static_cast<size_t>(i + half)];
    x[static_cast<size_t>(i)] = a * std::cos(angle) - b * std::sin(angle);
    x[static_cast<size_t>(i + half)] = b * std::cos(angle) + a * std::sin(angle);
  }
  return x;
}

// ---------------------------------------------------------------------------------------------

TEST(QsaIndexPrologue, NormsRotatesQueriesAndCachesRawKeys) {
  Random rng(1);
  const int64_t tokens = 6, heads = 8, width = 32, rotary = 16;
  const std::vector<float> inv_freq = inv_freq_of(rotary, 10000.0);
  // q is the query part of a fused projection row [q (heads * width) | k (width)].
  const OwnedTensor fused = testing::random_tensor(DType::kF32, {tokens, (heads + 1) * width}, rng, -2.0f, 2.0f);
  const std::vector<double> before = testing::to_doubles(*fused);
  const Tensor q(fused->data(), DType::kF32, {tokens, heads, width}, {(heads + 1) * width, width, 1}, Device::cpu());
  const Tensor k = fused->slice(1, heads * width, (heads + 1) * width);
  const OwnedTensor weight = testing::random_tensor(DType::kF32, {width}, rng, -0.5f, 0.5f);
  std::vector<int32_t> positions = {0, 5, 17, 1000, 3, 70000}, slots = {3, -1, 0, 9, 15, 7};
  OwnedTensor cache(DType::kF32, {2, 8, width});
  testing::poison(*cache);
  QsaParams params;
  params.rope.rotary_dim = static_cast<int>(rotary);
  std::vector<float> freq = inv_freq;
  kernels::qsa_index_prologue(q, k, *weight, Tensor(positions.data(), DType::kI32, {tokens}),
                              Tensor(freq.data(), DType::kF32, {rotary / 2}),
                              Tensor(slots.data(), DType::kI32, {tokens}), *cache, params);
  const std::vector<double> w = testing::to_doubles(*weight), after = testing::to_doubles(*fused);
  const std::vector<double> cached = testing::to_doubles(*cache);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const auto row = before.begin() + t * (heads + 1) * width + h * width;
      const std::vector<double> expected = norm_rope(std::vector<double>(row, row + width), w, positions[static_cast<size_t>(t)], inv_freq);
      const auto got = after.begin() + t * (heads + 1) * width + h * width;
      EXPECT_TRUE(testing::close_rel_l2(std::vector<double>(got, got + width), expected, 2e-6)) << t << " " << h;
    }
    const auto key = before.begin() + t * (heads + 1) * width + heads * width;
    // The key is not modified, and is cached raw at its slot.
    EXPECT_EQ(std::vector<double>(after.begin() + (key - before.begin()), after.begin() + (key - before.begin()) + width),
              std::vector<double>(key, key + width));
    if (slots[static_cast<size_t>(t)] >= 0) {
      const auto at = cached.begin() + slots[static_cast<size_t>(t)] * width;
      EXPECT_EQ(std::vector<double>(at, at + width), std::vector<double>(key, key + width));
    }
  }
  // Slots nobody wrote stay NaN.
  EXPECT_TRUE(std::isnan(cached[static_cast<size_t>(1 * width)]));
}

// ---------------------------------------------------------------------------------------------
// Block keys and scores over a paged index cache.

struct IndexSetup {
  int64_t width = 32, rotary = 16, c = 4, heads = 8;
  Pages pages;
  OwnedTensor raw;  // [num_blocks, block_size, width]: raw index keys
  OwnedTensor weight;
  std::vector<float> inv_freq;
  std::vector<int64_t> lens;  // tokens cached per sequence
  IndexSetup(const std::vector<int64_t>& lens_, DType dtype, uint64_t seed)
      : pages(16, static_cast<int64_t>(lens_.size()), *std::max_element(lens_.begin(), lens_.end()), seed), lens(lens_) {
    Random rng(seed);
    raw = testing::random_tensor(dtype, {pages.num_blocks, pages.block_size, width}, rng, -2.0f, 2.0f);
    weight = testing::random_tensor(DType::kF32, {width}, rng, -0.5f, 0.5f);
    inv_freq = inv_freq_of(rotary, 10000.0);
  }
  QsaParams params(int64_t topk) const {
    QsaParams p;
    p.compress_ratio = static_cast<int>(c);
    p.block_topk = static_cast<int>(topk);
    p.rope.rotary_dim = static_cast<int>(rotary);
    return p;
  }
  Tensor freq() { return Tensor(inv_freq.data(), DType::kF32, {rotary / 2}); }
  // The reference block key j of sequence s, from the raw keys.
  std::vector<double> block_key(int64_t s, int64_t j) const {
    const std::vector<double> all = testing::to_doubles(*raw);
    std::vector<double> mean(static_cast<size_t>(width), 0.0);
    for (int64_t i = 0; i < c; ++i) {
      const int64_t slot = pages.slot(s, j * c + i);
      for (int64_t d = 0; d < width; ++d) mean[static_cast<size_t>(d)] += all[static_cast<size_t>(slot * width + d)] / static_cast<double>(c);
    }
    return norm_rope(mean, testing::to_doubles(*weight), j * c, inv_freq);
  }
};

TEST(QsaBlockKeys, MatchTheFormulaAndIncrementalEqualsRecomputed) {
  IndexSetup setup({45, 4, 3, 64}, DType::kF32, 2);
  const int64_t keys_per_block = setup.pages.block_size / setup.c;
  // Recompute every complete block in one call.
  OwnedTensor all_keys(DType::kF32, {setup.pages.num_blocks, keys_per_block, setup.width});
  testing::poison(*all_keys);
  Step whole;
  for (int64_t len : setup.lens) whole.add(1, static_cast<int32_t>(len - 1));
  QsaParams params = setup.params(2);
  params.all_blocks = true;
  kernels::qsa_block_keys(*setup.raw, *setup.weight, setup.freq(), whole.cu(), whole.lens(),
                          setup.pages.table_tensor(), *all_keys, params);
  const std::vector<double> got = testing::to_doubles(*all_keys);
  for (size_t s = 0; s < setup.lens.size(); ++s) {
    for (int64_t j = 0; j < setup.lens[s] / setup.c; ++j) {
      const int64_t key_slot = setup.pages.slot(static_cast<int64_t>(s), j * setup.c) / setup.c;
      const auto at = got.begin() + key_slot * setup.width;
      EXPECT_TRUE(testing::close_rel_l2(std::vector<double>(at, at + setup.width), setup.block_key(static_cast<int64_t>(s), j), 2e-6))
          << "sequence " << s << " block " << j;
    }
  }
  // The same keys, computed as the blocks complete over steps of sizes 7, 1, 1, 2, ... (each step
  // writes only its new blocks), come out bit for bit.
  OwnedTensor incremental(DType::kF32, {setup.pages.num_blocks, keys_per_block, setup.width});
  testing::poison(*incremental);
  params.all_blocks = false;
  std::vector<int64_t> done(setup.lens.size(), 0);
  const std::vector<int64_t> chunk_sizes = {7, 1, 1, 2, 5, 3, 1, 13};
  for (size_t step = 0; done != setup.lens; ++step) {
    Step st;  // finished sequences take part with q_len 0
    for (size_t s = 0; s < setup.lens.size(); ++s) {
      const int64_t q = std::min(chunk_sizes[(step + s) % chunk_sizes.size()], setup.lens[s] - done[s]);
      st.add(static_cast<int32_t>(q), static_cast<int32_t>(done[s]));
      done[s] += q;
    }
    kernels::qsa_block_keys(*setup.raw, *setup.weight, setup.freq(), st.cu(), st.lens(), setup.pages.table_tensor(),
                            *incremental, params);
  }
  EXPECT_EQ(testing::element_bytes(*incremental), testing::element_bytes(*all_keys));
}

// Rows of slot -1 (a fixed layout's padding sequences and padding rows) complete no block keys, even
// where their positions fall into block table entries the sequence does not own; the others are
// written as without row_slots.
TEST(QsaBlockKeys, RowsOfSlotMinusOneWriteNothing) {
  IndexSetup setup({12, 9}, DType::kF32, 4);
  const int64_t keys_per_block = setup.pages.block_size / setup.c;
  QsaParams params = setup.params(2);
  // Sequence 0: ctx 4, rows at 4..11, the last three padding (slot -1): the block [8, 12) ends on a
  // padding row. Sequence 1: a padding sequence, rows 0..8 all slot -1.
  Step st;
  st.add(8, 4);
  st.add(9, 0);
  std::vector<int32_t> slots(static_cast<size_t>(st.tokens()), 0);
  for (int i = 5; i < 8; ++i) slots[static_cast<size_t>(i)] = -1;
  for (int i = 8; i < 17; ++i) slots[static_cast<size_t>(i)] = -1;
  OwnedTensor plain(DType::kF32, {setup.pages.num_blocks, keys_per_block, setup.width});
  OwnedTensor guarded(DType::kF32, {setup.pages.num_blocks, keys_per_block, setup.width});
  testing::poison(*plain);
  testing::poison(*guarded);
  kernels::qsa_block_keys(*setup.raw, *setup.weight, setup.freq(), st.cu(), st.lens(), setup.pages.table_tensor(),
                          *plain, params);
  params.row_slots = Tensor(slots.data(), DType::kI32, {st.tokens()});
  kernels::qsa_block_keys(*setup.raw, *setup.weight, setup.freq(), st.cu(), st.lens(), setup.pages.table_tensor(),
                          *guarded, params);
  const std::vector<double> a = testing::to_doubles(*plain), g = testing::to_doubles(*guarded);
  const auto block = [&](const std::vector<double>& keys, int64_t s, int64_t j) {
    const auto at = keys.begin() + setup.pages.slot(s, j * setup.c) / setup.c * setup.width;
    return std::vector<double>(at, at + setup.width);
  };
  // Sequence 0's block 1 (tokens 4..7, all real rows) is written alike; block 2 (8..11) is not.
  EXPECT_EQ(block(g, 0, 1), block(a, 0, 1));
  EXPECT_FALSE(std::isnan(block(a, 0, 2)[0]));
  EXPECT_TRUE(std::isnan(block(g, 0, 2)[0]));
  for (int64_t j = 0; j < 2; ++j) EXPECT_TRUE(std::isnan(block(g, 1, j)[0])) << "padding sequence block " << j;
}

TEST(QsaScores, MatchTheFormula) {
  IndexSetup setup({45, 4, 64}, DType::kF32, 3);
  Random rng(4);
  const int64_t keys_per_block = setup.pages.block_size / setup.c;
  OwnedTensor block_keys(DType::kF32, {setup.pages.num_blocks, keys_per_block, setup.width});
  Step whole;
  for (int64_t len : setup.lens) whole.add(1, static_cast<int32_t>(len - 1));
  QsaParams params = setup.params(2);
  params.all_blocks = true;
  kernels::qsa_block_keys(*setup.raw, *setup.weight, setup.freq(), whole.cu(), whole.lens(),
                          setup.pages.table_tensor(), *block_keys, params);
  // Queries: sequence 0 gets 5 rows at positions 40..44, sequence 1 one row (position 3: nb = 1),
  // sequence 2 three rows.
  Step step;
  step.add(5, 40);
  step.add(1, 3);
  step.add(3, 61);
  const OwnedTensor q = testing::random_tensor(DType::kF32, {step.tokens(), setup.heads, setup.width}, rng, -1.0f, 1.0f);
  OwnedTensor scores(DType::kF32, {step.tokens(), 20});
  testing::poison(*scores);
  kernels::qsa_scores(*q, *block_keys, step.cu(), step.lens(), setup.pages.table_tensor(), *scores, params);
  const std::vector<double> qv = testing::to_doubles(*q), got = testing::to_doubles(*scores);
  const std::vector<double> keys = testing::to_doubles(*block_keys);
  for (size_t s = 0; s < 3; ++s) {
    for (int32_t t = step.cu_q[s]; t < step.cu_q[s + 1]; ++t) {
      const int64_t position = step.kv_lens[s] - (step.cu_q[s + 1] - step.cu_q[s]) + (t - step.cu_q[s]);
      const int64_t nb = (position + 1) / setup.c;
      for (int64_t j = 0; j < 20; ++j) {
        const double value = got[static_cast<size_t>(t * 20 + j)];
        if (j >= nb) {
          EXPECT_TRUE(std::isnan(value)) << "row " << t << " entry " << j << " is past nb " << nb;
          continue;
        }
        const int64_t key_slot = setup.pages.slot(static_cast<int64_t>(s), j * setup.c) / setup.c;
        double total = 0.0;
        for (int64_t h = 0; h < setup.heads; ++h) {
          double dot = 0.0;
          for (int64_t d = 0; d < setup.width; ++d) {
            dot += qv[static_cast<size_t>((t * setup.heads + h) * setup.width + d)] * keys[static_cast<size_t>(key_slot * setup.width + d)];
          }
          total += std::max(dot, 0.0);
        }
        EXPECT_NEAR(value, total / std::sqrt(static_cast<double>(setup.width)), 1e-6 * (1.0 + std::fabs(total)));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Top-k selection.

// The k best of `row` (higher score first, ties by lower index), ascending.
std::vector<int32_t> reference_topk(const std::vector<float>& row, int64_t k) {
  std::vector<int32_t> order(row.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[static_cast<size_t>(a)] > row[static_cast<size_t>(b)]; });
  order.resize(static_cast<size_t>(std::min<int64_t>(k, static_cast<int64_t>(row.size()))));
  std::sort(order.begin(), order.end());
  return order;
}

TEST(QsaTopk, SelectsTheBestBlocksWithTiesTowardLowerIndices) {
  Random rng(5);
  const int64_t c = 4, k = 6, width = 40;
  // Rows (one sequence per row, decode): nb = (kv_len) / c.
  const std::vector<int32_t> kv_lens_v = {160, 159, 24, 27, 3, 100, 160, 160};
  std::vector<std::vector<float>> rows;
  rows.push_back(rng.floats(40, 0.0f, 5.0f));               // plain
  rows.push_back(std::vector<float>(39, 0.0f));             // all zero: 0..5
  rows.push_back(rng.floats(6, 0.0f, 5.0f));                // nb == k: everything
  rows.push_back(rng.floats(6, 0.0f, 5.0f));                // 27 / 4 = 6: everything
  rows.push_back({});                                       // nb 0
  rows.push_back(std::vector<float>(25, 0.0f));             // three positives, ties at zero, -0 among them
  rows.push_back(std::vector<float>(40, 1.5f));             // equal everywhere
  rows.push_back(rng.floats(40, 0.0f, 0.5f));               // the cut-off inside a tie of equal values
  rows[5][7] = 2.0f;
  rows[5][20] = 3.0f;
  rows[5][24] = 1.0f;
  rows[5][0] = -0.0f;
  rows[5][2] = -0.0f;
  rows[7][1] = 0.9f;
  rows[7][5] = 0.8f;
  for (int j : {3, 9, 12, 30, 33}) rows[7][static_cast<size_t>(j)] = 0.7f;  // five tied, four make the cut
  Step step;
  for (int32_t len : kv_lens_v) step.add(1, len - 1);
  OwnedTensor scores(DType::kF32, {step.tokens(), width});
  testing::poison(*scores);
  for (size_t r = 0; r < rows.size(); ++r) {
    for (size_t j = 0; j < rows[r].size(); ++j) static_cast<float*>(scores->data())[r * width + j] = rows[r][j];
  }
  OwnedTensor selected(DType::kI32, {step.tokens(), k});
  QsaParams params;
  params.compress_ratio = static_cast<int>(c);
  params.block_topk = static_cast<int>(k);
  kernels::qsa_topk(*scores, step.cu(), step.lens(), *selected, params);
  const auto* sel = selected->data_as<const int32_t>();
  for (size_t r = 0; r < rows.size(); ++r) {
    std::vector<int32_t> expected = reference_topk(rows[r], k);
    expected.resize(static_cast<size_t>(k), -1);
    EXPECT_EQ(std::vector<int32_t>(sel + r * k, sel + (r + 1) * k), expected) << "row " << r;
  }
  EXPECT_EQ(std::vector<int32_t>(sel + 5 * k, sel + 6 * k), (std::vector<int32_t>{0, 1, 2, 7, 20, 24}));
  EXPECT_EQ(std::vector<int32_t>(sel + 1 * k, sel + 2 * k), (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(std::vector<int32_t>(sel + 7 * k, sel + 8 * k), (std::vector<int32_t>{1, 3, 5, 9, 12, 30}));
}

// ---------------------------------------------------------------------------------------------
// Sparse attention against full attention with a mask from the selection, and the whole pipeline
// against a brute-force pass of §7.3 over whole sequences.

struct KvSetup {
  int64_t heads = 4, kv_heads = 2, head_dim = 32;
  Pages pages;
  OwnedTensor k_cache, v_cache;  // [num_blocks, block_size, kv_heads, head_dim]
  KvSetup(int64_t num_seqs, int64_t max_len, uint64_t seed) : pages(16, num_seqs, max_len, seed) {
    Random rng(seed + 100);
    k_cache = testing::random_tensor(DType::kF32, {pages.num_blocks, pages.block_size, kv_heads, head_dim}, rng);
    v_cache = testing::random_tensor(DType::kF32, {pages.num_blocks, pages.block_size, kv_heads, head_dim}, rng);
  }
};

// out[t, h] = softmax over the visible keys of `mask` (key -> attended) of scale * q.k, times v.
std::vector<double> masked_attention(const KvSetup& kv, const std::vector<double>& q, int64_t s, int64_t t,
                                     const std::vector<bool>& mask, double scale) {
  const std::vector<double> kc = testing::to_doubles(*kv.k_cache), vc = testing::to_doubles(*kv.v_cache);
  std::vector<double> out;
  for (int64_t h = 0; h < kv.heads; ++h) {
    const int64_t kvh = h / (kv.heads / kv.kv_heads);
    std::vector<double> weights(mask.size(), 0.0);
    double max_score = -INFINITY;
    for (size_t key = 0; key < mask.size(); ++key) {
      if (!mask[key]) continue;
      const int64_t slot = kv.pages.slot(s, static_cast<int64_t>(key));
      double dot = 0.0;
      for (int64_t d = 0; d < kv.head_dim; ++d) {
        dot += q[static_cast<size_t>((t * kv.heads + h) * kv.head_dim + d)] * kc[static_cast<size_t>((slot * kv.kv_heads + kvh) * kv.head_dim + d)];
      }
      weights[key] = dot * scale;
      max_score = std::max(max_score, weights[key]);
    }
    double denom = 0.0;
    for (size_t key = 0; key < mask.size(); ++key) {
      weights[key] = mask[key] ? std::exp(weights[key] - max_score) : 0.0;
      denom += weights[key];
    }
    for (int64_t d = 0; d < kv.head_dim; ++d) {
      double acc = 0.0;
      for (size_t key = 0; key < mask.size(); ++key) {
        if (!mask[key]) continue;
        const int64_t slot = kv.pages.slot(s, static_cast<int64_t>(key));
        acc += weights[key] * vc[static_cast<size_t>((slot * kv.kv_heads + kvh) * kv.head_dim + d)];
      }
      out.push_back(acc / denom);
    }
  }
  return out;
}

TEST(QsaAttention, MatchesMaskedFullAttention) {
  const int64_t c = 4, k = 5;
  KvSetup kv(3, 90, 6);
  Random rng(7);
  // Sequence 0: 4 rows at positions 60..63 (sparse, tail lengths 1, 2, 3, 0); sequence 1: one row at
  // position 19 (nb = 5 = k: dense); sequence 2: a decode row at position 87.
  Step step;
  step.add(4, 60);
  step.add(1, 19);
  step.add(1, 87);
  const int64_t tokens = step.tokens();
  const OwnedTensor q = testing::random_tensor(DType::kF32, {tokens, kv.heads, kv.head_dim}, rng);
  // Random distinct ascending selections of k blocks below nb for the sparse rows (-1 rows: dense).
  OwnedTensor selected(DType::kI32, {tokens, k});
  auto* sel = selected->data_as<int32_t>();
  std::vector<std::vector<bool>> masks;
  for (size_t s = 0; s < 3; ++s) {
    for (int32_t t = step.cu_q[s]; t < step.cu_q[s + 1]; ++t) {
      const int64_t p = step.kv_lens[s] - (step.cu_q[s + 1] - step.cu_q[s]) + (t - step.cu_q[s]);
      const int64_t nb = (p + 1) / c;
      std::vector<bool> mask(static_cast<size_t>(p + 1), nb <= k);
      std::vector<int32_t> blocks(static_cast<size_t>(nb));
      std::iota(blocks.begin(), blocks.end(), 0);
      std::shuffle(blocks.begin(), blocks.end(), rng.engine());
      blocks.resize(static_cast<size_t>(std::min(nb, k)));
      std::sort(blocks.begin(), blocks.end());
      for (int64_t i = 0; i < k; ++i) sel[t * k + i] = i < static_cast<int64_t>(blocks.size()) ? blocks[static_cast<size_t>(i)] : -1;
      if (nb > k) {
        for (int32_t b : blocks) {
          for (int64_t i = 0; i < c; ++i) mask[static_cast<size_t>(b * c + i)] = true;
        }
        for (int64_t key = nb * c; key <= p; ++key) mask[static_cast<size_t>(key)] = true;  // the tail
      }
      masks.push_back(mask);
    }
  }
  OwnedTensor out(DType::kF32, {tokens, kv.heads, kv.head_dim});
  testing::poison(*out);
  QsaAttentionParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(kv.head_dim));
  params.compress_ratio = static_cast<int>(c);
  params.block_topk = static_cast<int>(k);
  kernels::qsa_attention(*q, *kv.k_cache, *kv.v_cache, step.cu(), step.lens(), kv.pages.table_tensor(), *selected,
                         *out, params);
  const std::vector<double> qv = testing::to_doubles(*q), got = testing::to_doubles(*out);
  size_t row = 0;
  for (size_t s = 0; s < 3; ++s) {
    for (int32_t t = step.cu_q[s]; t < step.cu_q[s + 1]; ++t, ++row) {
      const std::vector<double> expected = masked_attention(kv, qv, static_cast<int64_t>(s), t, masks[row], params.scale);
      const auto at = got.begin() + t * kv.heads * kv.head_dim;
      EXPECT_TRUE(testing::close_rel_l2(std::vector<double>(at, at + kv.heads * kv.head_dim), expected, 2e-6)) << "row " << t;
    }
  }
}

TEST(QsaPipeline, ChunkedOpsMatchBruteForceSelectionAndAttention) {
  // One sequence of 70 tokens, c = 4, block_topk = 5 (budget 20): positions from 23 on select
  // sparsely. Index queries, raw index keys and K/V are random; the ops run as prefill chunks of
  // 17, 9, 30 tokens, then decode steps. 8 index heads: no exact ties at the cut-off.
  const int64_t length = 70, c = 4, k = 5, n_idx = 8, d_idx = 32, rotary = 16;
  KvSetup kv(1, length, 8);
  Random rng(9);
  const std::vector<float> inv_freq = inv_freq_of(rotary, 10000.0);
  std::vector<float> freq = inv_freq;
  const OwnedTensor q_raw = testing::random_tensor(DType::kF32, {length, n_idx, d_idx}, rng, -1.0f, 1.0f);
  const OwnedTensor k_raw = testing::random_tensor(DType::kF32, {length, d_idx}, rng, -1.0f, 1.0f);
  const OwnedTensor q_attn = testing::random_tensor(DType::kF32, {length, kv.heads, kv.head_dim}, rng);
  const OwnedTensor q_weight = testing::random_tensor(DType::kF32, {d_idx}, rng, -0.5f, 0.5f);
  const OwnedTensor k_weight = testing::random_tensor(DType::kF32, {d_idx}, rng, -0.5f, 0.5f);
  const std::vector<double> qw = testing::to_doubles(*q_weight), kw = testing::to_doubles(*k_weight);
  const std::vector<double> qr = testing::to_doubles(*q_raw), kr = testing::to_doubles(*k_raw);

  // Brute force (§7.3 steps 4-7) for every position.
  std::vector<std::vector<bool>> masks;
  for (int64_t p = 0; p < length; ++p) {
    const int64_t nb = (p + 1) / c;
    std::vector<std::vector<double>> q_rot;
    for (int64_t h = 0; h < n_idx; ++h) {
      const auto row = qr.begin() + (p * n_idx + h) * d_idx;
      q_rot.push_back(norm_rope(std::vector<double>(row, row + d_idx), qw, p, inv_freq));
    }
    std::vector<float> scores;
    for (int64_t j = 0; j < nb; ++j) {
      std::vector<double> mean(static_cast<size_t>(d_idx), 0.0);
      for (int64_t i = 0; i < c; ++i) {
        for (int64_t d = 0; d < d_idx; ++d) mean[static_cast<size_t>(d)] += kr[static_cast<size_t>((j * c + i) * d_idx + d)] / static_cast<double>(c);
      }
      const std::vector<double> key = norm_rope(mean, kw, j * c, inv_freq);
      double total = 0.0;
      for (const auto& qh : q_rot) {
        double dot = 0.0;
        for (int64_t d = 0; d < d_idx; ++d) dot += qh[static_cast<size_t>(d)] * key[static_cast<size_t>(d)];
        total += std::max(dot, 0.0);
      }
      scores.push_back(static_cast<float>(total / std::sqrt(static_cast<double>(d_idx))));
    }
    std::vector<bool> mask(static_cast<size_t>(p + 1), false);
    for (int32_t b : reference_topk(scores, k)) {
      for (int64_t i = 0; i < c; ++i) mask[static_cast<size_t>(b * c + i)] = true;
    }
    for (int64_t key = nb * c; key <= p; ++key) mask[static_cast<size_t>(key)] = true;
    masks.push_back(mask);
  }

  // The ops, chunk by chunk.
  const int64_t keys_per_block = kv.pages.block_size / c;
  OwnedTensor index_cache(DType::kF32, {kv.pages.num_blocks, kv.pages.block_size, d_idx});
  OwnedTensor block_keys(DType::kF32, {kv.pages.num_blocks, keys_per_block, d_idx});
  testing::poison(*index_cache);
  testing::poison(*block_keys);
  QsaParams params;
  params.compress_ratio = static_cast<int>(c);
  params.block_topk = static_cast<int>(k);
  params.rope.rotary_dim = static_cast<int>(rotary);
  QsaAttentionParams attention;
  attention.scale = 1.0f / std::sqrt(static_cast<float>(kv.head_dim));
  attention.compress_ratio = static_cast<int>(c);
  attention.block_topk = static_cast<int>(k);
  const std::vector<double> qa = testing::to_doubles(*q_attn);
  int64_t done = 0;
  std::vector<int64_t> chunks = {17, 9, 30};
  while (done + std::accumulate(chunks.begin(), chunks.end(), int64_t{0}) < length) chunks.push_back(1);
  for (int64_t chunk : chunks) {
    Step step;
    step.add(static_cast<int32_t>(chunk), static_cast<int32_t>(done));
    OwnedTensor q(DType::kF32, {chunk, n_idx, d_idx});
    copy_tensor(*q, q_raw->slice(0, done, done + chunk));
    std::vector<int32_t> positions, slots;
    for (int64_t i = 0; i < chunk; ++i) {
      positions.push_back(static_cast<int32_t>(done + i));
      slots.push_back(static_cast<int32_t>(kv.pages.slot(0, done + i)));
    }
    kernels::qsa_index_prologue(*q, k_raw->slice(0, done, done + chunk), *q_weight,
                                Tensor(positions.data(), DType::kI32, {chunk}), Tensor(freq.data(), DType::kF32, {rotary / 2}),
                                Tensor(slots.data(), DType::kI32, {chunk}), *index_cache, params);
    kernels::qsa_block_keys(*index_cache, *k_weight, Tensor(freq.data(), DType::kF32, {rotary / 2}), step.cu(),
                            step.lens(), kv.pages.table_tensor(), *block_keys, params);
    OwnedTensor scores(DType::kF32, {chunk, length / c});
    kernels::qsa_scores(*q, *block_keys, step.cu(), step.lens(), kv.pages.table_tensor(), *scores, params);
    OwnedTensor selected(DType::kI32, {chunk, k});
    kernels::qsa_topk(*scores, step.cu(), step.lens(), *selected, params);
    OwnedTensor out(DType::kF32, {chunk, kv.heads, kv.head_dim});
    testing::poison(*out);
    OwnedTensor qa_chunk(DType::kF32, {chunk, kv.heads, kv.head_dim});
    copy_tensor(*qa_chunk, q_attn->slice(0, done, done + chunk));
    kernels::qsa_attention(*qa_chunk, *kv.k_cache, *kv.v_cache, step.cu(), step.lens(), kv.pages.table_tensor(),
                           *selected, *out, attention);
    const auto* sel = selected->data_as<const int32_t>();
    const std::vector<double> got = testing::to_doubles(*out);
    for (int64_t i = 0; i < chunk; ++i) {
      const int64_t p = done + i, nb = (p + 1) / c;
      std::vector<bool> mask(static_cast<size_t>(p + 1), nb <= k);
      if (nb > k) {
        for (int64_t e = 0; e < k; ++e) {
          for (int64_t j = 0; j < c; ++j) mask[static_cast<size_t>(sel[i * k + e] * c + j)] = true;
        }
        for (int64_t key = nb * c; key <= p; ++key) mask[static_cast<size_t>(key)] = true;
      }
      EXPECT_EQ(mask, masks[static_cast<size_t>(p)]) << "selection at position " << p;
      const std::vector<double> q_all(qa.begin(), qa.end());
      const std::vector<double> expected = masked_attention(kv, q_all, 0, p, masks[static_cast<size_t>(p)], attention.scale);
      const auto at = got.begin() + i * kv.heads * kv.head_dim;
      EXPECT_TRUE(testing::close_rel_l2(std::vector<double>(at, at + kv.heads * kv.head_dim), expected, 2e-6))
          << "position " << p;
    }
    done += chunk;
  }
  EXPECT_EQ(done, length);
  // Sparse rows really are sparse: the last position attends k * c + tail keys of 70.
  EXPECT_EQ(std::count(masks.back().begin(), masks.back().end(), true), k * c + (length % c));
}

}  // namespace
}  // namespace metrale
