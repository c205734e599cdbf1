// CUDA QSA ops against their CPU twins on the same inputs (bf16 activations, shuffled paged caches,
// ragged batches of decode rows at long contexts, prefill chunks crossing from the dense into the
// sparse regime, q_len 0): the index prologue, block keys (all and incremental), the fp32 scores,
// the top-k selection (exactly, including designed ties and the decode shape of 8192 blocks, k 512),
// sparse attention for head_dim 256 / 128 / 64 and the generic path, with and without splits, and
// the whole indexer + attention sequence replayed inside a CUDA graph. Outputs start as NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/cuda_test_helpers.h"
#include "kernels/kernel_helpers.h"
#include "kernels/qsa.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

using kernels::QsaAttentionParams;
using kernels::QsaParams;
using testing::Random;
using testing::to_device;
using testing::to_host;

template <typename T>
OwnedTensor host_tensor(const std::vector<T>& values, DType dtype, Shape shape) {
  OwnedTensor t(dtype, shape);
  if (!values.empty()) std::memcpy(t->data(), values.data(), values.size() * sizeof(T));
  return t;
}

// Written entries (finite in `expected`) agree within `tolerance` (relative L2 over them); entries
// the CPU left NaN are NaN on the GPU too.
::testing::AssertionResult same_written(const Tensor& gpu_host, const Tensor& cpu, double tolerance) {
  const std::vector<double> got = testing::to_doubles(gpu_host), want = testing::to_doubles(cpu);
  std::vector<double> g, w;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) {
      if (!std::isnan(got[i])) return ::testing::AssertionFailure() << "entry " << i << " written, should not be";
      continue;
    }
    g.push_back(got[i]);
    w.push_back(want[i]);
  }
  if (w.empty()) return ::testing::AssertionFailure() << "nothing written";
  return testing::close_rel_l2(g, w, tolerance);
}

// A ragged batch over shuffled pages of block_size 16: sequence s has ctx cached tokens and q_len rows.
struct Batch {
  int64_t block_size = 16, table_width = 0, num_blocks = 0;
  std::vector<int32_t> cu_q{0}, kv_lens, tables, positions, slots;
  Batch(const std::vector<std::pair<int32_t, int32_t>>& seqs, uint64_t seed) {
    int64_t max_len = 1, needed = 0;
    for (const auto& [q, ctx] : seqs) {
      max_len = std::max<int64_t>(max_len, q + ctx);
      needed += (q + ctx + block_size - 1) / block_size;
    }
    table_width = (max_len + block_size - 1) / block_size;
    num_blocks = needed + 5;
    std::vector<int32_t> pool(static_cast<size_t>(num_blocks));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), std::mt19937_64(seed));
    // Each sequence's table holds its own blocks; entries past its length repeat its first block
    // (never read).
    size_t next = 0;
    for (const auto& [q, ctx] : seqs) {
      const int64_t own = (q + ctx + block_size - 1) / block_size;
      for (int64_t i = 0; i < table_width; ++i) {
        tables.push_back(i < own ? pool[next + static_cast<size_t>(i)] : pool[next]);
      }
      next += static_cast<size_t>(std::max<int64_t>(own, 1));
    }
    for (size_t s = 0; s < seqs.size(); ++s) {
      const auto [q, ctx] = seqs[s];
      cu_q.push_back(cu_q.back() + q);
      kv_lens.push_back(q + ctx);
      for (int32_t i = 0; i < q; ++i) {
        positions.push_back(ctx + i);
        slots.push_back(static_cast<int32_t>(slot(static_cast<int64_t>(s), ctx + i)));
      }
    }
  }
  int64_t slot(int64_t s, int64_t key) const {
    return static_cast<int64_t>(tables[static_cast<size_t>(s * table_width + key / block_size)]) * block_size +
           key % block_size;
  }
  int64_t tokens() const { return cu_q.back(); }
  int64_t num_seqs() const { return static_cast<int64_t>(kv_lens.size()); }
  int64_t max_q() const {
    int64_t m = 0;
    for (size_t s = 0; s + 1 < cu_q.size(); ++s) m = std::max<int64_t>(m, cu_q[s + 1] - cu_q[s]);
    return m;
  }
  int64_t max_kv() const { return *std::max_element(kv_lens.begin(), kv_lens.end()); }
};

