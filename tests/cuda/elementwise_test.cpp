// The small CUDA ops against their CPU twins on the same bf16-representable inputs: embedding,
// rms_norm, add_rms_norm, rope, silu_mul, add_inplace and convert. Outputs are poisoned with NaN
// first and every element is checked; shapes include T = 1, 3, 257, widths of 64 to 5120 and odd
// ones (the element-by-element fallbacks), strided views (gated-q head slices, halves of a fused
// projection, padded rows) and in-place use.
//
// bf16 outputs are compared with the fp32 CPU twins at relative L2 1e-2, and additionally with a host
// model of transformers' bf16 rounding (rms_norm.cu, rope.cu, activation.cu): at least 99% of the
// elements must be bit-equal to it (the rest may differ by the ulp a different reduction order or
// rsqrt/sincos rounding moves). A wrong rounding rule (e.g. rounding cos/sin or the normalised value
// at the wrong point) changes far more elements than that.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "kernels/activation.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "cuda/cuda_test_helpers.h"
#include "kernels/kernel_helpers.h"
#include "kernels/rms_norm.h"
#include "kernels/rope.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

using testing::to_device;
using testing::to_host;
using testing::f32_copy;

using kernels::RmsNormKind;
using kernels::RmsNormParams;
using testing::Random;

constexpr double kBf16VsF32Tolerance = 1e-2;
constexpr double kMinExactFraction = 0.99;

// A contiguous f32 host copy of any host tensor (the input of the fp32 CPU references).
float bf16(float value) { return round_to_bf16(value); }

// Fraction of elements of `actual` equal to `expected` (both in logical order).
double exact_fraction(const std::vector<double>& actual, const std::vector<float>& expected) {
  EXPECT_EQ(actual.size(), expected.size());
  size_t equal = 0;
  for (size_t i = 0; i < actual.size() && i < expected.size(); ++i) equal += actual[i] == static_cast<double>(expected[i]);
  return actual.empty() ? 1.0 : static_cast<double>(equal) / static_cast<double>(actual.size());
}

// ----------------------------------------------------------------------------------------------
// embedding

TEST(CudaEmbedding, CopiesRowsLikeTheCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(5101);
  const int64_t vocab = 1000;
  struct Case {
    DType table, out;
  };
  for (const Case c : {Case{DType::kBF16, DType::kBF16}, Case{DType::kF32, DType::kBF16}, Case{DType::kBF16, DType::kF32},
                       Case{DType::kF32, DType::kF32}}) {
    for (const int64_t hidden : {64, 128, 2048, 5120, 67}) {
      for (const int64_t tokens : {1, 3, 257}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(c.table) << "->" << dtype_name(c.out) << " H " << hidden
                                          << " T " << tokens);
        const OwnedTensor table = testing::random_tensor(c.table, {vocab, hidden}, rng, -1.0f, 1.0f);
        std::vector<int32_t> ids(static_cast<size_t>(tokens));
        for (auto& id : ids) id = static_cast<int32_t>(rng.integer(0, vocab - 1));
        const Tensor ids_host(ids.data(), DType::kI32, {tokens});
        // Output rows padded by 8 elements (row stride > H); the padding must stay untouched.
        OwnedTensor out_wide(c.out, {tokens, hidden + 8});
        testing::poison(*out_wide);
        const OwnedTensor out_device = to_device(*out_wide);
        const OwnedTensor table_device = to_device(*table), ids_device = to_device(ids_host);
        kernels::embedding(*ids_device, *table_device, out_device->slice(1, 0, hidden));
        OwnedTensor expected(c.out, {tokens, hidden});
        kernels::embedding(ids_host, *table, *expected);
        const OwnedTensor got = to_host(*out_device);
        EXPECT_EQ(testing::to_doubles(got->slice(1, 0, hidden)), testing::to_doubles(*expected));
        for (const double pad : testing::to_doubles(got->slice(1, hidden, hidden + 8))) EXPECT_TRUE(std::isnan(pad));
      }
    }
  }
}

