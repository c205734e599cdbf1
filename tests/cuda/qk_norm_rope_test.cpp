// CUDA kernels::qk_norm_rope_kv_write against its CPU twin (rms_norm + rope + kv_cache_write in
// fp32) on the same bf16 inputs: q, k, v as head slices of one fused projection (or gated attention's
// interleaved query/gate layout), T = 1, 3, 257, head dims 64 to 256 and an odd one, full and partial
// rotary, plain, zero-centred and no norms. The caches are poisoned: slots the batch writes must hold
// the rotated keys and the raw values, every other slot must stay NaN; k and v must be untouched.
// Beyond the fp32 comparison (relative L2 1e-2), 99% of the bf16 outputs must be bit-equal to a host
// model of transformers' bf16 rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/dtype.h"
#include "kernels/attention.h"
#include "cuda/cuda_test_helpers.h"
#include "kernels/kernel_helpers.h"
#include "kernels/qk_norm_rope.h"
#include "runtime/device.h"

namespace metrale {
namespace {

using testing::to_device;
using testing::to_host;
using testing::f32_copy;

using kernels::RmsNormKind;
using testing::Random;

float bf16(float value) { return round_to_bf16(value); }

// transformers' bf16 path for heads [T, heads, D] (logical order): optional norm, then RoPE.
std::vector<float> bf16_reference(const std::vector<double>& x, int64_t tokens, int64_t heads, int64_t d,
                                  const std::vector<double>* weight, RmsNormKind kind, float eps,
                                  const std::vector<int32_t>& positions, const std::vector<float>& inv_freq,
                                  float scaling) {
  std::vector<float> y(x.begin(), x.end());
  const size_t half = inv_freq.size();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      float* head = y.data() + (t * heads + h) * d;
      if (weight != nullptr) {
        float sum = 0.0f;
        for (int64_t i = 0; i < d; ++i) sum += head[i] * head[i];
        const float inv = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
        for (int64_t i = 0; i < d; ++i) {
          const float n = head[i] * inv, w = static_cast<float>((*weight)[static_cast<size_t>(i)]);
          head[i] = kind == RmsNormKind::kPlain ? bf16(w * bf16(n)) : bf16(n * (1.0f + w));
        }
      }
      for (size_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(positions[static_cast<size_t>(t)]) * inv_freq[i];
        const float c = bf16(std::cos(angle) * scaling), s = bf16(std::sin(angle) * scaling);
        const float a = head[i], b = head[i + half];
        head[i] = bf16(bf16(a * c) - bf16(b * s));
        head[i + half] = bf16(bf16(b * c) + bf16(a * s));
      }
    }
  }
  return y;
}

double exact_fraction(const std::vector<double>& actual, const std::vector<float>& expected) {
  EXPECT_EQ(actual.size(), expected.size());
  size_t equal = 0;
  for (size_t i = 0; i < actual.size() && i < expected.size(); ++i) equal += actual[i] == static_cast<double>(expected[i]);
  return actual.empty() ? 1.0 : static_cast<double>(equal) / static_cast<double>(actual.size());
}

struct Case {
  int64_t tokens, heads, kv_heads, head_dim;
  int rotary_dim;
  bool q_norm, k_norm;
  RmsNormKind kind;
  float scaling;
  bool gated;  // q is the query half of [T, heads, 2D] (Qwen3-Next); else q, k, v share one fused row
};

const Case kCases[] = {
    {1, 32, 8, 128, 128, true, true, RmsNormKind::kPlain, 1.0f, false},        // Qwen3-8B decode
    {3, 32, 8, 128, 128, true, true, RmsNormKind::kPlain, 1.0f, false},
    {257, 16, 4, 128, 128, true, true, RmsNormKind::kPlain, 1.0f, false},
    {257, 16, 2, 256, 64, true, true, RmsNormKind::kZeroCentered, 1.0f, true},  // Qwen3-Next gated, partial
    {3, 8, 1, 64, 64, false, false, RmsNormKind::kPlain, 1.0f, false},          // no norms
    {3, 4, 2, 128, 128, false, true, RmsNormKind::kPlain, 1.2f, false},         // k only, YaRN-like scaling
    {5, 4, 2, 100, 50, true, true, RmsNormKind::kZeroCentered, 1.0f, false},    // odd head_dim: scalar path
    {1, 2, 2, 256, 256, true, true, RmsNormKind::kPlain, 1.0f, true},
};