// Host metadata tensors and their device copies.
struct Meta {
  OwnedTensor cu, lens, tables, positions, slots;
  OwnedTensor d_cu, d_lens, d_tables, d_positions, d_slots;
  explicit Meta(const Batch& b)
      : cu(host_tensor(b.cu_q, DType::kI32, {b.num_seqs() + 1})),
        lens(host_tensor(b.kv_lens, DType::kI32, {b.num_seqs()})),
        tables(host_tensor(b.tables, DType::kI32, {b.num_seqs(), b.table_width})),
        positions(host_tensor(b.positions, DType::kI32, {b.tokens()})),
        slots(host_tensor(b.slots, DType::kI32, {b.tokens()})),
        d_cu(to_device(*cu)), d_lens(to_device(*lens)), d_tables(to_device(*tables)),
        d_positions(to_device(*positions)), d_slots(to_device(*slots)) {}
};

std::vector<float> inv_freq_of(int64_t rotary_dim, double theta) {
  std::vector<float> f;
  for (int64_t i = 0; i < rotary_dim / 2; ++i) {
    f.push_back(static_cast<float>(1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim))));
  }
  return f;
}

QsaParams index_params(int64_t c, int64_t topk, int64_t rotary, const Batch& b) {
  QsaParams p;
  p.compress_ratio = static_cast<int>(c);
  p.block_topk = static_cast<int>(topk);
  p.rope.rotary_dim = static_cast<int>(rotary);
  p.max_q_len = b.max_q();
  p.max_kv_len = b.max_kv();
  return p;
}

// ---- indexer: prologue, block keys, scores ----

