// Hyper-connection pieces and PLE gating / gather on the CPU against direct double-precision
// formulas (qwen.md §7.1, §7.2 e-f). The references take a rounding function: the identity for f32
// activations, bf16 rounding at transformers' rounding points for bf16 activations. Either way the
// tolerance is far below one bf16 ulp (2^-9): only a rare flip at a rounding boundary may differ, so
// a missing or extra rounding point fails.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "kernels/hyper_connection.h"
#include "kernels/kernel_helpers.h"
#include "kernels/ple_gate.h"
#include "kernels/ple_gather.h"

namespace metrale {
namespace {

using testing::Random;
using Round = std::function<double(double)>;
using kernels::HcParams;
using kernels::HcUpdate;
using kernels::PleGateParams;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

Round rounding_of(DType dtype) {
  if (dtype == DType::kBF16) return [](double v) { return static_cast<double>(round_to_bf16(static_cast<float>(v))); };
  return [](double v) { return v; };
}
double tolerance_of(DType dtype) { return dtype == DType::kBF16 ? 1e-3 : 2e-6; }

// zc(x; w) = x / sqrt(mean(x^2) + eps) * (1 + w) over one group.
std::vector<double> zc(const double* x, const double* w, int64_t width, double eps) {
  double sum = 0.0;
  for (int64_t i = 0; i < width; ++i) sum += x[i] * x[i];
  const double inv = 1.0 / std::sqrt(sum / static_cast<double>(width) + eps);
  std::vector<double> y(static_cast<size_t>(width));
  for (int64_t i = 0; i < width; ++i) y[static_cast<size_t>(i)] = x[i] * inv * (1.0 + w[i]);
  return y;
}

// Values of a tensor as doubles (logical order).
std::vector<double> vals(const Tensor& t) { return testing::to_doubles(t); }

// ---------------------------------------------------------------------------------------------
// hc_norm

void check_hc_norm(HcUpdate update, DType dtype, bool with_norm, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "update " << static_cast<int>(update) << " dtype " << dtype_name(dtype));
  Random rng(seed);
  const int64_t tokens = 7, streams = 4, hidden = 48, width = streams * hidden;
  const Round rnd = rounding_of(dtype);
  // residual is a column slice of a wider buffer (strided rows).
  const OwnedTensor wide = testing::random_tensor(dtype, {tokens, width + 5}, rng, -2.0f, 2.0f);
  const Tensor residual = wide->slice(1, 3, 3 + width);
  const std::vector<double> r0 = vals(residual), wide0 = vals(*wide);
  const int64_t a_width = update == HcUpdate::kAdd ? width : hidden;
  const OwnedTensor a = testing::random_tensor(dtype, {tokens, a_width}, rng, -1.5f, 1.5f);
  const OwnedTensor b = testing::random_tensor(DType::kF32, {tokens, streams}, rng, 0.0f, 2.0f);
  const OwnedTensor weight = testing::random_tensor(DType::kF32, {width}, rng, -0.5f, 0.5f);
  OwnedTensor normed(dtype, {tokens, width});
  testing::poison(*normed);
  HcParams params;
  params.num_streams = static_cast<int>(streams);
  params.update = update;
  kernels::hc_norm(residual, update == HcUpdate::kNone ? Tensor() : *a, update == HcUpdate::kInject ? *b : Tensor(),
                   *weight, with_norm ? *normed : Tensor(), params);

