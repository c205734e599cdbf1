// kv_cache_write + paged_attention over ragged batches, against dense causal attention computed
// directly from the un-paged keys and values. Several sequences with different query lengths and
// cached contexts share one call; block tables are shuffled so that a sequence's blocks are neither
// contiguous nor ordered; GQA groups, decode rows, sliding windows, bf16 and FP8 (e4m3) caches.
#include "kernels/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <numeric>

#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using testing::Random;

struct SequenceSpec {
  int64_t cached;  // tokens already in the cache before this step
  int64_t q_len;   // tokens added by this step
  int64_t kv_len() const { return cached + q_len; }
};

struct Geometry {
  int64_t heads, kv_heads, head_dim, block_size, num_blocks;
};

// One ragged step: the dense per-sequence K/V/Q, the paged cache holding them, and the batch metadata.
struct PagedBatch {
  Geometry g;
  std::vector<SequenceSpec> seqs;
  std::vector<std::vector<float>> keys, values;  // per sequence [kv_len, kv_heads, head_dim], logical
  OwnedTensor q;                                 // [T, heads, head_dim]
  OwnedTensor k_cache, v_cache;                  // [num_blocks, block_size, kv_heads, head_dim]
  std::vector<int32_t> cu_q, kv_lens, block_tables, slot_mapping;
  int64_t max_blocks = 0;

  int64_t tokens() const { return cu_q.back(); }
  Tensor cu_q_tensor() { return Tensor(cu_q.data(), DType::kI32, {static_cast<int64_t>(seqs.size()) + 1}); }
  Tensor kv_lens_tensor() { return Tensor(kv_lens.data(), DType::kI32, {static_cast<int64_t>(seqs.size())}); }
  Tensor tables_tensor() {
    return Tensor(block_tables.data(), DType::kI32, {static_cast<int64_t>(seqs.size()), max_blocks});
  }
  int32_t slot_of(size_t s, int64_t position) const {
    const int32_t block =
        block_tables[s * static_cast<size_t>(max_blocks) + static_cast<size_t>(position / g.block_size)];
    return block * static_cast<int32_t>(g.block_size) + static_cast<int32_t>(position % g.block_size);
  }
};

// Parameters set by name: the struct also carries planning fields that the CPU kernels ignore.
kernels::AttentionParams attention_params(double scale, int window) {
  kernels::AttentionParams params;
  params.scale = static_cast<float>(scale);
  params.window = window;
  return params;
}

