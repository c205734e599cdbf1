// CUDA kernels of glm5_next beside KDA against their CPU twins on the same inputs: the mHC maps
// (mhc_pre on tensor cores with one and with many K-slices, its generic path, mhc_post in place,
// mhc_mean), DSA (cache writes with the pool keys, the pool selection with the radix top-k and exact
// ties, the sparse absorbed attention with and without key splits, mla_absorb on both paths), and
// the glm5 MoE pieces (sigmoid router with bias and groups, clamped SwiGLU in silu_mul and the
// routed experts, the ungated shared expert in moe_combine).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <tuple>
#include <vector>

#include "cuda/cuda_test_helpers.h"
#include "kernels/activation.h"
#include "kernels/dsa.h"
#include "kernels/mhc.h"
#include "kernels/kernel_helpers.h"
#include "kernels/moe.h"
#include "kernels/ragged_batch.h"
#include "runtime/device.h"

namespace metrale {
namespace {

using testing::RaggedBatch;
using testing::Random;
using testing::to_device;
using testing::to_host;

OwnedTensor zeroed_device(int64_t bytes) {
  OwnedTensor host(DType::kU8, {std::max<int64_t>(bytes, 256)});
  std::memset(host->data(), 0, static_cast<size_t>(host->numel()));
  return to_device(*host);
}

OwnedTensor ints(const std::vector<int32_t>& values) {
  OwnedTensor t(DType::kI32, {static_cast<int64_t>(values.size())});
  std::memcpy(t->data(), values.data(), values.size() * sizeof(int32_t));
  return t;
}

// ---------------------------------------------------------------------------------------------
// mHC

void check_hc_pre(int64_t tokens, int64_t n, int64_t D, DType dtype, Random& rng) {
  const int64_t mix = (2 + n) * n;
  const OwnedTensor X = testing::random_tensor(dtype, {tokens, n, D}, rng, -2.0f, 2.0f);
  const OwnedTensor fn = testing::random_tensor(dtype, {mix, n * D}, rng, -0.05f, 0.05f);
  const OwnedTensor base = testing::random_tensor(dtype, {mix}, rng, -1.0f, 1.0f);
  const OwnedTensor scale = testing::random_tensor(dtype, {3}, rng, 0.5f, 2.0f);
  kernels::MhcParams params;
  OwnedTensor post(DType::kF32, {tokens, n}), comb(DType::kF32, {tokens, n, n}), h(DType::kF32, {tokens, D});
  kernels::mhc_pre(*X, *fn, *base, *scale, *post, *comb, *h, params);
  const OwnedTensor Xd = to_device(*X), fnd = to_device(*fn), based = to_device(*base), scaled = to_device(*scale);
  OwnedTensor postd(DType::kF32, {tokens, n}, Device::cuda()), combd(DType::kF32, {tokens, n, n}, Device::cuda());
  OwnedTensor hh(dtype, {tokens, D});
  testing::poison(*hh);
  OwnedTensor hd = to_device(*hh);
  OwnedTensor ws = zeroed_device(static_cast<int64_t>(kernels::mhc_pre_workspace_bytes(Device::cuda(), tokens, n, D)));
  params.workspace = *ws;
  for (int repeat = 0; repeat < 2; ++repeat) {  // the arrival counters reset themselves
    kernels::mhc_pre(*Xd, *fnd, *based, *scaled, *postd, *combd, *hd, params);
    const double h_tolerance = dtype == DType::kBF16 ? 5e-3 : 1e-5;
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*postd), testing::to_doubles(*post), 1e-5)) << tokens << " post";
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*combd), testing::to_doubles(*comb), 1e-5)) << tokens << " comb";
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*hd), testing::to_doubles(*h), h_tolerance)) << tokens << " h";
  }
}

TEST(CudaMhc, PreMatchesCpuOnTensorCoresAndGeneric) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(401);
  for (const int64_t tokens : {1, 5, 40, 300}) check_hc_pre(tokens, 4, 4096, DType::kBF16, rng);  // 64 .. 1 slices
  check_hc_pre(3, 4, 256, DType::kBF16, rng);
  check_hc_pre(7, 4, 96, DType::kF32, rng);
  check_hc_pre(4, 3, 256, DType::kBF16, rng);  // 3 streams: 15 maps
}