TEST(CudaQkNormRope, MatchesCpuTwinAndWritesOnlyMappedSlots) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(6101);
  for (const Case& c : kCases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " heads " << c.heads << "/" << c.kv_heads << " D "
                                      << c.head_dim << " rotary " << c.rotary_dim << " norms " << c.q_norm << c.k_norm
                                      << " gated " << c.gated);
    const int64_t d = c.head_dim, block_size = 16;
    const int64_t num_blocks = (c.tokens + 2 * block_size - 1) / block_size + 2;
    // Storage: gated: q_proj output [T, heads, 2D] plus a separate [T, 2 kv, D] for k and v;
    // else one fused [T, heads + 2 kv + 1, D] (a spare head so that the token stride is unusual).
    const OwnedTensor q_storage = testing::random_tensor(
        DType::kBF16, {c.tokens, c.gated ? c.heads : c.heads + 2 * c.kv_heads + 1, c.gated ? 2 * d : d}, rng, -2.0f, 2.0f);
    const OwnedTensor kv_storage = testing::random_tensor(DType::kBF16, {c.tokens, 2 * c.kv_heads, d}, rng, -2.0f, 2.0f);
    auto q_of = [&](const Tensor& qs) { return c.gated ? qs.slice(2, 0, d) : qs.slice(1, 0, c.heads); };
    auto k_of = [&](const Tensor& qs, const Tensor& kvs) {
      return c.gated ? kvs.slice(1, 0, c.kv_heads) : qs.slice(1, c.heads, c.heads + c.kv_heads);
    };
    auto v_of = [&](const Tensor& qs, const Tensor& kvs) {
      return c.gated ? kvs.slice(1, c.kv_heads, 2 * c.kv_heads) : qs.slice(1, c.heads + c.kv_heads, c.heads + 2 * c.kv_heads);
    };
    const float w_lo = c.kind == RmsNormKind::kPlain ? 0.5f : -0.5f;
    const OwnedTensor q_weight = testing::random_tensor(DType::kBF16, {d}, rng, w_lo, w_lo + 1.0f);
    const OwnedTensor k_weight = testing::random_tensor(DType::kBF16, {d}, rng, w_lo, w_lo + 1.0f);
    std::vector<int32_t> positions(static_cast<size_t>(c.tokens));
    for (auto& p : positions) p = static_cast<int32_t>(rng.integer(0, 130000));
    std::vector<float> inv_freq(static_cast<size_t>(c.rotary_dim / 2));
    for (size_t i = 0; i < inv_freq.size(); ++i) {
      inv_freq[i] = 1.0f / std::pow(1e6f, static_cast<float>(2 * i) / static_cast<float>(c.rotary_dim));
    }
    // Distinct slots in a shuffled order, every fourth token skipped (-1).
    std::vector<int32_t> all_slots(static_cast<size_t>(num_blocks * block_size));
    std::iota(all_slots.begin(), all_slots.end(), 0);
    std::shuffle(all_slots.begin(), all_slots.end(), rng.engine());
    std::vector<int32_t> slots(all_slots.begin(), all_slots.begin() + c.tokens);
    for (size_t t = 0; t < slots.size(); t += 4) {
      if (c.tokens > 1) slots[t] = -1;
    }
    const Tensor positions_host(positions.data(), DType::kI32, {c.tokens});
    const Tensor inv_freq_host(inv_freq.data(), DType::kF32, {c.rotary_dim / 2});
    const Tensor slots_host(slots.data(), DType::kI32, {c.tokens});
    kernels::QkNormRopeParams params;
    params.q_norm = c.q_norm;
    params.k_norm = c.k_norm;
    params.norm = {1e-6f, c.kind};
    params.rope = {c.rotary_dim, c.scaling};

    // GPU, bf16 everywhere, caches poisoned.
    OwnedTensor nan_cache(DType::kBF16, {num_blocks, block_size, c.kv_heads, d});
    testing::poison(*nan_cache);
    const OwnedTensor k_cache = to_device(*nan_cache), v_cache = to_device(*nan_cache);
    const OwnedTensor q_storage_device = to_device(*q_storage), kv_storage_device = to_device(*kv_storage);
    const OwnedTensor q_weight_device = to_device(*q_weight), k_weight_device = to_device(*k_weight);
    kernels::qk_norm_rope_kv_write(q_of(*q_storage_device), k_of(*q_storage_device, *kv_storage_device),
                                   v_of(*q_storage_device, *kv_storage_device), c.q_norm ? *q_weight_device : Tensor(),
                                   c.k_norm ? *k_weight_device : Tensor(), *to_device(positions_host),
                                   *to_device(inv_freq_host), *to_device(slots_host), *k_cache, *v_cache, params);

    // CPU twin in fp32 on the same values.
    const OwnedTensor q_f32 = f32_copy(q_of(*q_storage));
    const OwnedTensor k_f32 = f32_copy(k_of(*q_storage, *kv_storage)), v_f32 = f32_copy(v_of(*q_storage, *kv_storage));
    OwnedTensor k_cache_f32(DType::kF32, nan_cache->shape()), v_cache_f32(DType::kF32, nan_cache->shape());
    testing::poison(*k_cache_f32);
    testing::poison(*v_cache_f32);
    kernels::qk_norm_rope_kv_write(*q_f32, *k_f32, *v_f32, *q_weight, *k_weight, positions_host, inv_freq_host,
                                   slots_host, *k_cache_f32, *v_cache_f32, params);

    // q, rotated in place; the other parts of the storage untouched.
    const OwnedTensor q_after = to_host(*q_storage_device), kv_after = to_host(*kv_storage_device);
    const std::vector<double> q_got = testing::to_doubles(q_of(*q_after));
    EXPECT_TRUE(testing::close_rel_l2(q_got, testing::to_doubles(*q_f32), 1e-2));
    const std::vector<double> qw = testing::to_doubles(*q_weight), kw = testing::to_doubles(*k_weight);
    EXPECT_GE(exact_fraction(q_got, bf16_reference(testing::to_doubles(q_of(*q_storage)), c.tokens, c.heads, d,
                                                   c.q_norm ? &qw : nullptr, c.kind, 1e-6f, positions, inv_freq,
                                                   c.scaling)),
              0.99);
    if (c.gated) {
      EXPECT_EQ(testing::element_bytes(q_after->slice(2, d, 2 * d)), testing::element_bytes(q_storage->slice(2, d, 2 * d)));
      EXPECT_EQ(testing::element_bytes(*kv_after), testing::element_bytes(*kv_storage)) << "k and v must not change";
    } else {
      EXPECT_EQ(testing::element_bytes(q_after->slice(1, c.heads, q_after->size(1))),
                testing::element_bytes(q_storage->slice(1, c.heads, q_storage->size(1))))
          << "k and v must not change";
    }

    // Caches: mapped slots hold rope(norm(k)) and v, the others stay NaN.
    const std::vector<double> k_cache_got = testing::to_doubles(*to_host(*k_cache));
    const std::vector<double> v_cache_got = testing::to_doubles(*to_host(*v_cache));
    const std::vector<double> k_cache_expected = testing::to_doubles(*k_cache_f32);
    const std::vector<double> v_cache_expected = testing::to_doubles(*v_cache_f32);
    const std::vector<float> k_bf16 = bf16_reference(testing::to_doubles(*k_f32), c.tokens, c.kv_heads, d,
                                                     c.k_norm ? &kw : nullptr, c.kind, 1e-6f, positions, inv_freq,
                                                     c.scaling);
    const std::vector<double> v_values = testing::to_doubles(*v_f32);
    const size_t row = static_cast<size_t>(c.kv_heads * d);
    std::vector<double> k_written, k_written_expected;
    std::vector<float> k_written_bf16;
    std::vector<bool> slot_written(all_slots.size(), false);
    for (size_t t = 0; t < slots.size(); ++t) {
      if (slots[t] < 0) continue;
      const size_t base = static_cast<size_t>(slots[t]) * row;
      slot_written[static_cast<size_t>(slots[t])] = true;
      for (size_t i = 0; i < row; ++i) {
        k_written.push_back(k_cache_got[base + i]);
        k_written_expected.push_back(k_cache_expected[base + i]);
        k_written_bf16.push_back(k_bf16[t * row + i]);
        ASSERT_EQ(v_cache_got[base + i], v_values[t * row + i]) << "v of token " << t;
      }
    }
    EXPECT_TRUE(testing::close_rel_l2(k_written, k_written_expected, 1e-2));
    EXPECT_GE(exact_fraction(k_written, k_written_bf16), 0.99);
    for (size_t s = 0; s < slot_written.size(); ++s) {
      if (slot_written[s]) continue;
      for (size_t i = 0; i < row; ++i) {
        ASSERT_TRUE(std::isnan(k_cache_got[s * row + i]) && std::isnan(v_cache_got[s * row + i])) << "slot " << s;
      }
    }
  }
}

}  // namespace
}  // namespace metrale
