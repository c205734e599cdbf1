// CUDA FP8 (e4m3) KV caches against their CPU twins: paged_attention reading e4m3 caches with
// per-KV-head scales (the split-KV kernel with and without splits, the tensor-core prefill kernel,
// head_dim 64, 128 and 256, the generic kernel for other head sizes, GQA, sliding windows), and the
// two writes that quantise (kv_cache_write and the fused qk_norm_rope_kv_write), byte for byte.
//
// The caches hold the same codes on both sides, so the attention comparison measures only the
// kernels' bf16 arithmetic (q, P and the output in bf16; the widening of codes is exact), as the
// bf16 tests do. Every slot no sequence owns holds the e4m3 NaN code: a kernel that reads one
// poisons its output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "cuda/cuda_test_helpers.h"
#include "kernels/attention.h"
#include "kernels/kernel_helpers.h"
#include "kernels/qk_norm_rope.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

using testing::to_device;
using testing::to_host;

constexpr uint8_t kE4m3NaN = 0x7f;
constexpr double kAttentionTolerance = 1e-2;  // bf16 q/P/out, fp32 softmax and accumulation
constexpr double kRowTolerance = 3e-2;

struct Geometry {
  int64_t heads, kv_heads, head_dim, block_size;
};

struct SeqSpec {
  int64_t cached;
  int64_t q_len;
  int64_t kv_len() const { return cached + q_len; }
};

// One step with e4m3 caches: per-head scales amax / 200 (keys) and / 100 (values) of heads whose
// ranges differ by 20x, codes quantised from random values.
struct Fp8Batch {
  Geometry g;
  std::vector<SeqSpec> seqs;
  int64_t tokens = 0, num_blocks = 0, max_blocks = 0, max_q = 0, max_kv = 0;
  std::vector<uint8_t> k_cache, v_cache;
  std::vector<float> k_scale, v_scale;
  std::vector<int32_t> cu_q, kv_lens, block_tables;
  std::vector<uint16_t> q;  // bf16

  int64_t num_seqs() const { return static_cast<int64_t>(seqs.size()); }
  Shape cache_shape() const { return {num_blocks, g.block_size, g.kv_heads, g.head_dim}; }
  Tensor k_tensor() { return Tensor(k_cache.data(), DType::kF8E4M3, cache_shape()); }
  Tensor v_tensor() { return Tensor(v_cache.data(), DType::kF8E4M3, cache_shape()); }
  Tensor q_tensor() { return Tensor(q.data(), DType::kBF16, {tokens, g.heads, g.head_dim}); }
  Tensor cu_tensor() { return Tensor(cu_q.data(), DType::kI32, {num_seqs() + 1}); }
  Tensor lens_tensor() { return Tensor(kv_lens.data(), DType::kI32, {num_seqs()}); }
  Tensor tables_tensor() { return Tensor(block_tables.data(), DType::kI32, {num_seqs(), max_blocks}); }
  kernels::KvScales host_scales() {
    return {Tensor(k_scale.data(), DType::kF32, {g.kv_heads}), Tensor(v_scale.data(), DType::kF32, {g.kv_heads})};
  }
};

Fp8Batch make_batch(const Geometry& g, const std::vector<SeqSpec>& seqs, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  Fp8Batch b;
  b.g = g;
  b.seqs = seqs;
  for (int64_t h = 0; h < g.kv_heads; ++h) {
    const float gain = h % 2 == 0 ? 1.0f : 20.0f;
    b.k_scale.push_back(1.5f * gain / 200.0f);
    b.v_scale.push_back(gain / 100.0f);
  }
  int64_t used_blocks = 0;
  for (const auto& s : seqs) {
    const int64_t blocks = (s.kv_len() + g.block_size - 1) / g.block_size;
    used_blocks += blocks;
    b.max_blocks = std::max(b.max_blocks, blocks);
    b.tokens += s.q_len;
    b.max_q = std::max(b.max_q, s.q_len);
    b.max_kv = std::max(b.max_kv, s.kv_len());
  }
  b.max_blocks += 1;
  b.num_blocks = used_blocks + 3;
  std::vector<int32_t> free_blocks(static_cast<size_t>(b.num_blocks));
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
  b.block_tables.assign(static_cast<size_t>(b.num_seqs() * b.max_blocks), -12345);
  const size_t row = static_cast<size_t>(g.kv_heads * g.head_dim);
  b.k_cache.assign(static_cast<size_t>(b.num_blocks * g.block_size) * row, kE4m3NaN);
  b.v_cache.assign(b.k_cache.size(), kE4m3NaN);
  size_t next_free = 0;
  b.cu_q = {0};
  for (size_t s = 0; s < seqs.size(); ++s) {
    const int64_t kv = seqs[s].kv_len();
    int32_t* table = b.block_tables.data() + s * static_cast<size_t>(b.max_blocks);
    for (int64_t i = 0; i < (kv + g.block_size - 1) / g.block_size; ++i) table[i] = free_blocks.at(next_free++);
    for (int64_t p = 0; p < kv; ++p) {
      const size_t slot = static_cast<size_t>(table[p / g.block_size] * g.block_size + p % g.block_size);
      for (size_t e = 0; e < row; ++e) {
        const size_t h = e / static_cast<size_t>(g.head_dim);
        const float gain = h % 2 == 0 ? 1.0f : 20.0f;
        b.k_cache[slot * row + e] = f32_to_f8e4m3_bits(1.5f * gain * unit(rng) / b.k_scale[h]);
        b.v_cache[slot * row + e] = f32_to_f8e4m3_bits(gain * unit(rng) / b.v_scale[h]);
      }
    }
    b.cu_q.push_back(b.cu_q.back() + static_cast<int32_t>(seqs[s].q_len));
    b.kv_lens.push_back(static_cast<int32_t>(kv));
  }
  b.q.resize(static_cast<size_t>(b.tokens * g.heads * g.head_dim));
  for (auto& value : b.q) value = f32_to_bf16_bits(1.5f * unit(rng));
  return b;
}