TEST(CudaMhc, PostAndMeanMatchCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(402);
  for (const DType dtype : {DType::kBF16, DType::kF32}) {
    const int64_t tokens = 9, n = 4, D = 320;
    const OwnedTensor X = testing::random_tensor(dtype, {tokens, n, D}, rng, -2.0f, 2.0f);
    const OwnedTensor y = testing::random_tensor(dtype, {tokens, D}, rng, -2.0f, 2.0f);
    const OwnedTensor post = testing::random_tensor(DType::kF32, {tokens, n}, rng, 0.0f, 2.0f);
    const OwnedTensor comb = testing::random_tensor(DType::kF32, {tokens, n, n}, rng, 0.0f, 1.0f);
    OwnedTensor out(dtype, {tokens, n, D}), mean(dtype, {tokens, D});
    kernels::mhc_post(*X, *y, *post, *comb, *out);
    kernels::mhc_mean(*X, *mean);
    OwnedTensor Xd = to_device(*X);
    const OwnedTensor yd = to_device(*y), postd = to_device(*post), combd = to_device(*comb);
    OwnedTensor meand(dtype, {tokens, D}, Device::cuda());
    kernels::mhc_mean(*Xd, *meand);
    kernels::mhc_post(*Xd, *yd, *postd, *combd, *Xd);  // in place
    // Same rounding points on both sides: bf16 results differ at most by an ulp from summation order.
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*Xd), testing::to_doubles(*out), dtype == DType::kBF16 ? 2e-3 : 1e-6));
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*meand), testing::to_doubles(*mean), dtype == DType::kBF16 ? 2e-3 : 1e-6));
  }
}

// ---------------------------------------------------------------------------------------------
// DSA

// A paged DSA layer with caches on both devices.
struct DsaCase {
  int64_t kp = 16, block_size = 64, top = 8, d_index = 128, index_heads = 32, r = 512, heads = 64;
  int64_t num_blocks = 0, max_blocks = 0;
  RaggedBatch batch;
  std::vector<int32_t> tables;
  OwnedTensor latent_cache, index_cache, pool_cache;              // host (bf16)
  OwnedTensor latent_dev, index_dev, pool_dev, tables_dev, cu_dev, lens_dev;