void check_indexer(const std::vector<std::pair<int32_t, int32_t>>& seqs, int64_t n_idx, int64_t d_idx, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "n_idx " << n_idx << " d_idx " << d_idx << " sequences " << seqs.size());
  Random rng(seed);
  const int64_t c = 4, rotary = 64 <= d_idx ? 64 : d_idx / 2, topk = 8;
  const Batch b(seqs, seed);
  const Meta m(b);
  const QsaParams params = index_params(c, topk, rotary, b);
  const std::vector<float> freq_values = inv_freq_of(rotary, 1e7);
  const OwnedTensor freq = host_tensor(freq_values, DType::kF32, {rotary / 2}), d_freq = to_device(*freq);
  // The cached raw keys of the earlier tokens (random), then this step's prologue writes its rows.
  const OwnedTensor cache = testing::random_tensor(DType::kBF16, {b.num_blocks, b.block_size, d_idx}, rng, -2.0f, 2.0f);
  const OwnedTensor d_cache = to_device(*cache);
  // q and k as column slices of one fused projection [T, (n_idx + 1) * d_idx + 8].
  const int64_t row = (n_idx + 1) * d_idx + 8;
  const OwnedTensor fused = testing::random_tensor(DType::kBF16, {b.tokens(), row}, rng, -2.0f, 2.0f);
  const OwnedTensor d_fused = to_device(*fused);
  const auto q_view = [&](const Tensor& f) {
    return Tensor(f.data(), DType::kBF16, {b.tokens(), n_idx, d_idx}, {row, d_idx, 1}, f.device());
  };
  const auto k_view = [&](const Tensor& f) { return f.slice(1, n_idx * d_idx, (n_idx + 1) * d_idx); };
  const OwnedTensor qw = testing::random_tensor(DType::kBF16, {d_idx}, rng, -0.5f, 0.5f), d_qw = to_device(*qw);
  const OwnedTensor kw = testing::random_tensor(DType::kF32, {d_idx}, rng, -0.5f, 0.5f), d_kw = to_device(*kw);
  kernels::qsa_index_prologue(q_view(*fused), k_view(*fused), *qw, *m.positions, *freq, *m.slots, *cache, params);
  kernels::qsa_index_prologue(q_view(*d_fused), k_view(*d_fused), *d_qw, *m.d_positions, *d_freq, *m.d_slots, *d_cache,
                              params);
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*d_fused), testing::to_doubles(*fused), 1e-3)) << "prologue q";
  EXPECT_EQ(testing::element_bytes(*to_host(*d_cache)), testing::element_bytes(*cache)) << "index cache";

  // Block keys: the step's new blocks, then every block; entries never written stay NaN.
  for (bool all : {false, true}) {
    QsaParams p = params;
    p.all_blocks = all;
    OwnedTensor keys(DType::kBF16, {b.num_blocks, b.block_size / c, d_idx});
    testing::poison(*keys);
    const OwnedTensor d_keys = to_device(*keys);
    kernels::qsa_block_keys(*cache, *kw, *freq, *m.cu, *m.lens, *m.tables, *keys, p);
    kernels::qsa_block_keys(*d_cache, *d_kw, *d_freq, *m.d_cu, *m.d_lens, *m.d_tables, *d_keys, p);
    EXPECT_TRUE(same_written(*to_host(*d_keys), *keys, 1e-3)) << "block keys, all " << all;
    if (!all) continue;
    // Scores from the same block keys and queries.
    const int64_t width = b.max_kv() / c + 3;
    OwnedTensor scores(DType::kF32, {b.tokens(), width});
    testing::poison(*scores);
    const OwnedTensor d_scores = to_device(*scores);
    kernels::qsa_scores(q_view(*fused), *keys, *m.cu, *m.lens, *m.tables, *scores, p);
    // The GPU scores the CPU's queries and block keys (the two sides' may differ by a bf16 flip).
    const OwnedTensor cpu_fused = to_device(*fused);
    kernels::qsa_scores(q_view(*cpu_fused), *to_device(*keys), *m.d_cu, *m.d_lens, *m.d_tables, *d_scores, p);
    EXPECT_TRUE(same_written(*to_host(*d_scores), *scores, 2e-6)) << "scores";
  }
  // Rows of slot -1 complete no block keys (row_slots): every third row here.
  std::vector<int32_t> row_slots = b.slots;
  for (size_t i = 0; i < row_slots.size(); i += 3) row_slots[i] = -1;
  const OwnedTensor rows = host_tensor(row_slots, DType::kI32, {b.tokens()}), d_rows = to_device(*rows);
  OwnedTensor keys(DType::kBF16, {b.num_blocks, b.block_size / c, d_idx});
  testing::poison(*keys);
  const OwnedTensor d_keys = to_device(*keys);
  QsaParams p = params;
  p.row_slots = *rows;
  kernels::qsa_block_keys(*cache, *kw, *freq, *m.cu, *m.lens, *m.tables, *keys, p);
  p.row_slots = *d_rows;
  kernels::qsa_block_keys(*d_cache, *d_kw, *d_freq, *m.d_cu, *m.d_lens, *m.d_tables, *d_keys, p);
  EXPECT_TRUE(same_written(*to_host(*d_keys), *keys, 1e-3)) << "block keys with row_slots";
}

TEST(CudaQsaIndexer, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const std::vector<std::pair<int32_t, int32_t>> mixed = {{1, 4000}, {37, 0}, {1, 2}, {0, 9}, {70, 130}, {3, 17}};
  check_indexer(mixed, 4, 128, 1);   // the released shape: 4 heads x 128
  check_indexer(mixed, 8, 128, 2);
  check_indexer(mixed, 16, 64, 3);
  check_indexer(mixed, 2, 256, 4);
  check_indexer(mixed, 8, 32, 5);    // tiny test models
  std::vector<std::pair<int32_t, int32_t>> decode;
  for (int i = 0; i < 64; ++i) decode.push_back({1, 100 + 37 * i});
  check_indexer(decode, 4, 128, 6);
}