TEST(CudaEmbedding, OutOfRangeIdsGiveZeroRows) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(5102);
  const int64_t vocab = 50, hidden = 128;
  const OwnedTensor table = testing::random_tensor(DType::kBF16, {vocab, hidden}, rng, 0.5f, 1.0f);
  std::vector<int32_t> ids = {3, -1, 50, 49};
  const OwnedTensor ids_device = to_device(Tensor(ids.data(), DType::kI32, {4}));
  OwnedTensor out(DType::kBF16, {4, hidden});
  testing::poison(*out);
  const OwnedTensor out_device = to_device(*out);
  kernels::embedding(*ids_device, *to_device(*table), *out_device);
  const std::vector<double> got = testing::to_doubles(*to_host(*out_device));
  const std::vector<double> rows = testing::to_doubles(*table);
  for (int64_t i = 0; i < hidden; ++i) {
    EXPECT_EQ(got[static_cast<size_t>(i)], rows[static_cast<size_t>(3 * hidden + i)]);
    EXPECT_EQ(got[static_cast<size_t>(hidden + i)], 0.0);
    EXPECT_EQ(got[static_cast<size_t>(2 * hidden + i)], 0.0);
    EXPECT_EQ(got[static_cast<size_t>(3 * hidden + i)], rows[static_cast<size_t>(49 * hidden + i)]);
  }
}

TEST(CudaEmbedding, ShardMatchesTheCpu) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(5103);
  const int64_t rows = 40, hidden = 256, first = 40;  // the second shard of a vocabulary of 120
  const OwnedTensor table = testing::random_tensor(DType::kBF16, {rows, hidden}, rng, -1.0f, 1.0f);
  std::vector<int32_t> ids = {41, 3, 79, 80, 40, 119, 55};
  const Tensor ids_host(ids.data(), DType::kI32, {7});
  for (const DType out_dtype : {DType::kBF16, DType::kF32}) {
    OwnedTensor expected(out_dtype, {7, hidden}), out(out_dtype, {7, hidden});
    testing::poison(*out);
    kernels::embedding_shard(ids_host, *table, first, *expected);
    const OwnedTensor out_device = to_device(*out);
    kernels::embedding_shard(*to_device(ids_host), *to_device(*table), first, *out_device);
    EXPECT_EQ(testing::to_doubles(*to_host(*out_device)), testing::to_doubles(*expected));
  }
}

// ----------------------------------------------------------------------------------------------
// rms_norm and add_rms_norm

// transformers' bf16 rounding of one row: plain D(w * D(x * r)), zero-centred D(x * r * (1 + w)).
std::vector<float> bf16_norm_reference(const std::vector<double>& x, const std::vector<double>& w, int64_t width,
                                       const RmsNormParams& params) {
  std::vector<float> y(x.size());
  for (size_t row = 0; row < x.size() / static_cast<size_t>(width); ++row) {
    const double* in = x.data() + row * static_cast<size_t>(width);
    float sum = 0.0f;
    for (int64_t i = 0; i < width; ++i) sum += static_cast<float>(in[i]) * static_cast<float>(in[i]);
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(width) + params.eps);
    for (int64_t i = 0; i < width; ++i) {
      const float n = static_cast<float>(in[i]) * inv;
      const float wi = static_cast<float>(w[static_cast<size_t>(i)]);
      y[row * static_cast<size_t>(width) + static_cast<size_t>(i)] =
          params.kind == RmsNormKind::kPlain ? bf16(wi * bf16(n)) : bf16(n * (1.0f + wi));
    }
  }
  return y;
}

struct NormCase {
  int64_t tokens, heads, width;  // heads 0: x is [T, width]; else [T, heads, width] with head stride 2 x width
  bool in_place;
};

const NormCase kNormCases[] = {
    {1, 0, 64, false},   {3, 0, 128, true},  {257, 0, 256, false}, {3, 0, 2048, false}, {257, 0, 5120, true},
    {1, 0, 5120, false}, {3, 0, 67, false},  {2, 0, 5001, false},  {2, 0, 40000, true}, {257, 8, 128, true},
    {3, 4, 256, false},  {1, 16, 64, true},  {3, 2, 72, true},
};

