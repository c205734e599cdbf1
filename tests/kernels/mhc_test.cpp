// The mHC kernels on the CPU (mhc_pre, mhc_post, mhc_mean) against direct double-precision formulas
// (glm_deepseek.md §2.4), including the Sinkhorn order (last step on columns), M transposed in
// mhc_post and the rounding points of mhc_post in bf16.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/mhc.h"
#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using testing::Random;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct HcExpected {
  std::vector<double> post, comb, h;
};

HcExpected reference_hc_pre(const std::vector<double>& X, int64_t tokens, int64_t n, int64_t D,
                            const std::vector<double>& fn, const std::vector<double>& base,
                            const std::vector<double>& scale, const kernels::MhcParams& params) {
  const int64_t flat = n * D, mix = (2 + n) * n;
  const double eps = params.hc_eps;
  HcExpected e;
  for (int64_t t = 0; t < tokens; ++t) {
    const double* f = X.data() + t * flat;
    double sq = 0.0;
    for (int64_t i = 0; i < flat; ++i) sq += f[i] * f[i];
    const double inv = 1.0 / std::sqrt(sq / static_cast<double>(flat) + params.norm_eps);
    std::vector<double> m(static_cast<size_t>(mix), 0.0);
    for (int64_t i = 0; i < mix; ++i)
      for (int64_t k = 0; k < flat; ++k) m[static_cast<size_t>(i)] += fn[static_cast<size_t>(i * flat + k)] * f[k] * inv;
    std::vector<double> pre(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) {
      pre[static_cast<size_t>(j)] = sigmoid(m[static_cast<size_t>(j)] * scale[0] + base[static_cast<size_t>(j)]) + eps;
      e.post.push_back(2.0 * sigmoid(m[static_cast<size_t>(n + j)] * scale[1] + base[static_cast<size_t>(n + j)]));
    }
    std::vector<double> M(static_cast<size_t>(n * n));
    for (int64_t a = 0; a < n; ++a) {
      double mx = -1e300, sum = 0.0;
      for (int64_t c = 0; c < n; ++c) {
        const size_t i = static_cast<size_t>(a * n + c);
        M[i] = m[static_cast<size_t>(2 * n) + i] * scale[2] + base[static_cast<size_t>(2 * n) + i];
        mx = std::max(mx, M[i]);
      }
      for (int64_t c = 0; c < n; ++c) sum += std::exp(M[static_cast<size_t>(a * n + c)] - mx);
      for (int64_t c = 0; c < n; ++c) {
        M[static_cast<size_t>(a * n + c)] = std::exp(M[static_cast<size_t>(a * n + c)] - mx) / sum + eps;
      }
    }
    auto columns = [&] {
      for (int64_t c = 0; c < n; ++c) {
        double sum = 0.0;
        for (int64_t a = 0; a < n; ++a) sum += M[static_cast<size_t>(a * n + c)];
        for (int64_t a = 0; a < n; ++a) M[static_cast<size_t>(a * n + c)] /= sum + eps;
      }
    };
    columns();
    for (int it = 1; it < params.sinkhorn_iters; ++it) {
      for (int64_t a = 0; a < n; ++a) {
        double sum = 0.0;
        for (int64_t c = 0; c < n; ++c) sum += M[static_cast<size_t>(a * n + c)];
        for (int64_t c = 0; c < n; ++c) M[static_cast<size_t>(a * n + c)] /= sum + eps;
      }
      columns();
    }
    e.comb.insert(e.comb.end(), M.begin(), M.end());
    for (int64_t d = 0; d < D; ++d) {
      double sum = 0.0;
      for (int64_t j = 0; j < n; ++j) sum += pre[static_cast<size_t>(j)] * f[j * D + d];
      e.h.push_back(sum);
    }
  }
  return e;
}

TEST(Mhc, PreMatchesDirectFormula) {
  for (const int64_t n : {4, 3}) {
    Random rng(40 + static_cast<uint64_t>(n));
    const int64_t tokens = 5, D = 48, mix = (2 + n) * n;
    // X is a row slice of a taller buffer (strided rows); fn, base and scale in bf16 as after a bf16 load.
    const OwnedTensor buffer = testing::random_tensor(DType::kF32, {tokens + 2, n, D}, rng, -2.0f, 2.0f);
    const Tensor X = buffer->slice(0, 1, 1 + tokens);
    const OwnedTensor fn = testing::random_tensor(DType::kBF16, {mix, n * D}, rng, -0.3f, 0.3f);
    const OwnedTensor base = testing::random_tensor(DType::kBF16, {mix}, rng, -1.0f, 1.0f);
    const OwnedTensor scale = testing::random_tensor(DType::kBF16, {3}, rng, 0.5f, 2.0f);
    OwnedTensor post(DType::kF32, {tokens, n}), comb(DType::kF32, {tokens, n, n}), h(DType::kF32, {tokens, D});
    for (const Tensor* t : {&*post, &*comb, &*h}) testing::poison(*t);
    kernels::MhcParams params;
    kernels::mhc_pre(X, *fn, *base, *scale, *post, *comb, *h, params);
    const HcExpected expected =
        reference_hc_pre(testing::to_doubles(X), tokens, n, D, testing::to_doubles(*fn), testing::to_doubles(*base),
                         testing::to_doubles(*scale), params);
    EXPECT_TRUE(testing::close_rel_l2(*post, expected.post, 1e-5)) << "n " << n;
    EXPECT_TRUE(testing::close_rel_l2(*comb, expected.comb, 1e-5)) << "n " << n;
    EXPECT_TRUE(testing::close_rel_l2(*h, expected.h, 1e-5)) << "n " << n;
    // The last Sinkhorn step normalises columns: every column sums to 1 (up to eps), rows only nearly.
    const std::vector<double> M = testing::to_doubles(*comb);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < n; ++c) {
        double sum = 0.0;
        for (int64_t a = 0; a < n; ++a) sum += M[static_cast<size_t>((t * n + a) * n + c)];
        EXPECT_NEAR(sum, 1.0, 1e-5);
      }
    }
  }
}