  const std::vector<double> av = vals(*a), bv = vals(*b), wv = vals(*weight);
  std::vector<double> r_expected = r0, n_expected(static_cast<size_t>(tokens * width));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t n = 0; n < streams; ++n) {
      for (int64_t c = 0; c < hidden; ++c) {
        double& r = r_expected[static_cast<size_t>(t * width + n * hidden + c)];
        switch (update) {
          case HcUpdate::kNone: break;
          case HcUpdate::kAdd: r = rnd(r + av[static_cast<size_t>(t * width + n * hidden + c)]); break;
          case HcUpdate::kInject:
            r = rnd(r + rnd(bv[static_cast<size_t>(t * streams + n)] * av[static_cast<size_t>(t * hidden + c)]));
            break;
          case HcUpdate::kBroadcast: r = av[static_cast<size_t>(t * hidden + c)]; break;
        }
      }
      const std::vector<double> y = zc(&r_expected[static_cast<size_t>(t * width + n * hidden)], &wv[static_cast<size_t>(n * hidden)], hidden, 1e-6);
      for (int64_t c = 0; c < hidden; ++c) n_expected[static_cast<size_t>(t * width + n * hidden + c)] = rnd(y[static_cast<size_t>(c)]);
    }
  }
  if (update == HcUpdate::kNone) {
    EXPECT_EQ(vals(residual), r0);
  } else {
    EXPECT_TRUE(testing::close_rel_l2(residual, r_expected, tolerance_of(dtype) / 4)) << "residual";
  }
  if (with_norm) {
    EXPECT_TRUE(testing::close_rel_l2(*normed, n_expected, tolerance_of(dtype))) << "normed";
  } else {
    EXPECT_TRUE(std::isnan(vals(*normed)[0])) << "no norm asked: normed untouched";
  }
  // The columns outside the slice are untouched.
  const std::vector<double> all = vals(*wide);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c : {int64_t{0}, int64_t{1}, int64_t{2}, width + 3, width + 4}) {
      const size_t i = static_cast<size_t>(t * (width + 5) + c);
      EXPECT_EQ(all[i], wide0[i]) << "row " << t << " column " << c;
    }
  }
}

TEST(HcNorm, EveryUpdateModeMatchesTheFormula) {
  uint64_t seed = 1;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (HcUpdate update : {HcUpdate::kNone, HcUpdate::kAdd, HcUpdate::kInject, HcUpdate::kBroadcast}) {
      check_hc_norm(update, dtype, true, seed++);
    }
    check_hc_norm(HcUpdate::kInject, dtype, false, seed++);
  }
}

TEST(HcNorm, StreamsAreNormalisedApart) {
  // Stream 1 is stream 0 scaled by 100: with per-stream mean squares both normalise to the same values.
  const int64_t hidden = 16;
  std::vector<float> r(2 * hidden), w(2 * hidden, 0.0f), out(2 * hidden);
  for (int64_t c = 0; c < hidden; ++c) {
    r[static_cast<size_t>(c)] = static_cast<float>(c) - 7.5f;
    r[static_cast<size_t>(hidden + c)] = 100.0f * r[static_cast<size_t>(c)];
  }
  Tensor residual(r.data(), DType::kF32, {1, 2 * hidden}), weight(w.data(), DType::kF32, {2 * hidden}),
      normed(out.data(), DType::kF32, {1, 2 * hidden});
  HcParams params;
  params.num_streams = 2;
  kernels::hc_norm(residual, Tensor(), Tensor(), weight, normed, params);
  for (int64_t c = 0; c < hidden; ++c) EXPECT_NEAR(out[static_cast<size_t>(c)], out[static_cast<size_t>(hidden + c)], 1e-5);
}

// ---------------------------------------------------------------------------------------------
// hc_gates and hc_mix

TEST(HcGates, ActivationAndInjectionWeightsMatchTheFormula) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (bool with_inject : {true, false}) {
      Random rng(with_inject ? 3 : 4);
      const int64_t tokens = 5, rank = 40, streams = 3;
      const Round rnd = rounding_of(dtype);
      // One GEMM output [T, rank + N]: down and inject are column slices of it.
      const OwnedTensor projected = testing::random_tensor(dtype, {tokens, rank + streams}, rng, -6.0f, 6.0f);
      const Tensor down = projected->slice(1, 0, rank), inject = projected->slice(1, rank, rank + streams);
      OwnedTensor act(dtype, {tokens, rank}), beta(dtype, {tokens, streams});
      testing::poison(*act);
      testing::poison(*beta);
      HcParams params;
      params.num_streams = static_cast<int>(streams);
      kernels::hc_gates(down, with_inject ? inject : Tensor(), *act, with_inject ? *beta : Tensor(), params);
      std::vector<double> act_expected, beta_expected;
      for (double d : vals(down)) {
        const double s = rnd(d / static_cast<double>(streams));
        act_expected.push_back(rnd(s * sigmoid(s)));
      }
      for (double j : vals(inject)) beta_expected.push_back(2.0 * rnd(sigmoid(rnd(j / static_cast<double>(streams)))));
      EXPECT_TRUE(testing::close_rel_l2(*act, act_expected, tolerance_of(dtype)));
      if (with_inject) {
        EXPECT_TRUE(testing::close_rel_l2(*beta, beta_expected, tolerance_of(dtype)));
      } else {
        EXPECT_TRUE(std::isnan(vals(*beta)[0]));
      }
    }
  }
}