TEST(CudaRmsNorm, MatchesCpuAndBf16Rounding) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(5201);
  for (const RmsNormKind kind : {RmsNormKind::kPlain, RmsNormKind::kZeroCentered}) {
    for (const NormCase& c : kNormCases) {
      SCOPED_TRACE(::testing::Message() << (kind == RmsNormKind::kPlain ? "plain" : "zero-centred") << " T "
                                        << c.tokens << " heads " << c.heads << " D " << c.width << " in place "
                                        << c.in_place);
      const RmsNormParams params{1e-6f, kind};
      const float w_lo = kind == RmsNormKind::kPlain ? 0.5f : -0.5f;
      const OwnedTensor weight = testing::random_tensor(DType::kBF16, {c.width}, rng, w_lo, w_lo + 1.0f);
      // Storage: [T, width] or [T, heads, 2 x width] whose first halves are the heads (gated q).
      const OwnedTensor storage = c.heads == 0 ? testing::random_tensor(DType::kBF16, {c.tokens, c.width}, rng, -2.0f, 2.0f)
                                               : testing::random_tensor(DType::kBF16, {c.tokens, c.heads, 2 * c.width},
                                                                        rng, -2.0f, 2.0f);
      auto view_of = [&](const Tensor& t) { return c.heads == 0 ? t : t.slice(2, 0, c.width); };
      const Tensor x_host = view_of(*storage);
      const OwnedTensor storage_device = to_device(*storage);
      const Tensor x_device = view_of(*storage_device);
      OwnedTensor out_device_owned(DType::kBF16, x_host.shape(), Device::cuda());
      if (!c.in_place) {
        OwnedTensor nan_host(DType::kBF16, x_host.shape());
        testing::poison(*nan_host);
        copy_tensor(*out_device_owned, *nan_host);
      }
      const Tensor out_device = c.in_place ? x_device : *out_device_owned;
      kernels::rms_norm(x_device, *to_device(*weight), out_device, params);

      const OwnedTensor x_f32 = f32_copy(x_host);
      OwnedTensor expected(DType::kF32, x_host.shape());
      kernels::rms_norm(*x_f32, *weight, *expected, params);
      const OwnedTensor storage_after = to_host(*storage_device);
      const std::vector<double> got =
          c.in_place ? testing::to_doubles(view_of(*storage_after)) : testing::to_doubles(*to_host(out_device));
      EXPECT_TRUE(testing::close_rel_l2(got, testing::to_doubles(*expected), kBf16VsF32Tolerance));
      EXPECT_GE(exact_fraction(got, bf16_norm_reference(testing::to_doubles(x_host), testing::to_doubles(*weight),
                                                         c.width, params)),
                kMinExactFraction);
      if (c.heads > 0) {  // the gate halves are not part of the view and must be untouched
        EXPECT_EQ(testing::element_bytes(storage_after->slice(2, c.width, 2 * c.width)),
                  testing::element_bytes(storage->slice(2, c.width, 2 * c.width)));
      }
    }
  }
}

TEST(CudaRmsNorm, F32ActivationsMatchTheCpuClosely) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(5202);
  for (const RmsNormKind kind : {RmsNormKind::kPlain, RmsNormKind::kZeroCentered}) {
    for (const int64_t width : {64, 2048, 67, 5120}) {
      const RmsNormParams params{1e-5f, kind};
      const OwnedTensor x = testing::random_tensor(DType::kF32, {5, width}, rng, -3.0f, 3.0f);
      const OwnedTensor weight = testing::random_tensor(DType::kF32, {width}, rng, 0.5f, 1.5f);
      OwnedTensor out(DType::kF32, {5, width});
      testing::poison(*out);
      const OwnedTensor out_device = to_device(*out);
      kernels::rms_norm(*to_device(*x), *to_device(*weight), *out_device, params);
      OwnedTensor expected(DType::kF32, {5, width});
      kernels::rms_norm(*x, *weight, *expected, params);
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*out_device), testing::to_doubles(*expected), 1e-5)) << width;
    }
  }
}