  DsaCase(Random& rng, RaggedBatch b, int64_t top_pools) : top(top_pools), batch(std::move(b)) {
    int64_t longest = 0;
    for (const int32_t len : batch.kv_lens) longest = std::max<int64_t>(longest, len);
    max_blocks = (longest + block_size - 1) / block_size;
    num_blocks = max_blocks * batch.size() + 3;
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng.engine());
    tables.assign(ids.begin(), ids.begin() + max_blocks * batch.size());
    latent_cache = OwnedTensor(DType::kBF16, {num_blocks, block_size, r});
    index_cache = OwnedTensor(DType::kBF16, {num_blocks, block_size, 2 * d_index});
    pool_cache = OwnedTensor(DType::kBF16, {num_blocks, block_size / kp, d_index});
    for (const Tensor* t : {&*latent_cache, &*index_cache, &*pool_cache}) testing::poison(*t);
    latent_dev = to_device(*latent_cache);
    index_dev = to_device(*index_cache);
    pool_dev = to_device(*pool_cache);
    tables_dev = to_device(Tensor(tables.data(), DType::kI32, {batch.size(), max_blocks}));
    cu_dev = to_device(batch.cu());
    lens_dev = to_device(batch.lens());
  }
  Tensor host_tables() { return Tensor(tables.data(), DType::kI32, {batch.size(), max_blocks}); }
  int32_t slot(int64_t s, int64_t pos) const {
    return tables[static_cast<size_t>(s * max_blocks + pos / block_size)] * static_cast<int32_t>(block_size) +
           static_cast<int32_t>(pos % block_size);
  }
  // Writes every token of every sequence (cached part, then the step) on both devices.
  void write_all(Random& rng, Tensor ln_w, Tensor ln_b, Tensor ape, Tensor ln_w_d, Tensor ln_b_d, Tensor ape_d) {
    for (const bool step : {false, true}) {
      std::vector<int32_t> slots;
      for (int64_t s = 0; s < batch.size(); ++s) {
        const int64_t from = step ? batch.ctx(s) : 0, to = step ? batch.kv_lens[static_cast<size_t>(s)] : batch.ctx(s);
        for (int64_t pos = from; pos < to; ++pos) slots.push_back(slot(s, pos));
      }
      const auto rows = static_cast<int64_t>(slots.size());
      if (rows == 0) continue;
      const OwnedTensor latent = testing::random_tensor(DType::kBF16, {rows, r}, rng, -1.0f, 1.0f);
      const OwnedTensor k_raw = testing::random_tensor(DType::kBF16, {rows, d_index}, rng, -2.0f, 2.0f);
      const OwnedTensor gate = testing::random_tensor(DType::kBF16, {rows, d_index}, rng, -2.0f, 2.0f);
      const OwnedTensor slot_map = ints(slots);
      kernels::DsaIndexWriteParams params{kp, 1e-6f};
      kernels::dsa_latent_write(*latent, *slot_map, *latent_cache);
      kernels::dsa_index_write(*k_raw, *gate, ln_w, ln_b, ape, *slot_map, *index_cache, *pool_cache, params);
      const OwnedTensor latent_d = to_device(*latent), k_d = to_device(*k_raw), gate_d = to_device(*gate);
      const OwnedTensor slots_d = to_device(*slot_map);
      kernels::dsa_latent_write(*latent_d, *slots_d, *latent_dev);
      kernels::dsa_index_write(*k_d, *gate_d, ln_w_d, ln_b_d, ape_d, *slots_d, *index_dev, *pool_dev, params);
    }
  }
};

RaggedBatch dsa_batch() {
  RaggedBatch b;
  b.add(40, 3000, 0);  // sparse prefill continuation: 190 candidate pools
  b.add(1, 2500, 0);   // sparse decode row
  b.add(30, 0, 0);     // dense throughout
  b.add(2, 127, 0);    // 8 candidates, the first row completes pool 7 (self-attend rule)
  return b;
}