void check(const Geometry& g, const std::vector<SeqSpec>& seqs, uint64_t seed, int window = 0, bool workspace = true) {
  std::string label = "heads " + std::to_string(g.heads) + "/" + std::to_string(g.kv_heads) + " d " +
                      std::to_string(g.head_dim) + " window " + std::to_string(window);
  for (const auto& s : seqs) label += " (" + std::to_string(s.cached) + "+" + std::to_string(s.q_len) + ")";
  SCOPED_TRACE(label);
  Fp8Batch b = make_batch(g, seqs, seed);
  const int64_t T = b.tokens, H = g.heads, D = g.head_dim;
  kernels::AttentionParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(D));
  params.window = window;
  params.max_q_len = b.max_q;
  params.max_kv_len = b.max_kv;
  params.kv_scales = b.host_scales();
  std::vector<float> expected(static_cast<size_t>(T * H * D));
  kernels::cpu::paged_attention(b.q_tensor(), b.k_tensor(), b.v_tensor(), b.cu_tensor(), b.lens_tensor(),
                                b.tables_tensor(), Tensor(expected.data(), DType::kF32, {T, H, D}), params);

  const OwnedTensor k_cache = to_device(b.k_tensor()), v_cache = to_device(b.v_tensor());
  const OwnedTensor k_scale = to_device(b.host_scales().k), v_scale = to_device(b.host_scales().v);
  const OwnedTensor cu_q = to_device(b.cu_tensor()), kv_lens = to_device(b.lens_tensor());
  const OwnedTensor tables = to_device(b.tables_tensor()), q = to_device(b.q_tensor());
  OwnedTensor out(DType::kBF16, {T, H, D}, Device::cuda());
  const size_t workspace_bytes = kernels::paged_attention_workspace_bytes(b.num_seqs(), T, H, D, params.max_kv_len);
  OwnedTensor scratch(DType::kU8, {static_cast<int64_t>(std::max<size_t>(workspace_bytes, 16))}, Device::cuda());
  params.workspace = workspace && workspace_bytes > 0 ? *scratch : Tensor();
  params.kv_scales = {*k_scale, *v_scale};
  kernels::paged_attention(*q, *k_cache, *v_cache, *cu_q, *kv_lens, *tables, *out, params);
  synchronize(Device::cuda());
  const OwnedTensor got = to_host(*out);
  const std::vector<double> actual = testing::to_doubles(*got);
  const std::vector<double> reference(expected.begin(), expected.end());
  EXPECT_TRUE(testing::close_rel_l2(actual, reference, kAttentionTolerance));
  double worst = 0.0;
  for (int64_t r = 0; r < T * H; ++r) {
    const std::span<const double> a(actual.data() + r * D, static_cast<size_t>(D));
    const std::span<const double> e(reference.data() + r * D, static_cast<size_t>(D));
    worst = std::max(worst, testing::relative_l2(a, e));
  }
  EXPECT_LE(worst, kRowTolerance);
}

std::vector<SeqSpec> decode_batch(std::vector<int64_t> contexts) {
  std::vector<SeqSpec> seqs;
  for (const int64_t kv : contexts) seqs.push_back({kv - 1, 1});
  return seqs;
}

TEST(CudaPagedAttentionFp8, DecodeMatchesCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  check({32, 8, 128, 16}, decode_batch({1, 17, 1000, 5000}), 1);           // Qwen3-8B shape, splits
  check({32, 8, 128, 16}, decode_batch({6000}), 2, 0, /*workspace=*/false);  // one split per chunk
  check({16, 2, 256, 32}, decode_batch({5000, 17, 1000}), 3);
  check({4, 2, 64, 16}, decode_batch({1, 15, 16, 33, 700, 1100}), 4);
  check({64, 2, 64, 16}, decode_batch({1200, 5}), 5);  // G 32: two row chunks
}