// Builds the batch and fills the cache in two kv_cache_write calls, as two engine steps would: first
// every sequence's cached context, then this step's new tokens (ragged, all sequences in one call).
// FP8 caches quantise with `scales` (host [kv_heads] f32 each); `value_gain[h]` multiplies the
// keys and values of KV head h (heads of different ranges need their own scales).
PagedBatch make_batch(const Geometry& g, const std::vector<SequenceSpec>& seqs, DType cache_dtype, Random& rng,
                      const kernels::KvScales& scales = {}, const std::vector<float>& head_gain = {}) {
  PagedBatch b{g, seqs, {}, {}, {}, {}, {}, {}, {}, {}, {}, 0};
  const size_t count = seqs.size();
  for (const auto& s : seqs) b.max_blocks = std::max(b.max_blocks, (s.kv_len() + g.block_size - 1) / g.block_size);
  b.max_blocks += 1;  // a spare column that no sequence uses: the kernel must not read it
  std::vector<int32_t> free_blocks(static_cast<size_t>(g.num_blocks));
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng.engine());
  b.block_tables.assign(count * static_cast<size_t>(b.max_blocks), -12345);  // unused entries are garbage
  size_t next_free = 0;
  b.cu_q = {0};
  for (size_t s = 0; s < count; ++s) {
    const int64_t blocks = (seqs[s].kv_len() + g.block_size - 1) / g.block_size;
    for (int64_t i = 0; i < blocks; ++i)
      b.block_tables[s * static_cast<size_t>(b.max_blocks) + static_cast<size_t>(i)] = free_blocks.at(next_free++);
    b.cu_q.push_back(b.cu_q.back() + static_cast<int32_t>(seqs[s].q_len));
    b.kv_lens.push_back(static_cast<int32_t>(seqs[s].kv_len()));
    const size_t kv_elems = static_cast<size_t>(seqs[s].kv_len() * g.kv_heads * g.head_dim);
    b.keys.push_back(rng.floats(kv_elems, -1.5f, 1.5f));
    b.values.push_back(rng.floats(kv_elems, -1.0f, 1.0f));
    if (!head_gain.empty()) {
      for (size_t e = 0; e < kv_elems; ++e) {
        const float gain = head_gain[(e / static_cast<size_t>(g.head_dim)) % static_cast<size_t>(g.kv_heads)];
        b.keys.back()[e] *= gain;
        b.values.back()[e] *= gain;
      }
    }
  }
  b.q = random_tensor(DType::kF32, {b.tokens(), g.heads, g.head_dim}, rng, -1.5f, 1.5f);
  b.k_cache = OwnedTensor(cache_dtype, {g.num_blocks, g.block_size, g.kv_heads, g.head_dim});
  b.v_cache = OwnedTensor(cache_dtype, {g.num_blocks, g.block_size, g.kv_heads, g.head_dim});
  if (cache_dtype != DType::kF8E4M3) {
    testing::poison(*b.k_cache);  // any slot the kernel reads without it being written shows up as NaN
    testing::poison(*b.v_cache);
  } else {
    std::memset(b.k_cache->data(), 0x7f, b.k_cache->nbytes());  // e4m3 NaN
    std::memset(b.v_cache->data(), 0x7f, b.v_cache->nbytes());
  }

  // Writes positions [begin_of(s), end_of(s)) of every sequence in one kv_cache_write call.
  const auto write = [&](auto begin_of, auto end_of) {
    std::vector<float> k_rows, v_rows;
    std::vector<int32_t> slots;
    const size_t row = static_cast<size_t>(g.kv_heads * g.head_dim);
    for (size_t s = 0; s < count; ++s) {
      for (int64_t p = begin_of(s); p < end_of(s); ++p) {
        k_rows.insert(k_rows.end(), b.keys[s].begin() + static_cast<ptrdiff_t>(static_cast<size_t>(p) * row),
                      b.keys[s].begin() + static_cast<ptrdiff_t>(static_cast<size_t>(p + 1) * row));
        v_rows.insert(v_rows.end(), b.values[s].begin() + static_cast<ptrdiff_t>(static_cast<size_t>(p) * row),
                      b.values[s].begin() + static_cast<ptrdiff_t>(static_cast<size_t>(p + 1) * row));
        slots.push_back(b.slot_of(s, p));
      }
    }
    const auto n = static_cast<int64_t>(slots.size());
    if (n == 0) return;
    kernels::kv_cache_write(Tensor(k_rows.data(), DType::kF32, {n, g.kv_heads, g.head_dim}),
                            Tensor(v_rows.data(), DType::kF32, {n, g.kv_heads, g.head_dim}),
                            Tensor(slots.data(), DType::kI32, {n}), *b.k_cache, *b.v_cache, scales);
  };
  write([](size_t) { return int64_t{0}; }, [&](size_t s) { return seqs[s].cached; });
  write([&](size_t s) { return seqs[s].cached; }, [&](size_t s) { return seqs[s].kv_len(); });
  for (size_t s = 0; s < count; ++s)
    for (int64_t p = seqs[s].cached; p < seqs[s].kv_len(); ++p) b.slot_mapping.push_back(b.slot_of(s, p));
  return b;
}