TEST(CudaDsa, CacheWritesSelectionAndAttentionMatchCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(501);
  DsaCase c(rng, dsa_batch(), 8);
  const OwnedTensor ln_w = testing::random_tensor(DType::kBF16, {c.d_index}, rng, 0.5f, 1.5f);
  const OwnedTensor ln_b = testing::random_tensor(DType::kBF16, {c.d_index}, rng, -0.2f, 0.2f);
  const OwnedTensor ape = testing::random_tensor(DType::kF32, {c.kp, c.d_index}, rng, -1.0f, 1.0f);
  const OwnedTensor ln_w_d = to_device(*ln_w), ln_b_d = to_device(*ln_b), ape_d = to_device(*ape);
  c.write_all(rng, *ln_w, *ln_b, *ape, *ln_w_d, *ln_b_d, *ape_d);
  // Caches: bf16 rows identical up to one rounding step (the same formulas, fp32 sums in another order).
  EXPECT_EQ(testing::element_bytes(*to_host(*c.latent_dev)), testing::element_bytes(*c.latent_cache));
  // Rows nobody wrote (open pools, slots past every kv_len, unused blocks) stay NaN on both sides;
  // the written ones agree up to one bf16 rounding step.
  for (const auto& [dev, host, tolerance] :
       {std::tuple<const Tensor*, const Tensor*, double>{&*c.index_dev, &*c.index_cache, 2e-3},
        std::tuple<const Tensor*, const Tensor*, double>{&*c.pool_dev, &*c.pool_cache, 5e-3}}) {
    std::vector<double> got = testing::to_doubles(*to_host(*dev)), want = testing::to_doubles(*host);
    std::vector<double> got_w, want_w;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(std::isnan(got[i]), std::isnan(want[i])) << "cache element " << i;
      if (!std::isnan(want[i])) {
        got_w.push_back(got[i]);
        want_w.push_back(want[i]);
      }
    }
    EXPECT_TRUE(testing::close_rel_l2(got_w, want_w, tolerance));
  }
  // Selection: GPU rows equal the CPU rows (both from the GPU's pool cache, so that only the scoring
  // and the top-k differ), except at near-ties of the cut.
  copy_tensor(*c.pool_cache, *c.pool_dev);
  const int64_t tokens = c.batch.tokens();
  const OwnedTensor q_index = testing::random_tensor(DType::kBF16, {tokens, c.index_heads, c.d_index}, rng, -1.0f, 1.0f);
  const OwnedTensor weights = testing::random_tensor(DType::kBF16, {tokens, c.index_heads}, rng, -1.0f, 1.0f);
  kernels::DsaSelectParams sp;
  sp.kpool = c.kp;
  sp.top_pools = c.top;
  sp.score_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d_index)));
  sp.weight_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.index_heads)));
  OwnedTensor sel_cpu(DType::kI32, {tokens, c.top});
  kernels::dsa_select(*q_index, *weights, *c.pool_cache, c.batch.cu(), c.batch.lens(), c.host_tables(), *sel_cpu, sp);
  const OwnedTensor q_d = to_device(*q_index), w_d = to_device(*weights);
  OwnedTensor sel_gpu(DType::kI32, {tokens, c.top}, Device::cuda());
  sp.max_kv_len = c.max_blocks * c.block_size;
  OwnedTensor select_ws = zeroed_device(static_cast<int64_t>(
      kernels::dsa_select_workspace_bytes(Device::cuda(), tokens, sp.max_kv_len, c.kp)));
  sp.workspace = *select_ws;
  kernels::dsa_select(*q_d, *w_d, *c.pool_dev, *c.cu_dev, *c.lens_dev, *c.tables_dev, *sel_gpu, sp);
  const OwnedTensor sel_back = to_host(*sel_gpu);
  int equal = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const auto* a = sel_cpu->data_as<const int32_t>() + t * c.top;
    const auto* b = sel_back->data_as<const int32_t>() + t * c.top;
    equal += std::equal(a, a + c.top, b);
  }
  EXPECT_GE(equal, static_cast<int>(tokens) - 2) << "selections differ beyond near-ties";

  // Attention from the GPU's selection on both devices (r = 512, 64 heads), with and without splits.
  copy_tensor(*c.latent_cache, *c.latent_dev);
  const OwnedTensor q = testing::random_tensor(DType::kBF16, {tokens, c.heads, c.r}, rng, -0.2f, 0.2f);
  kernels::DsaAttentionParams ap;
  ap.scale = 1.0f / 16.0f;
  ap.kpool = c.kp;
  OwnedTensor o_cpu(DType::kF32, {tokens, c.heads, c.r});
  kernels::dsa_attention(*q, *c.latent_cache, *sel_back, c.batch.cu(), c.batch.lens(), c.host_tables(), *o_cpu, ap);
  const OwnedTensor q_dev = to_device(*q);
  for (const int splits : {1, 4, 0}) {
    ap.num_splits = splits;
    const int used = splits > 0 ? splits : kernels::dsa_attention_splits(Device::cuda(), tokens, c.heads, c.top);
    OwnedTensor attn_ws = zeroed_device(static_cast<int64_t>(
        kernels::dsa_attention_workspace_bytes(Device::cuda(), tokens, c.heads, c.r, used)));
    ap.workspace = *attn_ws;
    OwnedTensor oh(DType::kBF16, {tokens, c.heads, c.r});
    testing::poison(*oh);
    OwnedTensor od = to_device(*oh);
    kernels::dsa_attention(*q_dev, *c.latent_dev, *sel_gpu, *c.cu_dev, *c.lens_dev, *c.tables_dev, *od, ap);
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*od), testing::to_doubles(*o_cpu), 1e-2)) << "splits " << splits;
  }
}