TEST(CudaPagedAttentionFp8, PrefillAndMixedStepsMatchCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const std::vector<SeqSpec> mixed = {{0, 300}, {517, 1}, {33, 64}, {0, 1}, {1000, 77}, {5, 129}};
  check({8, 2, 64, 16}, mixed, 11);
  check({8, 2, 128, 32}, mixed, 12);
  check({8, 2, 256, 16}, mixed, 13);
  check({32, 8, 128, 16}, {{0, 1500}, {600, 400}}, 14);
  check({32, 8, 128, 16}, {{3000, 4}, {100, 2}, {1, 3}}, 15);  // verify-sized blocks: split-KV
}

TEST(CudaPagedAttentionFp8, SlidingWindowsAndGenericHeadDims) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  for (const int window : {1, 16, 100}) {
    check({8, 2, 128, 16}, {{0, 300}, {517, 1}, {1000, 77}}, 20 + static_cast<uint64_t>(window), window);
    check({8, 2, 128, 16}, decode_batch({3000, 50}), 40 + static_cast<uint64_t>(window), window);
  }
  const std::vector<SeqSpec> mixed = {{0, 40}, {130, 1}, {17, 9}, {0, 1}};
  check({4, 2, 16, 16}, mixed, 61);
  check({4, 1, 32, 16}, mixed, 62);
  check({4, 2, 16, 16}, mixed, 63, 8);
}

// ---- the writes that quantise

TEST(CudaKvCacheWriteFp8, MatchesCpuByteForByte) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const int64_t kv_heads = 4, head_dim = 128, block_size = 16, num_blocks = 6, tokens = 29;
  std::mt19937_64 rng(71);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> scales_host = {0.002f, 0.05f, 1.0f, 3.0f};  // 3.0 * 448 < 1000: some codes saturate
  for (const DType input : {DType::kBF16, DType::kF32}) {
    SCOPED_TRACE(dtype_name(input));
    OwnedTensor k(input, {tokens, kv_heads, head_dim}), v(input, {tokens, kv_heads, head_dim});
    std::vector<float> values(static_cast<size_t>(k->numel()));
    for (auto& x : values) x = 1000.0f * unit(rng) * unit(rng) * unit(rng);
    testing::fill(*k, values);
    for (auto& x : values) x = 0.5f * unit(rng);
    testing::fill(*v, values);
    std::vector<int32_t> slots(static_cast<size_t>(num_blocks * block_size));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    slots.resize(static_cast<size_t>(tokens));
    slots[3] = -1;
    const Shape shape{num_blocks, block_size, kv_heads, head_dim};
    std::vector<uint8_t> k_cpu(static_cast<size_t>(shape.numel()), 0x55), v_cpu = k_cpu;
    const Tensor scales(scales_host.data(), DType::kF32, {kv_heads});
    kernels::kv_cache_write(*k, *v, Tensor(slots.data(), DType::kI32, {tokens}),
                            Tensor(k_cpu.data(), DType::kF8E4M3, shape), Tensor(v_cpu.data(), DType::kF8E4M3, shape),
                            {scales, scales});
    std::vector<uint8_t> init(k_cpu.size(), 0x55);
    const OwnedTensor k_cache = to_device(Tensor(init.data(), DType::kF8E4M3, shape));
    const OwnedTensor v_cache = to_device(Tensor(init.data(), DType::kF8E4M3, shape));
    const OwnedTensor scales_device = to_device(scales);
    const OwnedTensor k_device = to_device(*k), v_device = to_device(*v);
    const OwnedTensor slots_device = to_device(Tensor(slots.data(), DType::kI32, {tokens}));
    kernels::kv_cache_write(*k_device, *v_device, *slots_device, *k_cache, *v_cache, {*scales_device, *scales_device});
    const OwnedTensor k_got = to_host(*k_cache), v_got = to_host(*v_cache);
    const auto* kg = static_cast<const uint8_t*>(k_got->data());
    const auto* vg = static_cast<const uint8_t*>(v_got->data());
    size_t saturated = 0;
    for (size_t i = 0; i < k_cpu.size(); ++i) {
      ASSERT_EQ(kg[i], k_cpu[i]) << "k code " << i;
      ASSERT_EQ(vg[i], v_cpu[i]) << "v code " << i;
      saturated += (kg[i] & 0x7f) == 0x7e;
    }
    EXPECT_GT(saturated, 0u);
  }
}