TEST(CudaAddRmsNorm, RoundsTheResidualThenNormalises) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(5203);
  for (const RmsNormKind kind : {RmsNormKind::kPlain, RmsNormKind::kZeroCentered}) {
    for (const NormCase& c : kNormCases) {
      if (c.heads != 0) continue;
      SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " D " << c.width);
      const RmsNormParams params{1e-6f, kind};
      const float w_lo = kind == RmsNormKind::kPlain ? 0.5f : -0.5f;
      const OwnedTensor weight = testing::random_tensor(DType::kBF16, {c.width}, rng, w_lo, w_lo + 1.0f);
      const OwnedTensor residual = testing::random_tensor(DType::kBF16, {c.tokens, c.width}, rng, -2.0f, 2.0f);
      // x as the first half of padded rows: a strided input.
      const OwnedTensor x_storage = testing::random_tensor(DType::kBF16, {c.tokens, c.width + 16}, rng, -1.0f, 1.0f);
      const Tensor x_host = x_storage->slice(1, 0, c.width);
      const OwnedTensor residual_device = to_device(*residual);
      const OwnedTensor x_device = to_device(*x_storage);
      OwnedTensor nan_host(DType::kBF16, {c.tokens, c.width});
      testing::poison(*nan_host);
      const OwnedTensor out_device = to_device(*nan_host);
      kernels::add_rms_norm(*residual_device, x_device->slice(1, 0, c.width), *to_device(*weight), *out_device, params);

      // The new residual is D(residual + x), exactly.
      const std::vector<double> r = testing::to_doubles(*residual), xv = testing::to_doubles(x_host);
      std::vector<float> new_residual(r.size());
      for (size_t i = 0; i < r.size(); ++i) new_residual[i] = bf16(static_cast<float>(r[i]) + static_cast<float>(xv[i]));
      const std::vector<double> got_residual = testing::to_doubles(*to_host(*residual_device));
      EXPECT_EQ(exact_fraction(got_residual, new_residual), 1.0);

      // The CPU twin keeps an f32 residual stream (no rounding of the sum).
      const OwnedTensor residual_f32 = f32_copy(*residual);
      OwnedTensor expected(DType::kF32, {c.tokens, c.width});
      kernels::add_rms_norm(*residual_f32, x_host, *weight, *expected, params);
      const std::vector<double> got = testing::to_doubles(*to_host(*out_device));
      EXPECT_TRUE(testing::close_rel_l2(got, testing::to_doubles(*expected), kBf16VsF32Tolerance));
      const std::vector<double> rounded(new_residual.begin(), new_residual.end());
      EXPECT_GE(exact_fraction(got, bf16_norm_reference(rounded, testing::to_doubles(*weight), c.width, params)),
                kMinExactFraction);
    }
  }
}

// ----------------------------------------------------------------------------------------------
// rope

std::vector<float> inverse_frequencies(int rotary_dim, double theta) {
  std::vector<float> inv(static_cast<size_t>(rotary_dim / 2));
  for (size_t i = 0; i < inv.size(); ++i) {
    inv[i] = 1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(rotary_dim));
  }
  return inv;
}

// transformers' bf16 RoPE of x [T, heads, D] (logical order).
std::vector<float> bf16_rope_reference(const std::vector<double>& x, int64_t tokens, int64_t heads, int64_t d,
                                       const std::vector<int32_t>& positions, const std::vector<float>& inv_freq,
                                       float scaling) {
  std::vector<float> y(x.begin(), x.end());
  const size_t half = inv_freq.size();
  for (int64_t t = 0; t < tokens; ++t) {
    for (size_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(positions[static_cast<size_t>(t)]) * inv_freq[i];
      const float c = bf16(std::cos(angle) * scaling), s = bf16(std::sin(angle) * scaling);
      for (int64_t h = 0; h < heads; ++h) {
        float* head = y.data() + (t * heads + h) * d;
        const float a = static_cast<float>(x[static_cast<size_t>((t * heads + h) * d) + i]);
        const float b = static_cast<float>(x[static_cast<size_t>((t * heads + h) * d) + i + half]);
        head[i] = bf16(bf16(a * c) - bf16(b * s));
        head[i + half] = bf16(bf16(b * c) + bf16(a * s));
      }
    }
  }
  return y;
}

struct RopeCase {
  int64_t tokens, heads, head_dim;
  int rotary_dim;
  float scaling;
  bool gated;  // x is the query half of [T, heads, 2 x head_dim]
};