// Fewer heads than a tile, a smaller latent, f32 on the generic path.
TEST(CudaDsa, AttentionOtherShapesMatchCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(502);
  for (const DType dtype : {DType::kBF16, DType::kF32}) {
    RaggedBatch b;
    b.add(5, 300, 0);
    b.add(1, 90, 0);
    const int64_t kp = 16, block = 32, r = 128, heads = 20, top = 4, tokens = b.tokens();
    std::vector<int32_t> tables(2 * 10);
    std::iota(tables.begin(), tables.end(), 0);
    std::shuffle(tables.begin(), tables.end(), rng.engine());
    const OwnedTensor cache = testing::random_tensor(dtype, {20, block, r}, rng, -1.0f, 1.0f);
    // Selections: ascending candidate pools of each row.
    std::vector<int32_t> sel;
    for (int64_t s = 0; s < b.size(); ++s) {
      for (int64_t i = 0; i < b.q_len(s); ++i) {
        const int64_t cand = (b.ctx(s) + i + 1) / kp;
        std::vector<int32_t> pools(static_cast<size_t>(cand));
        std::iota(pools.begin(), pools.end(), 0);
        std::shuffle(pools.begin(), pools.end(), rng.engine());
        pools.resize(static_cast<size_t>(std::min<int64_t>(top, cand)));
        std::sort(pools.begin(), pools.end());
        pools.resize(static_cast<size_t>(top), -1);
        sel.insert(sel.end(), pools.begin(), pools.end());
      }
    }
    const Tensor sel_host(sel.data(), DType::kI32, {tokens, top});
    const Tensor tab(tables.data(), DType::kI32, {2, 10});
    const OwnedTensor q = testing::random_tensor(dtype, {tokens, heads, r}, rng, -0.5f, 0.5f);
    kernels::DsaAttentionParams ap;
    ap.scale = 0.125f;
    ap.kpool = kp;
    ap.num_splits = 1;
    OwnedTensor o_cpu(DType::kF32, {tokens, heads, r});
    kernels::dsa_attention(*q, *cache, sel_host, b.cu(), b.lens(), tab, *o_cpu, ap);
    OwnedTensor od(dtype, {tokens, heads, r}, Device::cuda());
    kernels::dsa_attention(*to_device(*q), *to_device(*cache), *to_device(sel_host), *to_device(b.cu()),
                           *to_device(b.lens()), *to_device(tab), *od, ap);
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*od), testing::to_doubles(*o_cpu), dtype == DType::kBF16 ? 1e-2 : 1e-5))
        << dtype_name(dtype);
  }
}

// All head weights zero: every score is +-0, the GPU's radix top-k must pick the lowest pools.
TEST(CudaDsa, SelectTiesGoToLowerPools) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(503);
  RaggedBatch b;
  b.add(3, 1000, 0);
  const int64_t kp = 16, d = 64, heads = 8, top = 16, tokens = b.tokens(), blocks = 20;
  std::vector<int32_t> tables(static_cast<size_t>(blocks));
  std::iota(tables.begin(), tables.end(), 0);
  const OwnedTensor pools = testing::random_tensor(DType::kBF16, {blocks, 64 / kp, d}, rng);
  const OwnedTensor q = testing::random_tensor(DType::kBF16, {tokens, heads, d}, rng);
  OwnedTensor w(DType::kBF16, {tokens, heads});
  std::vector<float> zeros(static_cast<size_t>(tokens * heads));
  for (size_t i = 0; i < zeros.size(); ++i) zeros[i] = i % 3 ? 0.0f : -0.0f;
  testing::fill(*w, zeros);
  kernels::DsaSelectParams sp;
  sp.kpool = kp;
  sp.top_pools = top;
  sp.max_kv_len = blocks * 64;
  OwnedTensor ws = zeroed_device(static_cast<int64_t>(kernels::dsa_select_workspace_bytes(Device::cuda(), tokens, sp.max_kv_len, kp)));
  sp.workspace = *ws;
  OwnedTensor sel(DType::kI32, {tokens, top}, Device::cuda());
  kernels::dsa_select(*to_device(*q), *to_device(*w), *to_device(*pools), *to_device(b.cu()), *to_device(b.lens()),
                      *to_device(Tensor(tables.data(), DType::kI32, {1, blocks})), *sel, sp);
  const OwnedTensor back = to_host(*sel);
  std::vector<int32_t> expected(static_cast<size_t>(top));
  std::iota(expected.begin(), expected.end(), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    EXPECT_EQ(std::vector<int32_t>(back->data_as<const int32_t>() + t * top, back->data_as<const int32_t>() + (t + 1) * top),
              expected);
  }
}