// Dense causal (optionally windowed) GQA attention from the un-paged K/V, in double.
std::vector<double> reference_attention(const PagedBatch& b, const std::vector<double>& q, double scale, int window,
                                        bool round_kv_to_bf16) {
  const Geometry& g = b.g;
  const int64_t group = g.heads / g.kv_heads;
  std::vector<double> out(q.size());
  const auto kv_value = [&](float v) {
    return round_kv_to_bf16 ? static_cast<double>(round_to_bf16(v)) : static_cast<double>(v);
  };
  for (size_t s = 0; s < b.seqs.size(); ++s) {
    for (int64_t i = 0; i < b.seqs[s].q_len; ++i) {
      const int64_t t = b.cu_q[s] + i;
      const int64_t position = b.seqs[s].cached + i;
      const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
      for (int64_t h = 0; h < g.heads; ++h) {
        const int64_t kvh = h / group;
        const size_t q_at = static_cast<size_t>((t * g.heads + h) * g.head_dim);
        std::vector<double> scores;
        double max_score = -INFINITY;
        for (int64_t j = first; j <= position; ++j) {
          const size_t k_at = static_cast<size_t>((j * g.kv_heads + kvh) * g.head_dim);
          double dot = 0.0;
          for (int64_t d = 0; d < g.head_dim; ++d)
            dot += q[q_at + static_cast<size_t>(d)] * kv_value(b.keys[s][k_at + static_cast<size_t>(d)]);
          scores.push_back(dot * scale);
          max_score = std::max(max_score, dot * scale);
        }
        double denom = 0.0;
        for (auto& score : scores) denom += (score = std::exp(score - max_score));
        for (int64_t d = 0; d < g.head_dim; ++d) {
          double acc = 0.0;
          for (int64_t j = first; j <= position; ++j) {
            const size_t v_at = static_cast<size_t>((j * g.kv_heads + kvh) * g.head_dim + d);
            acc += scores[static_cast<size_t>(j - first)] * kv_value(b.values[s][v_at]);
          }
          out[q_at + static_cast<size_t>(d)] = acc / denom;
        }
      }
    }
  }
  return out;
}

// Runs paged_attention on the batch and compares with the dense reference.
void check_attention(PagedBatch& b, int window, bool bf16_cache) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(b.g.head_dim));
  OwnedTensor out(DType::kF32, {b.tokens(), b.g.heads, b.g.head_dim});
  testing::poison(*out);
  kernels::paged_attention(*b.q, *b.k_cache, *b.v_cache, b.cu_q_tensor(), b.kv_lens_tensor(), b.tables_tensor(), *out,
                           attention_params(scale, window));
  const auto expected = reference_attention(b, testing::to_doubles(*b.q), scale, window, bf16_cache);
  EXPECT_TRUE(testing::close_rel_l2(*out, expected, testing::kF32Tolerance)) << "window " << window;
}

const std::vector<SequenceSpec> kMixedStep = {
    {0, 5},   // prefill from scratch
    {9, 1},   // decode row after a context that ends mid-block
    {6, 3},   // chunked prefill continuing a cached prefix
    {0, 1},   // a one-token prompt
    {2, 7},   // chunk crossing several blocks
    {12, 1},  // decode right after a full block boundary
};

TEST(KvCacheWrite, PlacesEveryTokenInItsSlot) {
  Random rng(601);
  const Geometry g{4, 2, 12, 4, 24};
  PagedBatch b = make_batch(g, kMixedStep, DType::kF32, rng);
  const std::vector<double> k_cache = testing::to_doubles(*b.k_cache), v_cache = testing::to_doubles(*b.v_cache);
  const size_t row = static_cast<size_t>(g.kv_heads * g.head_dim);
  for (size_t s = 0; s < b.seqs.size(); ++s) {
    for (int64_t p = 0; p < b.seqs[s].kv_len(); ++p) {
      const size_t slot = static_cast<size_t>(b.slot_of(s, p));
      for (size_t e = 0; e < row; ++e) {
        ASSERT_EQ(k_cache[slot * row + e], b.keys[s][static_cast<size_t>(p) * row + e]) << "seq " << s << " pos " << p;
        ASSERT_EQ(v_cache[slot * row + e], b.values[s][static_cast<size_t>(p) * row + e])
            << "seq " << s << " pos " << p;
      }
    }
  }
}