// ---- top-k ----

void check_topk(const std::vector<std::pair<int32_t, int32_t>>& seqs, int64_t topk, bool ties, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "topk " << topk << " ties " << ties);
  Random rng(seed);
  const int64_t c = 4;
  const Batch b(seqs, seed);
  const Meta m(b);
  const int64_t width = b.max_kv() / c;
  std::vector<float> values(static_cast<size_t>(b.tokens() * width));
  for (auto& v : values) {
    // With ties: a few distinct values (zeros most of all, -0 among them); else continuous.
    const int64_t r = rng.integer(0, 9);
    v = ties ? (r < 5 ? (r == 0 ? -0.0f : 0.0f) : static_cast<float>(rng.integer(1, 6)) * 0.25f) : rng.uniform(0.0f, 3.0f);
  }
  const OwnedTensor scores = host_tensor(values, DType::kF32, {b.tokens(), width});
  OwnedTensor selected(DType::kI32, {b.tokens(), topk});
  std::fill_n(selected->data_as<int32_t>(), selected->numel(), -7);
  const OwnedTensor d_selected = to_device(*selected);
  QsaParams params;
  params.compress_ratio = static_cast<int>(c);
  params.block_topk = static_cast<int>(topk);
  kernels::qsa_topk(*scores, *m.cu, *m.lens, *selected, params);
  kernels::qsa_topk(*to_device(*scores), *m.d_cu, *m.d_lens, *d_selected, params);
  EXPECT_EQ(testing::element_bytes(*to_host(*d_selected)), testing::element_bytes(*selected));
}

TEST(CudaQsaTopk, MatchesCpuTwinExactly) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const std::vector<std::pair<int32_t, int32_t>> mixed = {{1, 4000}, {37, 0}, {1, 2}, {70, 130}, {3, 17}, {0, 5}};
  check_topk(mixed, 8, false, 11);
  check_topk(mixed, 8, true, 12);
  check_topk(mixed, 30, true, 13);
  std::vector<std::pair<int32_t, int32_t>> decode;  // 32K contexts: 8192 blocks, the released k = 512
  for (int i = 0; i < 16; ++i) decode.push_back({1, 32767 - 97 * i});
  check_topk(decode, 512, false, 14);
  check_topk(decode, 512, true, 15);
}

// ---- sparse attention ----

struct AttentionCase {
  std::vector<std::pair<int32_t, int32_t>> seqs;
  int64_t heads, kv_heads, head_dim, topk, c;
  bool workspace = true;
};

// A random valid selection: ascending distinct blocks below nb for sparse rows; 0..nb-1 for dense.
OwnedTensor random_selection(const Batch& b, int64_t topk, int64_t c, Random& rng) {
  OwnedTensor selected(DType::kI32, {b.tokens(), topk});
  auto* sel = selected->data_as<int32_t>();
  for (int64_t t = 0; t < b.tokens(); ++t) {
    const int64_t nb = (b.positions[static_cast<size_t>(t)] + 1) / c;
    std::vector<int32_t> blocks(static_cast<size_t>(nb));
    std::iota(blocks.begin(), blocks.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), rng.engine());
    blocks.resize(static_cast<size_t>(std::min(nb, topk)));
    std::sort(blocks.begin(), blocks.end());
    for (int64_t i = 0; i < topk; ++i) sel[t * topk + i] = i < static_cast<int64_t>(blocks.size()) ? blocks[static_cast<size_t>(i)] : -1;
  }
  return selected;
}