TEST(CudaRope, MatchesCpuAndBf16Rounding) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(5301);
  const RopeCase cases[] = {{1, 8, 128, 128, 1.0f, false},  {3, 4, 64, 64, 1.0f, true},    {257, 8, 128, 128, 1.0f, false},
                            {257, 2, 256, 64, 1.0f, true},  {3, 16, 128, 128, 1.25f, false}, {5, 3, 256, 128, 1.0f, false},
                            {3, 2, 80, 40, 1.0f, false},    {2, 3, 96, 12, 0.9f, true}};
  for (const RopeCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " heads " << c.heads << " D " << c.head_dim << " rotary "
                                      << c.rotary_dim << " gated " << c.gated);
    const OwnedTensor storage = testing::random_tensor(
        DType::kBF16, {c.tokens, c.heads, c.gated ? 2 * c.head_dim : c.head_dim}, rng, -2.0f, 2.0f);
    auto view_of = [&](const Tensor& t) { return c.gated ? t.slice(2, 0, c.head_dim) : t; };
    std::vector<int32_t> positions;  // position 0 first (cos 1, sin 0), then anywhere up to 200k
    for (int64_t t = 0; t < c.tokens; ++t) positions.push_back(t == 0 ? 0 : static_cast<int32_t>(rng.integer(0, 200000)));
    const std::vector<float> inv_freq = inverse_frequencies(c.rotary_dim, 1e6);
    const Tensor positions_host(positions.data(), DType::kI32, {c.tokens});
    const Tensor inv_freq_host(const_cast<float*>(inv_freq.data()), DType::kF32, {c.rotary_dim / 2});
    const kernels::RopeParams params{c.rotary_dim, c.scaling};

    const OwnedTensor storage_device = to_device(*storage);
    kernels::rope(view_of(*storage_device), *to_device(positions_host), *to_device(inv_freq_host), params);
    const OwnedTensor after = to_host(*storage_device);
    const std::vector<double> got = testing::to_doubles(view_of(*after));

    const OwnedTensor expected = f32_copy(view_of(*storage));
    kernels::rope(*expected, positions_host, inv_freq_host, params);
    EXPECT_TRUE(testing::close_rel_l2(got, testing::to_doubles(*expected), kBf16VsF32Tolerance));
    EXPECT_GE(exact_fraction(got, bf16_rope_reference(testing::to_doubles(view_of(*storage)), c.tokens, c.heads,
                                                      c.head_dim, positions, inv_freq, c.scaling)),
              kMinExactFraction);
    // Channels past rotary_dim and the gate halves are untouched.
    EXPECT_EQ(testing::element_bytes(after->slice(2, c.rotary_dim, after->size(2))),
              testing::element_bytes(storage->slice(2, c.rotary_dim, storage->size(2))));
  }
}

TEST(CudaRope, F32ActivationsMatchTheCpuClosely) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(5302);
  const int64_t tokens = 33, heads = 4, d = 128;
  const OwnedTensor x = testing::random_tensor(DType::kF32, {tokens, heads, d}, rng, -2.0f, 2.0f);
  std::vector<int32_t> positions(static_cast<size_t>(tokens));
  for (auto& p : positions) p = static_cast<int32_t>(rng.integer(0, 150000));
  const std::vector<float> inv_freq = inverse_frequencies(128, 1e6);
  const Tensor positions_host(positions.data(), DType::kI32, {tokens});
  const Tensor inv_freq_host(const_cast<float*>(inv_freq.data()), DType::kF32, {64});
  const OwnedTensor x_device = to_device(*x);
  kernels::rope(*x_device, *to_device(positions_host), *to_device(inv_freq_host), {128, 1.0f});
  kernels::rope(*x, positions_host, inv_freq_host, {128, 1.0f});
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*x_device), testing::to_doubles(*x), 1e-5));
}

// ----------------------------------------------------------------------------------------------
// silu_mul

TEST(CudaSiluMul, MatchesCpuAndBf16Rounding) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(5401);
  for (const int64_t width : {64, 2048, 5120, 67, 17408}) {
    for (const int64_t tokens : {1, 3, 257}) {
      if (width == 17408 && tokens == 257) continue;
      SCOPED_TRACE(::testing::Message() << "T " << tokens << " I " << width);
      // gate and up: the two halves of one fused projection [T, 2I]; out rows padded.
      const OwnedTensor fused = testing::random_tensor(DType::kBF16, {tokens, 2 * width}, rng, -6.0f, 6.0f);
      OwnedTensor out_wide(DType::kBF16, {tokens, width + 8});
      testing::poison(*out_wide);
      const OwnedTensor fused_device = to_device(*fused), out_device = to_device(*out_wide);
      kernels::silu_mul(fused_device->slice(1, 0, width), fused_device->slice(1, width, 2 * width),
                        out_device->slice(1, 0, width));
      const OwnedTensor got_wide = to_host(*out_device);
      const std::vector<double> got = testing::to_doubles(got_wide->slice(1, 0, width));
      for (const double pad : testing::to_doubles(got_wide->slice(1, width, width + 8))) EXPECT_TRUE(std::isnan(pad));

      OwnedTensor expected(DType::kF32, {tokens, width});
      kernels::silu_mul(fused->slice(1, 0, width), fused->slice(1, width, 2 * width), *expected);
      EXPECT_TRUE(testing::close_rel_l2(got, testing::to_doubles(*expected), kBf16VsF32Tolerance));
      const std::vector<double> g = testing::to_doubles(fused->slice(1, 0, width));
      const std::vector<double> u = testing::to_doubles(fused->slice(1, width, 2 * width));
      std::vector<float> rounded(g.size());
      for (size_t i = 0; i < g.size(); ++i) {
        const float gv = static_cast<float>(g[i]);
        rounded[i] = bf16(bf16(gv / (1.0f + std::exp(-gv))) * static_cast<float>(u[i]));
      }
      EXPECT_GE(exact_fraction(got, rounded), kMinExactFraction);
    }
  }
}