TEST(KvCacheWrite, NegativeSlotsAreSkippedAndStridedInputsRead) {
  Random rng(602);
  const int64_t kv_heads = 2, head_dim = 8, tokens = 4;
  OwnedTensor k_cache(DType::kBF16, {3, 2, kv_heads, head_dim});
  OwnedTensor v_cache(DType::kBF16, {3, 2, kv_heads, head_dim});
  testing::fill_random(*k_cache, rng);
  testing::fill_random(*v_cache, rng);
  const std::vector<uint8_t> k_before = testing::element_bytes(*k_cache);
  // k and v are the kv-head slices of one fused [T, q + 2 kv, D] projection.
  const OwnedTensor fused = random_tensor(DType::kF32, {tokens, 3 + 2 * kv_heads, head_dim}, rng);
  const Tensor k = fused->slice(1, 3, 3 + kv_heads), v = fused->slice(1, 3 + kv_heads, 3 + 2 * kv_heads);
  std::vector<int32_t> slots = {5, -1, 0, 3};
  kernels::kv_cache_write(k, v, Tensor(slots.data(), DType::kI32, {tokens}), *k_cache, *v_cache);
  const std::vector<double> kd = testing::to_doubles(k), vd = testing::to_doubles(v);
  const std::vector<double> kc = testing::to_doubles(*k_cache), vc = testing::to_doubles(*v_cache);
  const size_t row = static_cast<size_t>(kv_heads * head_dim);
  for (size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] < 0) continue;
    for (size_t e = 0; e < row; ++e) {
      EXPECT_EQ(kc[static_cast<size_t>(slots[t]) * row + e], round_to_bf16(static_cast<float>(kd[t * row + e])));
      EXPECT_EQ(vc[static_cast<size_t>(slots[t]) * row + e], round_to_bf16(static_cast<float>(vd[t * row + e])));
    }
  }
  // Slots 1, 2 and 4 were not targeted and keep their bytes.
  const std::vector<uint8_t> k_after = testing::element_bytes(*k_cache);
  const size_t slot_bytes = row * 2;
  for (const size_t untouched : {1u, 2u, 4u}) {
    EXPECT_TRUE(std::equal(k_after.begin() + static_cast<ptrdiff_t>(untouched * slot_bytes),
                           k_after.begin() + static_cast<ptrdiff_t>((untouched + 1) * slot_bytes),
                           k_before.begin() + static_cast<ptrdiff_t>(untouched * slot_bytes)))
        << "slot " << untouched;
  }
  std::vector<int32_t> bad = {0, 6, 1, 2};
  EXPECT_THROW(kernels::kv_cache_write(k, v, Tensor(bad.data(), DType::kI32, {tokens}), *k_cache, *v_cache), Error);
}

TEST(PagedAttention, MixedRaggedBatchWithGqa) {
  Random rng(603);
  const Geometry g{6, 2, 16, 4, 40};  // GQA group of 3
  PagedBatch b = make_batch(g, kMixedStep, DType::kF32, rng);
  check_attention(b, 0, false);
}

TEST(PagedAttention, HeadDimNotAMultipleOfSixteen) {
  Random rng(604);
  const Geometry g{4, 4, 20, 3, 40};  // no GQA, odd block size
  PagedBatch b = make_batch(g, kMixedStep, DType::kF32, rng);
  check_attention(b, 0, false);
}

TEST(PagedAttention, MultiQueryAttention) {
  Random rng(605);
  const Geometry g{8, 1, 8, 5, 30};  // all heads share one KV head
  PagedBatch b = make_batch(g, {{3, 4}, {0, 6}, {17, 2}}, DType::kF32, rng);
  check_attention(b, 0, false);
}

TEST(PagedAttention, DecodeOnlyBatch) {
  Random rng(606);
  const Geometry g{4, 2, 16, 4, 40};
  PagedBatch b = make_batch(g, {{0, 1}, {3, 1}, {4, 1}, {15, 1}, {22, 1}}, DType::kF32, rng);
  check_attention(b, 0, false);
}

TEST(PagedAttention, SlidingWindows) {
  Random rng(607);
  const Geometry g{4, 2, 16, 4, 40};
  PagedBatch b = make_batch(g, kMixedStep, DType::kF32, rng);
  for (const int window : {1, 2, 3, 5, 8, 100}) check_attention(b, window, false);
}