TEST(HcMix, StreamMeanOfGatedNormedStreams) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    Random rng(9);
    const int64_t tokens = 6, streams = 4, hidden = 40, width = streams * hidden;
    const Round rnd = rounding_of(dtype);
    const OwnedTensor up = testing::random_tensor(dtype, {tokens, width}, rng, -4.0f, 4.0f);
    const OwnedTensor normed = testing::random_tensor(dtype, {tokens, width}, rng, -2.0f, 2.0f);
    OwnedTensor x_wide(dtype, {tokens, hidden + 8});
    testing::poison(*x_wide);
    const Tensor x = x_wide->slice(1, 4, 4 + hidden);
    HcParams params;
    params.num_streams = static_cast<int>(streams);
    kernels::hc_mix(*up, *normed, x, params);
    const std::vector<double> u = vals(*up), r = vals(*normed);
    std::vector<double> expected;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < hidden; ++c) {
        double sum = 0.0;
        for (int64_t n = 0; n < streams; ++n) {
          const size_t i = static_cast<size_t>(t * width + n * hidden + c);
          sum += rnd(rnd(sigmoid(u[i])) * r[i]);
        }
        expected.push_back(rnd(sum / static_cast<double>(streams)));
      }
    }
    EXPECT_TRUE(testing::close_rel_l2(x, expected, tolerance_of(dtype)));
    EXPECT_TRUE(std::isnan(vals(*x_wide)[0])) << "columns outside the slice untouched";
  }
}

// ---------------------------------------------------------------------------------------------
// PLE gating

std::vector<double> reference_gate(const std::vector<double>& key, const std::vector<double>& value,
                                   const std::vector<double>& residual, const std::vector<double>& wk,
                                   const std::vector<double>& wq, const std::vector<double>& wc, int64_t tokens,
                                   int64_t streams, int64_t hidden, const Round& rnd, std::vector<double>& gated) {
  const int64_t width = streams * hidden;
  std::vector<double> normed(static_cast<size_t>(tokens * width));
  gated.assign(static_cast<size_t>(tokens * width), 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t n = 0; n < streams; ++n) {
      const size_t base = static_cast<size_t>(t * width + n * hidden);
      const std::vector<double> k = zc(&key[base], &wk[static_cast<size_t>(n * hidden)], hidden, 1e-6);
      const std::vector<double> q = zc(&residual[base], &wq[static_cast<size_t>(n * hidden)], hidden, 1e-6);
      double dot = 0.0;
      for (int64_t c = 0; c < hidden; ++c) dot += rnd(rnd(k[static_cast<size_t>(c)]) * rnd(q[static_cast<size_t>(c)]));
      const double s = rnd(rnd(dot) / std::sqrt(static_cast<double>(hidden)));
      const double magnitude = rnd(std::sqrt(rnd(std::max(std::fabs(s), 1e-6))));
      const double s_hat = s > 0 ? magnitude : (s < 0 ? -magnitude : 0.0);
      const double sigma = rnd(sigmoid(s_hat));
      for (int64_t c = 0; c < hidden; ++c) gated[base + static_cast<size_t>(c)] = rnd(sigma * value[static_cast<size_t>(t * hidden + c)]);
      const std::vector<double> y = zc(&gated[base], &wc[static_cast<size_t>(n * hidden)], hidden, 1e-6);
      for (int64_t c = 0; c < hidden; ++c) normed[base + static_cast<size_t>(c)] = rnd(y[static_cast<size_t>(c)]);
    }
  }
  return normed;
}