// Fewer Sinkhorn iterations give a different M (the iteration count is honoured), with the same h.
TEST(Mhc, PreHonoursIterationCount) {
  Random rng(44);
  const int64_t tokens = 2, n = 4, D = 16, mix = (2 + n) * n;
  const OwnedTensor X = testing::random_tensor(DType::kF32, {tokens, n, D}, rng);
  const OwnedTensor fn = testing::random_tensor(DType::kF32, {mix, n * D}, rng, -1.0f, 1.0f);
  const OwnedTensor base = testing::random_tensor(DType::kF32, {mix}, rng, -2.0f, 2.0f);
  const OwnedTensor scale = testing::random_tensor(DType::kF32, {3}, rng, 1.0f, 3.0f);
  for (const int iters : {1, 2, 7}) {
    kernels::MhcParams params;
    params.sinkhorn_iters = iters;
    OwnedTensor post(DType::kF32, {tokens, n}), comb(DType::kF32, {tokens, n, n}), h(DType::kF32, {tokens, D});
    kernels::mhc_pre(*X, *fn, *base, *scale, *post, *comb, *h, params);
    const HcExpected expected = reference_hc_pre(testing::to_doubles(*X), tokens, n, D, testing::to_doubles(*fn),
                                                 testing::to_doubles(*base), testing::to_doubles(*scale), params);
    EXPECT_TRUE(testing::close_rel_l2(*comb, expected.comb, 1e-5)) << iters;
    EXPECT_TRUE(testing::close_rel_l2(*h, expected.h, 1e-5)) << iters;
  }
}

// mhc_post with M transposed (the sum over the first index), in f32 and with bf16 rounding points.
TEST(Mhc, PostMixesWithTransposedCombAndRoundsAsReference) {
  Random rng(45);
  const int64_t tokens = 3, n = 4, D = 20;
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    const OwnedTensor X = testing::random_tensor(dtype, {tokens, n, D}, rng, -2.0f, 2.0f);
    const OwnedTensor y = testing::random_tensor(dtype, {tokens, D}, rng, -2.0f, 2.0f);
    const OwnedTensor post = testing::random_tensor(DType::kF32, {tokens, n}, rng, 0.0f, 2.0f);
    const OwnedTensor comb = testing::random_tensor(DType::kF32, {tokens, n, n}, rng, 0.0f, 1.0f);
    OwnedTensor out(dtype, {tokens, n, D});
    testing::poison(*out);
    kernels::mhc_post(*X, *y, *post, *comb, *out);
    const std::vector<double> xs = testing::to_doubles(*X), ys = testing::to_doubles(*y);
    const std::vector<double> ps = testing::to_doubles(*post), ms = testing::to_doubles(*comb);
    const auto r = [&](double v) {
      return dtype == DType::kBF16 ? static_cast<double>(round_to_bf16(static_cast<float>(v))) : v;
    };
    std::vector<double> expected;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < n; ++c) {
        for (int64_t d = 0; d < D; ++d) {
          double mixed = 0.0;
          for (int64_t a = 0; a < n; ++a) {
            mixed += r(ms[static_cast<size_t>((t * n + a) * n + c)]) * xs[static_cast<size_t>((t * n + a) * D + d)];
          }
          expected.push_back(r(r(r(ps[static_cast<size_t>(t * n + c)]) * ys[static_cast<size_t>(t * D + d)]) + r(mixed)));
        }
      }
    }
    // bf16: identical up to fp32-vs-double rounding of the inner sum (one bf16 ulp at most).
    EXPECT_TRUE(testing::close_rel_l2(*out, expected, dtype == DType::kF32 ? 1e-6 : 2e-3)) << dtype_name(dtype);
    // In place.
    OwnedTensor inplace(dtype, {tokens, n, D});
    copy_tensor(*inplace, *X);
    kernels::mhc_post(*inplace, *y, *post, *comb, *inplace);
    EXPECT_EQ(testing::to_doubles(*inplace), testing::to_doubles(*out));
  }
}

TEST(Mhc, MeanOverStreams) {
  Random rng(46);
  const int64_t tokens = 3, n = 4, D = 10;
  const OwnedTensor X = testing::random_tensor(DType::kF32, {tokens, n, D}, rng);
  OwnedTensor out(DType::kF32, {tokens, D});
  testing::poison(*out);
  kernels::mhc_mean(*X, *out);
  const std::vector<double> xs = testing::to_doubles(*X);
  std::vector<double> expected;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t d = 0; d < D; ++d) {
      double sum = 0.0;
      for (int64_t j = 0; j < n; ++j) sum += xs[static_cast<size_t>((t * n + j) * D + d)];
      expected.push_back(sum / static_cast<double>(n));
    }
  }
  EXPECT_TRUE(testing::close_rel_l2(*out, expected, testing::kF32Tolerance));
}

}  // namespace
}  // namespace metrale