TEST(PagedAttention, Bf16Cache) {
  Random rng(608);
  const Geometry g{6, 2, 16, 4, 40};
  PagedBatch b = make_batch(g, kMixedStep, DType::kBF16, rng);
  check_attention(b, 0, true);  // the reference reads the bf16-rounded keys and values
  check_attention(b, 3, true);
}

TEST(PagedAttention, StridedQueryAndOutput) {
  // q is the head slice of a fused projection and out the head slice of a wider buffer.
  Random rng(609);
  const Geometry g{4, 2, 16, 4, 40};
  PagedBatch b = make_batch(g, kMixedStep, DType::kF32, rng);
  const int64_t tokens = b.tokens();
  const OwnedTensor fused = random_tensor(DType::kF32, {tokens, g.heads + 3, g.head_dim}, rng);
  const Tensor q = fused->slice(1, 1, 1 + g.heads);
  const OwnedTensor out_wide = random_tensor(DType::kF32, {tokens, g.heads + 2, g.head_dim}, rng);
  const Tensor out = out_wide->slice(1, 2, 2 + g.heads);
  const std::vector<uint8_t> padding = testing::element_bytes(out_wide->slice(1, 0, 2));
  testing::poison(out);
  const double scale = 1.0 / std::sqrt(static_cast<double>(g.head_dim));
  kernels::paged_attention(q, *b.k_cache, *b.v_cache, b.cu_q_tensor(), b.kv_lens_tensor(), b.tables_tensor(), out,
                           attention_params(scale, 0));
  EXPECT_TRUE(testing::close_rel_l2(out, reference_attention(b, testing::to_doubles(q), scale, 0, false),
                                    testing::kF32Tolerance));
  EXPECT_EQ(testing::element_bytes(out_wide->slice(1, 0, 2)), padding);
}

TEST(PagedAttention, RejectsInconsistentMetadata) {
  Random rng(610);
  const Geometry g{4, 2, 8, 4, 16};
  PagedBatch b = make_batch(g, {{2, 3}, {0, 2}}, DType::kF32, rng);
  OwnedTensor out(DType::kF32, {b.tokens(), g.heads, g.head_dim});
  const auto run = [&](PagedBatch& batch, const Tensor& q) {
    kernels::paged_attention(q, *batch.k_cache, *batch.v_cache, batch.cu_q_tensor(), batch.kv_lens_tensor(),
                             batch.tables_tensor(), *out, attention_params(0.5, 0));
  };
  EXPECT_NO_THROW(run(b, *b.q));
  PagedBatch fewer_keys = make_batch(g, {{2, 3}, {0, 2}}, DType::kF32, rng);
  fewer_keys.kv_lens[1] = 1;  // fewer keys than queries
  EXPECT_THROW(run(fewer_keys, *fewer_keys.q), Error);
  PagedBatch long_context = make_batch(g, {{2, 3}, {0, 2}}, DType::kF32, rng);
  long_context.kv_lens[0] = static_cast<int32_t>(long_context.max_blocks * g.block_size + 1);  // past its table
  EXPECT_THROW(run(long_context, *long_context.q), Error);
  PagedBatch short_cu = make_batch(g, {{2, 3}, {0, 2}}, DType::kF32, rng);
  short_cu.cu_q.back() -= 1;  // cu_q does not end at T
  EXPECT_THROW(run(short_cu, *short_cu.q), Error);
  const OwnedTensor odd_heads = random_tensor(DType::kF32, {b.tokens(), 3, g.head_dim}, rng);  // 3 % 2 != 0
  OwnedTensor odd_out(DType::kF32, {b.tokens(), 3, g.head_dim});
  EXPECT_THROW(kernels::paged_attention(*odd_heads, *b.k_cache, *b.v_cache, b.cu_q_tensor(), b.kv_lens_tensor(),
                                        b.tables_tensor(), *odd_out, attention_params(0.5, 0)),
               Error);
}

// ---- FP8 (e4m3) caches with per-KV-head scales