TEST(CudaDsa, AbsorbMatchesCpuOnBothPaths) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(504);
  for (const int64_t tokens : {1, 3, 40, 1100}) {  // GEMV, GEMV, tensor-core tiles, cuBLASLt per head
    const int64_t heads = 8, K = 256, N = 512;
    const OwnedTensor x = testing::random_tensor(DType::kBF16, {tokens, heads, K}, rng);
    const OwnedTensor w = testing::random_tensor(DType::kBF16, {heads, N, K}, rng, -0.1f, 0.1f);
    OwnedTensor cpu(DType::kF32, {tokens, heads, N});
    kernels::mla_absorb(*x, *w, *cpu);
    OwnedTensor gpu(DType::kBF16, {tokens, heads, N}, Device::cuda());
    kernels::mla_absorb(*to_device(*x), *to_device(*w), *gpu);
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*gpu), testing::to_doubles(*cpu), 5e-3)) << tokens;
  }
}

// ---------------------------------------------------------------------------------------------
// MoE pieces of glm5

TEST(CudaGlm5Moe, SigmoidRouterMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(601);
  const int64_t tokens = 70, experts = 288;
  const OwnedTensor logits = testing::random_tensor(DType::kF32, {tokens, experts}, rng, -4.0f, 4.0f);
  const OwnedTensor bias = testing::random_tensor(DType::kF32, {experts}, rng, -0.2f, 0.2f);
  for (const int n_group : {1, 8}) {
    kernels::MoeRouteParams p;
    p.top_k = 8;
    p.normalize = true;
    p.scoring = kernels::MoeScoring::kSigmoid;
    p.n_group = n_group;
    p.topk_group = n_group == 1 ? 1 : 4;
    p.routed_scaling_factor = 2.5f;
    p.correction_bias = *bias;
    OwnedTensor ids(DType::kI32, {tokens, 8}), wts(DType::kF32, {tokens, 8});
    kernels::moe_route(*logits, *ids, *wts, p);
    const OwnedTensor bias_d = to_device(*bias);
    p.correction_bias = *bias_d;
    OwnedTensor ids_d(DType::kI32, {tokens, 8}, Device::cuda()), wts_d(DType::kF32, {tokens, 8}, Device::cuda());
    kernels::moe_route(*to_device(*logits), *ids_d, *wts_d, p);
    EXPECT_EQ(testing::to_doubles(*to_host(*ids_d)), testing::to_doubles(*ids)) << n_group;
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*wts_d), testing::to_doubles(*wts), 1e-6)) << n_group;
  }
}