void check_attention(const AttentionCase& c, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "head_dim " << c.head_dim << " heads " << c.heads << "/" << c.kv_heads
                                    << " topk " << c.topk << " workspace " << c.workspace);
  Random rng(seed);
  const Batch b(c.seqs, seed);
  const Meta m(b);
  const OwnedTensor k_cache = testing::random_tensor(DType::kBF16, {b.num_blocks, b.block_size, c.kv_heads, c.head_dim}, rng);
  const OwnedTensor v_cache = testing::random_tensor(DType::kBF16, {b.num_blocks, b.block_size, c.kv_heads, c.head_dim}, rng);
  // q is the query half of a gated q_proj row: [T, heads, 2 * head_dim] viewed with head stride 2 D.
  const OwnedTensor q_rows = testing::random_tensor(DType::kBF16, {b.tokens(), c.heads * 2 * c.head_dim}, rng);
  const auto q_view = [&](const Tensor& rows) {
    return Tensor(rows.data(), DType::kBF16, {b.tokens(), c.heads, c.head_dim},
                  {c.heads * 2 * c.head_dim, 2 * c.head_dim, 1}, rows.device());
  };
  const OwnedTensor selected = random_selection(b, c.topk, c.c, rng);
  OwnedTensor out(DType::kBF16, {b.tokens(), c.heads, c.head_dim});
  testing::poison(*out);
  const OwnedTensor d_out = to_device(*out);
  QsaAttentionParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  params.compress_ratio = static_cast<int>(c.c);
  params.block_topk = static_cast<int>(c.topk);
  params.max_q_len = b.max_q();
  params.max_kv_len = b.max_kv();
  kernels::qsa_attention(q_view(*q_rows), *k_cache, *v_cache, *m.cu, *m.lens, *m.tables, *selected, *out, params);
  const size_t bytes = kernels::qsa_attention_workspace_bytes(b.tokens(), c.heads, c.kv_heads, c.head_dim, c.topk, c.c);
  const OwnedTensor workspace(DType::kU8, {static_cast<int64_t>(std::max<size_t>(bytes, 16))}, Device::cuda());
  if (c.workspace) params.workspace = *workspace;
  const OwnedTensor d_q = to_device(*q_rows);
  kernels::qsa_attention(q_view(*d_q), *to_device(*k_cache), *to_device(*v_cache), *m.d_cu, *m.d_lens, *m.d_tables,
                         *to_device(*selected), *d_out, params);
  // bf16 operands and P rounded to bf16 for P.V on the GPU, fp32 on the CPU.
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*d_out), testing::to_doubles(*out), 1e-2));
}

TEST(CudaQsaAttention, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  // Decode rows at long contexts (sparse: 2051-key lists of 32K), a prefill chunk crossing from the
  // dense into the sparse regime, short dense rows, q_len 0.
  const std::vector<std::pair<int32_t, int32_t>> mixed = {{1, 32000}, {1, 5000}, {90, 2000}, {3, 7}, {0, 40}, {1, 2049}};
  check_attention({mixed, 16, 2, 256, 512, 4}, 21);   // released: head_dim 256, GQA 8
  check_attention({mixed, 16, 2, 256, 512, 4, false}, 22);
  check_attention({mixed, 8, 2, 128, 64, 4}, 23);
  check_attention({mixed, 40, 2, 64, 100, 4}, 24);    // G = 20: two row chunks
  check_attention({mixed, 4, 1, 32, 16, 8}, 25);      // generic path
  std::vector<std::pair<int32_t, int32_t>> decode;
  for (int i = 0; i < 128; ++i) decode.push_back({1, 200 + 37 * i});  // sparse from i = 50 on
  check_attention({decode, 16, 2, 256, 512, 4}, 26);
  check_attention({{{1, 30000}}, 16, 2, 256, 512, 4}, 27);  // batch 1: many splits
}

// ---- the whole QSA step inside a CUDA graph ----