// Per-head scales amax / 200 of the batch's keys and values (how --calculate-kv-scales sets them).
struct HostScales {
  std::vector<float> k, v;
  kernels::KvScales tensors() {
    const auto heads = static_cast<int64_t>(k.size());
    return {Tensor(k.data(), DType::kF32, {heads}), Tensor(v.data(), DType::kF32, {heads})};
  }
};

// What an FP8 cache stands for: every logical key and value quantised with its head's scale and
// dequantised again, explicitly.
void dequantise_logical(PagedBatch& b, const HostScales& scales) {
  const auto round_trip = [&](std::vector<float>& rows, const std::vector<float>& head_scales) {
    for (size_t e = 0; e < rows.size(); ++e) {
      const float scale = head_scales[(e / static_cast<size_t>(b.g.head_dim)) % static_cast<size_t>(b.g.kv_heads)];
      rows[e] = f8e4m3_bits_to_f32(f32_to_f8e4m3_bits(rows[e] / scale)) * scale;
    }
  };
  for (auto& keys : b.keys) round_trip(keys, scales.k);
  for (auto& values : b.values) round_trip(values, scales.v);
}

const std::vector<float> kHeadGain = {1.0f, 30.0f};  // KV head 1 spans a 30x wider range

TEST(KvCacheWrite, Fp8QuantisesWithEachHeadsScale) {
  Random rng(611);
  const int64_t kv_heads = 2, head_dim = 16, tokens = 5;
  OwnedTensor k_cache(DType::kF8E4M3, {2, 4, kv_heads, head_dim});
  OwnedTensor v_cache(DType::kF8E4M3, {2, 4, kv_heads, head_dim});
  std::memset(k_cache->data(), 0x11, k_cache->nbytes());
  std::memset(v_cache->data(), 0x22, v_cache->nbytes());
  const OwnedTensor k = random_tensor(DType::kF32, {tokens, kv_heads, head_dim}, rng, -300.0f, 300.0f);
  const OwnedTensor v = random_tensor(DType::kF32, {tokens, kv_heads, head_dim}, rng, -2.0f, 2.0f);
  HostScales scales{{0.5f, 1.25f}, {0.01f, 0.004f}};
  std::vector<int32_t> slots = {6, -1, 0, 3, 7};
  kernels::kv_cache_write(*k, *v, Tensor(slots.data(), DType::kI32, {tokens}), *k_cache, *v_cache, scales.tensors());
  const auto* kc = static_cast<const uint8_t*>(k_cache->data());
  const auto* vc = static_cast<const uint8_t*>(v_cache->data());
  const auto* kf = k->data_as<const float>();
  const auto* vf = v->data_as<const float>();
  const int64_t row = kv_heads * head_dim;
  int saturated = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[static_cast<size_t>(t)] < 0) continue;
    for (int64_t e = 0; e < row; ++e) {
      const auto h = static_cast<size_t>(e / head_dim);
      const int64_t at = slots[static_cast<size_t>(t)] * row + e;
      EXPECT_EQ(kc[at], f32_to_f8e4m3_bits(kf[t * row + e] / scales.k[h])) << "token " << t << " element " << e;
      EXPECT_EQ(vc[at], f32_to_f8e4m3_bits(vf[t * row + e] / scales.v[h])) << "token " << t << " element " << e;
      saturated += (kc[at] & 0x7f) == 0x7e;
    }
  }
  EXPECT_GT(saturated, 0) << "keys up to 300 / 0.5 = 600 exceed 448 and must saturate";
  for (const int64_t untouched : {1, 2, 4, 5}) {
    for (int64_t e = 0; e < row; ++e) {
      ASSERT_EQ(kc[untouched * row + e], 0x11);
      ASSERT_EQ(vc[untouched * row + e], 0x22);
    }
  }
}