TEST(PleGate, MatchesTheFormula) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    Random rng(dtype == DType::kF32 ? 21 : 22);
    const int64_t tokens = 9, streams = 4, hidden = 64, width = streams * hidden;
    const OwnedTensor key = testing::random_tensor(dtype, {tokens, width}, rng, -2.0f, 2.0f);
    const OwnedTensor value = testing::random_tensor(dtype, {tokens, hidden}, rng, -2.0f, 2.0f);
    const OwnedTensor residual = testing::random_tensor(dtype, {tokens, width}, rng, -3.0f, 3.0f);
    const OwnedTensor wk = testing::random_tensor(DType::kF32, {width}, rng, -0.5f, 0.5f);
    const OwnedTensor wq = testing::random_tensor(DType::kF32, {width}, rng, -0.5f, 0.5f);
    const OwnedTensor wc = testing::random_tensor(DType::kF32, {width}, rng, -0.5f, 0.5f);
    // Token 3: a key row orthogonal-ish to the query... make stream 0 of token 3 give s = 0 exactly:
    // key zero there gives k = 0, hence s = 0, s^ = 0, sigmoid 0.5.
    {
      std::vector<double> k = vals(*key);
      for (int64_t c = 0; c < hidden; ++c) k[static_cast<size_t>(3 * width + c)] = 0.0;
      std::vector<float> kf(k.begin(), k.end());
      testing::fill(*key, kf);
    }
    OwnedTensor gated(dtype, {tokens, width}), gated_normed(dtype, {tokens, width});
    testing::poison(*gated);
    testing::poison(*gated_normed);
    PleGateParams params;
    params.num_streams = static_cast<int>(streams);
    kernels::ple_gate(*key, *value, *residual, *wk, *wq, *wc, *gated, *gated_normed, params);
    std::vector<double> gated_expected;
    const std::vector<double> normed_expected =
        reference_gate(vals(*key), vals(*value), vals(*residual), vals(*wk), vals(*wq), vals(*wc), tokens, streams,
                       hidden, rounding_of(dtype), gated_expected);
    EXPECT_TRUE(testing::close_rel_l2(*gated, gated_expected, tolerance_of(dtype))) << dtype_name(dtype);
    EXPECT_TRUE(testing::close_rel_l2(*gated_normed, normed_expected, tolerance_of(dtype))) << dtype_name(dtype);
    // s = 0: the gate is exactly 0.5 * value.
    const std::vector<double> g = vals(*gated), v = vals(*value);
    for (int64_t c = 0; c < hidden; ++c) {
      EXPECT_EQ(g[static_cast<size_t>(3 * width + c)], 0.5 * v[static_cast<size_t>(3 * hidden + c)]) << c;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// PLE gather

TEST(PleGather, CopiesRowsPerHeadAndRejectsBadIds) {
  Random rng(31);
  const int64_t rows = 300, width = 10, tokens = 5, heads = 3;
  const OwnedTensor table = testing::random_tensor(DType::kBF16, {rows, width}, rng);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < tokens * heads; ++i) ids.push_back(rng.integer(0, rows - 1));
  ids[4] = rows - 1;
  ids[7] = ids[8];  // the same row twice in one step
  Tensor id_tensor(ids.data(), DType::kI64, {tokens, heads});
  const std::vector<double> t = vals(*table);
  for (DType out_dtype : {DType::kBF16, DType::kF32}) {
    OwnedTensor out_wide(out_dtype, {tokens, heads * width + 6});
    testing::poison(*out_wide);
    const Tensor out = out_wide->slice(1, 2, 2 + heads * width);
    kernels::ple_gather(*table, id_tensor, out);
    std::vector<double> expected;
    for (int64_t i = 0; i < tokens * heads; ++i) {
      expected.insert(expected.end(), t.begin() + ids[static_cast<size_t>(i)] * width,
                      t.begin() + (ids[static_cast<size_t>(i)] + 1) * width);
    }
    EXPECT_EQ(vals(out), expected) << dtype_name(out_dtype);
  }
  ids[2] = rows;
  OwnedTensor out(DType::kBF16, {tokens, heads * width});
  EXPECT_THROW(kernels::ple_gather(*table, id_tensor, *out), Error);
  ids[2] = -1;
  EXPECT_THROW(kernels::ple_gather(*table, id_tensor, *out), Error);
}

}  // namespace
}  // namespace metrale