TEST(CudaSiluMul, F32ActivationsMatchTheCpuClosely) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(5402);
  const OwnedTensor gate = testing::random_tensor(DType::kF32, {9, 300}, rng, -8.0f, 8.0f);
  const OwnedTensor up = testing::random_tensor(DType::kF32, {9, 300}, rng);
  OwnedTensor out(DType::kF32, {9, 300});
  testing::poison(*out);
  const OwnedTensor out_device = to_device(*out);
  kernels::silu_mul(*to_device(*gate), *to_device(*up), *out_device);
  kernels::silu_mul(*gate, *up, *out);
  EXPECT_TRUE(testing::close_rel_l2(*to_host(*out_device), testing::to_doubles(*out), 1e-6));
}

// ----------------------------------------------------------------------------------------------
// add_inplace and convert

TEST(CudaAddInplace, AddsAndRoundsOnce) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(5501);
  for (const int64_t n : {1, 7, 4096, 100003}) {
    for (const int64_t offset : {0, 1}) {  // offset 1: not 16-byte aligned
      SCOPED_TRACE(::testing::Message() << "n " << n << " offset " << offset);
      const OwnedTensor dst = testing::random_tensor(DType::kBF16, {n + offset}, rng, -2.0f, 2.0f);
      const OwnedTensor src = testing::random_tensor(DType::kBF16, {n + offset}, rng, -2.0f, 2.0f);
      const OwnedTensor dst_device = to_device(*dst), src_device = to_device(*src);
      kernels::add_inplace(dst_device->slice(0, offset, n + offset), src_device->slice(0, offset, n + offset));
      const std::vector<double> d = testing::to_doubles(*dst), s = testing::to_doubles(*src);
      std::vector<float> expected(static_cast<size_t>(n + offset));
      for (size_t i = 0; i < expected.size(); ++i) {
        expected[i] = static_cast<int64_t>(i) < offset ? static_cast<float>(d[i])
                                                        : bf16(static_cast<float>(d[i]) + static_cast<float>(s[i]));
      }
      EXPECT_EQ(exact_fraction(testing::to_doubles(*to_host(*dst_device)), expected), 1.0);

      // f32 destination, bf16 source: the CPU twin's case.
      const OwnedTensor dst_f32 = f32_copy(*dst);
      const OwnedTensor dst_f32_device = to_device(*dst_f32);
      kernels::add_inplace(dst_f32_device->slice(0, offset, n + offset), src_device->slice(0, offset, n + offset));
      kernels::add_inplace(dst_f32->slice(0, offset, n + offset), src->slice(0, offset, n + offset));
      EXPECT_EQ(testing::to_doubles(*to_host(*dst_f32_device)), testing::to_doubles(*dst_f32));
    }
  }
}

TEST(CudaConvert, EveryPairMatchesTheCpuExactly) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(5502);
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (const DType from : dtypes) {
    for (const DType to : dtypes) {
      for (const int64_t n : {5, 4096, 100003}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(from) << "->" << dtype_name(to) << " n " << n);
        const OwnedTensor src = testing::random_tensor(from, {n}, rng, -300.0f, 300.0f);
        OwnedTensor dst(to, {n});
        testing::poison(*dst);
        const OwnedTensor dst_device = to_device(*dst);
        kernels::convert(*to_device(*src), *dst_device);
        kernels::convert(*src, *dst);
        EXPECT_EQ(testing::element_bytes(*to_host(*dst_device)), testing::element_bytes(*dst));
      }
    }
  }
}

}  // namespace
}  // namespace metrale