// paged_attention on FP8 caches against the same attention over keys and values dequantised
// explicitly (tight), and against bf16 caches of the unquantised keys and values (loose: the
// quantisation error, reported).
TEST(PagedAttention, Fp8CacheMatchesExplicitDequantisation) {
  const Geometry g{6, 2, 32, 4, 48};  // GQA group of 3
  const double scale = 1.0 / std::sqrt(static_cast<double>(g.head_dim));
  for (const int window : {0, 3}) {
    Random rng(612);
    // Scales from the ranges the batch draws (keys up to 1.5 * gain, values up to 1 * gain).
    HostScales scales{{1.5f / 200.0f, 1.5f * kHeadGain[1] / 200.0f}, {1.0f / 100.0f, kHeadGain[1] / 100.0f}};
    PagedBatch fp8 = make_batch(g, kMixedStep, DType::kF8E4M3, rng, scales.tensors(), kHeadGain);
    Random same(612);
    PagedBatch bf16 = make_batch(g, kMixedStep, DType::kBF16, same, {}, kHeadGain);
    OwnedTensor out(DType::kF32, {fp8.tokens(), g.heads, g.head_dim}), bf16_out(DType::kF32, out->shape());
    testing::poison(*out);
    kernels::AttentionParams params = attention_params(scale, window);
    params.kv_scales = scales.tensors();
    kernels::paged_attention(*fp8.q, *fp8.k_cache, *fp8.v_cache, fp8.cu_q_tensor(), fp8.kv_lens_tensor(),
                             fp8.tables_tensor(), *out, params);
    const std::vector<double> q = testing::to_doubles(*fp8.q);
    dequantise_logical(fp8, scales);  // the cache is written: the logical copy may change
    EXPECT_TRUE(testing::close_rel_l2(*out, reference_attention(fp8, q, scale, window, false), 2e-6))
        << "window " << window;

    kernels::paged_attention(*bf16.q, *bf16.k_cache, *bf16.v_cache, bf16.cu_q_tensor(), bf16.kv_lens_tensor(),
                             bf16.tables_tensor(), *bf16_out, attention_params(scale, window));
    const std::vector<double> a = testing::to_doubles(*out), b = testing::to_doubles(*bf16_out);
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
      diff += (a[i] - b[i]) * (a[i] - b[i]);
      norm += b[i] * b[i];
    }
    const double rel_l2 = std::sqrt(diff / norm);
    std::cout << "[ fp8 KV ] window " << window << ": relative L2 of the output against bf16 KV " << rel_l2 << "\n";
    RecordProperty("rel_l2_vs_bf16_window_" + std::to_string(window), std::to_string(rel_l2));
    // e4m3 keeps 3 mantissa bits (about 3.6% RMS relative error per element); random keys and values
    // make the output a sum that cancels, which magnifies the relative error (0.06 to 0.09 here).
    EXPECT_LT(rel_l2, 0.15);
    EXPECT_GT(rel_l2, 1e-4) << "the FP8 cache must actually quantise";
  }
}

TEST(PagedAttention, Fp8CacheWithoutScalesReadsUnitScale) {
  Random rng(613);
  const Geometry g{4, 2, 16, 4, 40};
  PagedBatch b = make_batch(g, kMixedStep, DType::kF8E4M3, rng);  // no scales: 1.0
  const double scale = 1.0 / std::sqrt(static_cast<double>(g.head_dim));
  OwnedTensor out(DType::kF32, {b.tokens(), g.heads, g.head_dim});
  kernels::paged_attention(*b.q, *b.k_cache, *b.v_cache, b.cu_q_tensor(), b.kv_lens_tensor(), b.tables_tensor(), *out,
                           attention_params(scale, 0));
  dequantise_logical(b, {std::vector<float>(2, 1.0f), std::vector<float>(2, 1.0f)});
  EXPECT_TRUE(testing::close_rel_l2(*out, reference_attention(b, testing::to_doubles(*b.q), scale, 0, false), 2e-6));
  std::vector<float> wrong_count(3, 1.0f);
  kernels::AttentionParams params = attention_params(scale, 0);
  params.kv_scales = {Tensor(wrong_count.data(), DType::kF32, {3}), Tensor(wrong_count.data(), DType::kF32, {3})};
  EXPECT_THROW(kernels::paged_attention(*b.q, *b.k_cache, *b.v_cache, b.cu_q_tensor(), b.kv_lens_tensor(),
                                        b.tables_tensor(), *out, params),
               Error);
}

}  // namespace
}  // namespace metrale