TEST(CudaQsa, ReplaysInsideCudaGraph) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(31);
  const int64_t n_idx = 4, d_idx = 128, c = 4, topk = 64, heads = 16, kv_heads = 2, head_dim = 256;
  const Batch b({{1, 3000}, {1, 700}, {1, 100}}, 31);
  const Meta m(b);
  const QsaParams params = index_params(c, topk, 64, b);
  const OwnedTensor freq = to_device(*host_tensor(inv_freq_of(64, 1e7), DType::kF32, {32}));
  const OwnedTensor index_cache = to_device(*testing::random_tensor(DType::kBF16, {b.num_blocks, b.block_size, d_idx}, rng));
  const OwnedTensor block_keys(DType::kBF16, {b.num_blocks, b.block_size / c, d_idx}, Device::cuda());
  const OwnedTensor q_idx0 = testing::random_tensor(DType::kBF16, {b.tokens(), n_idx, d_idx}, rng);
  const OwnedTensor q_idx = to_device(*q_idx0);
  const OwnedTensor k_tok = to_device(*testing::random_tensor(DType::kBF16, {b.tokens(), d_idx}, rng));
  const OwnedTensor weight = to_device(*testing::random_tensor(DType::kBF16, {d_idx}, rng, -0.5f, 0.5f));
  const OwnedTensor scores(DType::kF32, {b.tokens(), b.max_kv() / c}, Device::cuda());
  const OwnedTensor selected(DType::kI32, {b.tokens(), topk}, Device::cuda());
  const OwnedTensor k_cache = to_device(*testing::random_tensor(DType::kBF16, {b.num_blocks, b.block_size, kv_heads, head_dim}, rng));
  const OwnedTensor v_cache = to_device(*testing::random_tensor(DType::kBF16, {b.num_blocks, b.block_size, kv_heads, head_dim}, rng));
  const OwnedTensor q = to_device(*testing::random_tensor(DType::kBF16, {b.tokens(), heads, head_dim}, rng));
  const OwnedTensor out(DType::kBF16, {b.tokens(), heads, head_dim}, Device::cuda());
  const OwnedTensor workspace(
      DType::kU8, {static_cast<int64_t>(std::max<size_t>(16, kernels::qsa_attention_workspace_bytes(b.tokens(), heads, kv_heads, head_dim, topk, c)))},
      Device::cuda());
  QsaAttentionParams attention;
  attention.scale = 1.0f / 16.0f;
  attention.compress_ratio = static_cast<int>(c);
  attention.block_topk = static_cast<int>(topk);
  attention.max_q_len = 1;
  attention.max_kv_len = b.max_kv();
  attention.workspace = *workspace;
  QsaParams all = params;
  all.all_blocks = true;
  kernels::qsa_block_keys(*index_cache, *weight, *freq, *m.d_cu, *m.d_lens, *m.d_tables, *block_keys, all);
  const auto step = [&] {
    kernels::qsa_index_prologue(*q_idx, *k_tok, *weight, *m.d_positions, *freq, *m.d_slots, *index_cache, params);
    kernels::qsa_block_keys(*index_cache, *weight, *freq, *m.d_cu, *m.d_lens, *m.d_tables, *block_keys, params);
    kernels::qsa_scores(*q_idx, *block_keys, *m.d_cu, *m.d_lens, *m.d_tables, *scores, params);
    kernels::qsa_topk(*scores, *m.d_cu, *m.d_lens, *selected, params);
    kernels::qsa_attention(*q, *k_cache, *v_cache, *m.d_cu, *m.d_lens, *m.d_tables, *selected, *out, attention);
  };
  step();  // eager
  const OwnedTensor eager_out = to_host(*out), eager_selected = to_host(*selected);
  copy_tensor(*q_idx, *q_idx0);  // the prologue rotates in place
  const auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  CudaGraph graph;
  graph.begin_capture(stream);
  step();
  graph.end_capture(stream);
  copy_tensor(*q_idx, *q_idx0);
  graph.launch(stream);
  EXPECT_EQ(testing::element_bytes(*to_host(*selected)), testing::element_bytes(*eager_selected));
  EXPECT_EQ(testing::element_bytes(*to_host(*out)), testing::element_bytes(*eager_out));
  // The rows are sparse: 3000 + 1 keys have 750 blocks, of which 64 are selected.
  const std::vector<double> sel = testing::to_doubles(*eager_selected);
  EXPECT_GE(sel[static_cast<size_t>(topk - 1)], 0.0);
}

}  // namespace
}  // namespace metrale