// The fused prologue into e4m3 caches stores exactly the codes of what it stores into bf16 caches,
// quantised with the head's scale.
TEST(CudaQkNormRopeFp8, StoresTheQuantisedBf16Result) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const int64_t heads = 8, kv_heads = 2, head_dim = 128, block_size = 16, num_blocks = 4;
  testing::Random rng(81);
  for (const int64_t tokens : {int64_t{1}, int64_t{37}}) {
    SCOPED_TRACE(tokens);
    const OwnedTensor qkv = testing::random_tensor(DType::kBF16, {tokens, heads + 2 * kv_heads, head_dim}, rng, -3, 3);
    const OwnedTensor weight = testing::random_tensor(DType::kBF16, {head_dim}, rng, 0.5f, 1.5f);
    std::vector<int32_t> positions(static_cast<size_t>(tokens)), slots(static_cast<size_t>(num_blocks * block_size));
    std::iota(positions.begin(), positions.end(), 5);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng.engine());
    slots.resize(static_cast<size_t>(tokens));
    slots[0] = tokens > 1 ? -1 : slots[0];
    std::vector<float> inv_freq(32);
    for (size_t i = 0; i < inv_freq.size(); ++i) inv_freq[i] = std::pow(10000.0f, -static_cast<float>(i) / 32.0f);
    std::vector<float> scales_host = {0.01f, 0.04f};
    kernels::QkNormRopeParams params;
    params.rope.rotary_dim = 64;
    params.rope.attention_scaling = 1.0f;
    params.norm.eps = 1e-6f;

    const OwnedTensor positions_d = to_device(Tensor(positions.data(), DType::kI32, {tokens}));
    const OwnedTensor slots_d = to_device(Tensor(slots.data(), DType::kI32, {tokens}));
    const OwnedTensor inv_freq_d = to_device(Tensor(inv_freq.data(), DType::kF32, {32}));
    const OwnedTensor weight_d = to_device(*weight);
    const OwnedTensor scales_d = to_device(Tensor(scales_host.data(), DType::kF32, {kv_heads}));
    const Shape cache_shape{num_blocks, block_size, kv_heads, head_dim};
    // Runs the prologue on a fresh device copy of qkv into caches of `dtype`.
    const auto run = [&](DType dtype, const kernels::KvScales& scales, OwnedTensor& k_cache, OwnedTensor& v_cache) {
      const OwnedTensor qkv_d = to_device(*qkv);
      const int64_t row = qkv_d->stride(0);
      const Tensor q(qkv_d->data(), DType::kBF16, {tokens, heads, head_dim}, {row, head_dim, 1}, Device::cuda());
      const Tensor k(static_cast<uint16_t*>(qkv_d->data()) + heads * head_dim, DType::kBF16,
                     {tokens, kv_heads, head_dim}, {row, head_dim, 1}, Device::cuda());
      const Tensor v(static_cast<uint16_t*>(qkv_d->data()) + (heads + kv_heads) * head_dim, DType::kBF16,
                     {tokens, kv_heads, head_dim}, {row, head_dim, 1}, Device::cuda());
      k_cache = OwnedTensor(dtype, cache_shape, Device::cuda());
      v_cache = OwnedTensor(dtype, cache_shape, Device::cuda());
      k_cache.buffer.zero();
      v_cache.buffer.zero();
      kernels::QkNormRopeParams p = params;
      p.kv_scales = scales;
      kernels::qk_norm_rope_kv_write(q, k, v, *weight_d, *weight_d, *positions_d, *inv_freq_d, *slots_d, *k_cache,
                                     *v_cache, p);
      synchronize(Device::cuda());
      return to_host(*qkv_d);
    };
    OwnedTensor k_bf16, v_bf16, k_fp8, v_fp8;
    const OwnedTensor q_after_bf16 = run(DType::kBF16, {}, k_bf16, v_bf16);
    const OwnedTensor q_after_fp8 = run(DType::kF8E4M3, {*scales_d, *scales_d}, k_fp8, v_fp8);
    EXPECT_EQ(testing::element_bytes(*q_after_fp8), testing::element_bytes(*q_after_bf16)) << "q is rotated alike";
    for (const auto& [wide, narrow] : {std::pair{&k_bf16, &k_fp8}, std::pair{&v_bf16, &v_fp8}}) {
      const std::vector<double> values = testing::to_doubles(*to_host(**wide));
      const OwnedTensor codes = to_host(**narrow);
      const auto* got = static_cast<const uint8_t*>(codes->data());
      size_t nonzero = 0;
      for (size_t i = 0; i < values.size(); ++i) {
        const float scale = scales_host[(i / static_cast<size_t>(head_dim)) % static_cast<size_t>(kv_heads)];
        ASSERT_EQ(got[i], f32_to_f8e4m3_bits(static_cast<float>(values[i]) / scale)) << "element " << i;
        nonzero += got[i] != 0;
      }
      EXPECT_GT(nonzero, 0u);
    }
  }
}

}  // namespace
}  // namespace metrale