TEST(CudaGlm5Moe, ClampedSwigluMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(602);
  const int64_t rows = 5, width = 512;
  const OwnedTensor gate = testing::random_tensor(DType::kBF16, {rows, width}, rng, -20.0f, 20.0f);
  const OwnedTensor up = testing::random_tensor(DType::kBF16, {rows, width}, rng, -20.0f, 20.0f);
  OwnedTensor cpu(DType::kF32, {rows, width});
  kernels::silu_mul(*gate, *up, *cpu, 10.0f);
  OwnedTensor gpu(DType::kBF16, {rows, width}, Device::cuda());
  kernels::silu_mul(*to_device(*gate), *to_device(*up), *gpu, 10.0f);
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*gpu), testing::to_doubles(*cpu), 5e-3));
  // The routed experts, both paths, against the CPU with the same fused bf16 weights.
  const int64_t tokens = 6, hidden = 256, inter = 128, E = 8;
  const int k = 2;
  const OwnedTensor x = testing::random_tensor(DType::kBF16, {tokens, hidden}, rng, -2.0f, 2.0f);
  const OwnedTensor gate_up = testing::random_tensor(DType::kBF16, {E, 2 * inter, hidden}, rng, -0.4f, 0.4f);
  const OwnedTensor down = testing::random_tensor(DType::kBF16, {E, hidden, inter}, rng, -0.1f, 0.1f);
  kernels::MoeExpertWeights host_w = kernels::MoeExpertWeights::from_fused(*gate_up, *down);
  host_w.swiglu_limit = 1.0f;
  const OwnedTensor gu_d = to_device(*gate_up), down_d = to_device(*down);
  kernels::MoeExpertWeights dev_w = kernels::MoeExpertWeights::from_fused(*gu_d, *down_d);
  dev_w.swiglu_limit = 1.0f;
  std::vector<int32_t> id_values(static_cast<size_t>(tokens * k));
  for (size_t i = 0; i < id_values.size(); ++i) id_values[i] = static_cast<int32_t>((i * 3 + i / 2) % E);
  OwnedTensor ids(DType::kI32, {tokens, k});
  std::memcpy(ids->data(), id_values.data(), id_values.size() * sizeof(int32_t));
  OwnedTensor h_cpu(DType::kF32, {tokens * k, inter});
  kernels::moe_decode_gate_up(*x, *ids, host_w, *h_cpu);
  const OwnedTensor x_d = to_device(*x), ids_d = to_device(*ids);
  OwnedTensor h_gpu(DType::kF32, {tokens * k, inter}, Device::cuda());
  kernels::moe_decode_gate_up(*x_d, *ids_d, dev_w, *h_gpu);
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*h_gpu), testing::to_doubles(*h_cpu), 1e-4)) << "decode path";
  OwnedTensor offsets(DType::kI32, {E + 1}, Device::cuda()), sorted(DType::kI32, {tokens * k}, Device::cuda());
  OwnedTensor scratch(DType::kI32, {kernels::moe_sort_scratch_elements(tokens * k, E)}, Device::cuda());
  kernels::moe_sort(*ids_d, *offsets, *sorted, *scratch);
  OwnedTensor hg(DType::kBF16, {tokens * k, inter}, Device::cuda());
  kernels::moe_grouped_gate_up(*x_d, *sorted, *offsets, k, dev_w, *hg);
  const OwnedTensor hg_back = to_host(*hg), sorted_back = to_host(*sorted);
  const std::vector<double> grouped = testing::to_doubles(*hg_back), want = testing::to_doubles(*h_cpu);
  std::vector<double> reordered;
  for (int64_t p = 0; p < tokens * k; ++p) {
    const int32_t s = sorted_back->data_as<const int32_t>()[p];
    reordered.insert(reordered.end(), want.begin() + s * inter, want.begin() + (s + 1) * inter);
  }
  EXPECT_TRUE(testing::close_rel_l2(grouped, reordered, 5e-3)) << "grouped path";
}

TEST(CudaGlm5Moe, UngatedSharedExpertMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(603);
  const int64_t tokens = 4, hidden = 300;
  const int k = 3;
  const OwnedTensor slot_out = testing::random_tensor(DType::kF32, {tokens * k, hidden}, rng, -2.0f, 2.0f);
  const OwnedTensor weights = testing::random_tensor(DType::kF32, {tokens, k}, rng, 0.1f, 1.0f);
  const OwnedTensor shared = testing::random_tensor(DType::kF32, {tokens, hidden}, rng, -2.0f, 2.0f);
  OwnedTensor cpu(DType::kBF16, {tokens, hidden});
  kernels::moe_combine(*slot_out, *weights, *shared, Tensor(), *cpu);
  OwnedTensor gpu(DType::kBF16, {tokens, hidden}, Device::cuda());
  kernels::moe_combine(*to_device(*slot_out), *to_device(*weights), *to_device(*shared), Tensor(), *gpu);
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*gpu), testing::to_doubles(*cpu), 1e-3));
}

}  // namespace
}  // namespace metrale
